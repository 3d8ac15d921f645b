"""Prefill attention over the paged cache at Llama-3-8B shapes: the Triton kernel vs the per-sequence SDPA loop.

One call is one layer's attention for a step's prefill rows (no decode rows). For each case it
reports the GPU time (`triton.testing.do_bench_cudagraph`: launches replayed from a CUDA graph, so
no host cost) and the host time (wall time of one call issued to an idle GPU, without a sync: what
the engine thread pays per layer), for the torch loop (`kernels.attention.paged_attention_prefill`,
given the new keys and values as the engine does) and the Triton kernel; and the Triton plan's
build time, paid once per step. `--sweep` times every candidate in `CONFIGS` (to pick
`DEFAULT_CONFIG`); the Triton output is compared with the torch loop's.

    python benchmarks/prefill_attention.py [--sweep] [--out DIR]
    python benchmarks/prefill_attention.py --smoke     # tiny shapes; on a CPU under the Triton interpreter
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accuracy import relative_error  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
SMOKE_HEADS, SMOKE_KV_HEADS, SMOKE_HEAD_DIM = 8, 2, 16
HOST_REPEATS = 20

# name -> (new tokens per sequence, earlier context tokens per sequence)
CASES = {
    "fresh_16x512": ([512] * 16, [0] * 16),
    "fresh_1x8192": ([8192], [0]),
    # one fresh prompt each: where SDPA starts to win (kernels.prefill_attention_triton.SDPA_MIN_FRESH_TOKENS)
    "fresh_1x1024": ([1024], [0]),
    "fresh_1x2048": ([2048], [0]),
    "fresh_1x4096": ([4096], [0]),
    "chunk_4x2048_after_2048": ([2048] * 4, [2048] * 4),
    "fresh_112x64": ([64] * 112, [0] * 112),
}
SMOKE_CASES = {
    "fresh_3x20": ([20, 20, 20], [0, 0, 0]),
    "chunk_2x24_after_40": ([24, 24], [40, 40]),
}


def _gpu_us(fn: Callable[[], object], device: torch.device) -> tuple[float, str]:
    """GPU time of one call and how it was measured (a CUDA graph when the call can be captured)."""
    if device.type != "cuda":
        fn()
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e6, "wall"
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3, "cudagraph"
    except RuntimeError:
        return triton.testing.do_bench(fn, rep=50) * 1e3, "events"


def _host_us(fn: Callable[[], object], device: torch.device) -> float:
    """Median wall time of issuing one call to an idle device (the launches, not the kernels)."""
    samples = []
    for _ in range(HOST_REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - begin) * 1e6)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(samples)


class Step:
    """One step's prefill rows: q, a shuffled paged cache holding every context token, and the new k/v."""

    def __init__(self, query_lens: list[int], earlier: list[int], heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        gen = torch.Generator(device=device).manual_seed(sum(query_lens) + len(query_lens))
        self.query_lens = query_lens
        self.context_lens = [q + e for q, e in zip(query_lens, earlier)]
        blocks = [-(-n // BLOCK_SIZE) for n in self.context_lens]
        num_blocks = sum(blocks)
        shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        self.v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        order = torch.randperm(num_blocks, generator=gen, device=device)
        self.tables = torch.zeros(len(blocks), max(blocks), dtype=torch.long, device=device)
        first = 0
        for row, n in enumerate(blocks):
            self.tables[row, :n] = order[first:first + n]
            first += n
        self.q = torch.randn(sum(query_lens), heads, head_dim, generator=gen, device=device, dtype=dtype)
        self.k, self.v = self._new_tokens(self.k_cache), self._new_tokens(self.v_cache)
        self.scale = head_dim ** -0.5

    def _new_tokens(self, cache: torch.Tensor) -> torch.Tensor:
        """[T, kv_heads, D]: the cached keys (or values) at the new tokens' positions, as write_kv left them."""
        rows = []
        for table, q_len, ctx in zip(self.tables, self.query_lens, self.context_lens):
            rows.append(cache[table].flatten(0, 1)[ctx - q_len:ctx])
        return torch.cat(rows)


def run_case(name: str, step: Step, configs: dict, device: torch.device) -> dict:
    from kernels.attention import paged_attention_prefill as torch_prefill
    from kernels.prefill_attention_triton import PrefillPlan, paged_attention_prefill

    out = torch.empty_like(step.q)
    group = step.q.shape[1] // step.k_cache.shape[2]

    def torch_loop():
        return torch_prefill(step.q, step.k_cache, step.v_cache, step.tables, step.query_lens, step.context_lens,
                             step.scale, step.k, step.v, out)

    want = torch_loop().clone()
    torch_gpu, torch_how = _gpu_us(torch_loop, device)
    row = dict(case=name, sequences=len(step.query_lens), rows=sum(step.query_lens),
               context_tokens=sum(step.context_lens), torch_gpu_us=torch_gpu, torch_gpu_timer=torch_how,
               torch_host_us=_host_us(torch_loop, device), triton={})
    for config_name, config in configs.items():
        block_q = config.block_q(group)
        plan = PrefillPlan.build(step.query_lens, step.context_lens, device, block_q)

        def kernel(plan=plan, config=config):
            return paged_attention_prefill(step.q, step.k_cache, step.v_cache, step.tables, plan, step.scale,
                                           out=out, config=config)

        try:
            diff = relative_error(kernel(), want)
        except Exception as error:  # noqa: BLE001 - a candidate that does not compile here (e.g. shared memory)
            row["triton"][config_name] = dict(error=f"{type(error).__name__}: {error}")
            continue
        gpu, how = _gpu_us(kernel, device)
        row["triton"][config_name] = dict(
            gpu_us=gpu, gpu_timer=how, host_us=_host_us(kernel, device), rel_diff_vs_torch=diff,
            programs=plan.num_tiles * step.k_cache.shape[2],
            plan_us=_host_us(lambda block_q=block_q: PrefillPlan.build(step.query_lens, step.context_lens, device,
                                                                       block_q), device),
        )
    return row


def main() -> None:
    from kernels import prefill_attention_triton
    from kernels.prefill_attention_triton import CONFIGS, DEFAULT_CONFIG

    # the kernel on every sequence, long fresh prompts too: these numbers are what decides which of them
    # the engine leaves to SDPA (SDPA_MIN_FRESH_TOKENS)
    prefill_attention_triton.SDPA_MIN_FRESH_TOKENS = sys.maxsize

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", choices=sorted(CASES), help="default: all")
    parser.add_argument("--sweep", action="store_true", help="time every candidate config, not just the default")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, fp16; runs on a CPU (Triton interpreter)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        cases, dtype = SMOKE_CASES, torch.float16
        heads, kv_heads, head_dim = SMOKE_HEADS, SMOKE_KV_HEADS, SMOKE_HEAD_DIM
    else:
        if device.type != "cuda":
            raise SystemExit("needs a CUDA device (or --smoke)")
        cases = {name: CASES[name] for name in (args.cases or CASES)}
        dtype, heads, kv_heads, head_dim = torch.bfloat16, HEADS, KV_HEADS, HEAD_DIM
    default_name = next(name for name, config in CONFIGS.items() if config == DEFAULT_CONFIG)
    configs = CONFIGS if args.sweep else {default_name: DEFAULT_CONFIG}
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, {dtype}, "
          f"heads {heads}/{kv_heads}, head_dim {head_dim}, block {BLOCK_SIZE}; per layer, us")
    print(f"{'case':<26}{'config':<17}{'torch gpu':>10}{'torch host':>11}{'triton gpu':>11}{'triton host':>12}"
          f"{'gpu x':>7}{'host x':>8}{'plan host':>10}{'rel diff':>9}")
    rows = []
    for name, (query_lens, earlier) in cases.items():
        step = Step(query_lens, earlier, heads, kv_heads, head_dim, dtype, device)
        row = run_case(name, step, configs, device)
        rows.append(row)
        for config_name, t in row["triton"].items():
            if "error" in t:
                print(f"{name:<26}{config_name:<17}{t['error'][:120]}", flush=True)
                continue
            print(f"{name:<26}{config_name:<17}{row['torch_gpu_us']:>10.1f}{row['torch_host_us']:>11.1f}"
                  f"{t['gpu_us']:>11.1f}{t['host_us']:>12.1f}{row['torch_gpu_us'] / t['gpu_us']:>6.2f}x"
                  f"{row['torch_host_us'] / t['host_us']:>7.1f}x{t['plan_us']:>10.1f}{t['rel_diff_vs_torch']:>9.1e}",
                  flush=True)
        del step
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        result = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", dtype=str(dtype),
                      heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=BLOCK_SIZE,
                      default_config=default_name,
                      configs={name: asdict(config) for name, config in configs.items()}, cases=rows)
        (args.out / "prefill_attention.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    main()
