"""What LoRA adds to an admitting step on the GPU, and in which kernels: the step that prefills a full
`max_num_batched_tokens` of prompts (16 × 512 tokens), alone or beside running decode rows, with its rows on
0 (base rows in the LoRA engine), 1, 16 or 64 adapters. The serving workloads spend most of their time in such
steps, and their LoRA share is what separates (c) from (a) there.

    python3 benchmarks/prefill_step.py --out DIR

Per case: the median wall time of `--steps` synchronized steps, and one step's kernels by GPU time
(torch.profiler), written to DIR/prefill_profile_<decode rows>_<adapters>.txt.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving import (  # noqa: E402
    SHAPES, finish_prefills, lora_requests, make_adapters, make_model_dir, prompts, sync,
)
from engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams  # noqa: E402
from engine.config import CUDAGRAPH_MODES  # noqa: E402

MAX_ADAPTERS = 64
# kernel names of the LoRA work, for the per-case total (the shrinks, expands and the fused ops' LoRA variants)
LORA_KERNELS = ("shrink", "expand", "lora", "tiles")


def adapter_for(row: int, adapters: list[LoRARequest], spread: int) -> LoRARequest | None:
    return adapters[row % spread] if spread else None


def admit(engine: LLMEngine, batch: list[list[int]], adapters: list[LoRARequest], spread: int, first: int) -> None:
    """Prompts that end at their prefill step, so that each measured step admits the same work."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i, prompt in enumerate(batch):
        engine.add_request(prompt, params, adapter_for(first + i, adapters, spread))


def start_decode_rows(engine: LLMEngine, rows: int, context: int, vocab: int, adapters: list[LoRARequest],
                      spread: int, steps: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    for i, prompt in enumerate(prompts(rows, context, vocab, seed=11)):
        engine.add_request(prompt, params, adapter_for(i, adapters, spread))
    finish_prefills(engine)


def kernel_profile(engine: LLMEngine, batch: list[list[int]], adapters: list[LoRARequest],
                   spread: int) -> tuple[str, float]:
    """One admitting step's kernels by GPU time, and the share of it in LoRA kernels (ms)."""
    from torch.profiler import ProfilerActivity, profile

    admit(engine, batch, adapters, spread, first=0)
    sync()
    activity = ProfilerActivity.CUDA if engine.device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        engine.step()
        sync()
    events = prof.key_averages()
    lora_ms = sum(e.device_time_total for e in events if any(k in e.key.lower() for k in LORA_KERNELS)) / 1e3
    sort = "cuda_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
    return events.table(sort_by=sort, row_limit=40), lora_ms


def measure_case(engine: LLMEngine, args, adapters: list[LoRARequest], spread: int, decode_rows: int,
                 vocab: int, out: Path) -> dict:
    if decode_rows:
        start_decode_rows(engine, decode_rows, args.prompt_len, vocab, adapters, spread, args.steps + 4)
    walls = []
    for step in range(args.steps + 2):
        admit(engine, prompts(args.prompts, args.prompt_len, vocab, seed=100 + step), adapters, spread, first=step)
        sync()
        t = time.perf_counter()
        engine.step()
        sync()
        if step >= 2:  # the first two compile and warm what this mix of rows needs
            walls.append(time.perf_counter() - t)
    table, lora_ms = kernel_profile(engine, prompts(args.prompts, args.prompt_len, vocab, seed=99), adapters, spread)
    (out / f"prefill_profile_{decode_rows}_{spread}.txt").write_text(table)
    for request_id in list(engine.requests):
        engine.abort(request_id)
    engine.drain()
    return dict(decode_rows=decode_rows, adapters=spread, step_ms=1e3 * statistics.median(walls),
                step_ms_all=[1e3 * w for w in walls], lora_kernels_ms=lora_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-rows", type=int, nargs="+", default=[0, 128])
    parser.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 16, 64],
                        help="distinct adapters the rows are spread over (0: every row on the base model)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the code (--shape small)")
    parser.add_argument("--cudagraph-mode", choices=CUDAGRAPH_MODES, default="full_and_piecewise")
    parser.add_argument("--work", default="/tmp/loraserve-bench")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    model_dir = make_model_dir(work, args.shape)
    paths = make_adapters(work / f"adapters-{args.shape}", model_dir, args.shape, MAX_ADAPTERS, 16)
    adapters = lora_requests(paths)
    engine = LLMEngine(EngineConfig(
        model=str(model_dir), dtype="bfloat16" if args.device == "cuda" else "float32", device=args.device,
        load_format="dummy",
        max_model_len=2 * args.prompt_len + args.steps + 64, max_num_seqs=max(args.decode_rows) + args.prompts,
        max_num_batched_tokens=args.prompts * args.prompt_len + max(args.decode_rows), enable_lora=True,
        max_loras=MAX_ADAPTERS, max_cpu_loras=MAX_ADAPTERS, max_lora_rank=16, cudagraph_mode=args.cudagraph_mode))
    for adapter in adapters:  # read now: a step never waits for a background read, it admits without the prompt
        engine.lora_manager.add(adapter)
    vocab = engine.hf_config.vocab_size
    results = []
    for decode_rows in args.decode_rows:
        for spread in args.adapters:
            result = measure_case(engine, args, adapters, spread, decode_rows, vocab, args.out)
            print({k: v for k, v in result.items() if k != "step_ms_all"}, flush=True)
            results.append(result)
            (args.out / "prefill_step.json").write_text(json.dumps(results, indent=2))
    engine.close()


if __name__ == "__main__":
    main()
