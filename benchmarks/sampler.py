"""The full sampler's cost per step (`engine.sampler.Sampler`), against the greedy path, at Llama-3's vocabulary.

Serving's (a) with temperature 0.8 and top-p 0.95 took 13.0 ms a decode step on the H200 against 7.7 ms greedy
(BENCHMARKS.md, twenty-second session). This times the sampler alone on one step's logits (also with serving.py's
penalties and logprobs over 512 + 64 tokens a row), and its top-p filter (`kernels.top_p`) for flat and peaked
distributions: `--scales` are the logits' standard deviations (a
random-weight model's logits are nearly flat; a trained model's are peaked, so its top-p nucleus is among the few
hundred candidates the torch path searches before it sorts the whole vocabulary). On CUDA the Triton filter is
also timed in each of `--triton-configs` (thresholds tested per pass, tile, warps). Each figure is the median
wall time of `--repeats` calls, the device synchronized around each.

    python benchmarks/sampler.py [--rows 32 128] [--scales 0.5 8] [--triton-configs 7:16384:16 ...]
                                 [--device cuda] [--out DIR]
"""
from __future__ import annotations

import argparse
import array
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.sampler import Sampler, _top_p  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.sampling_row import SamplingRow  # noqa: E402
from kernels.top_p import top_p_torch  # noqa: E402

VOCAB = 128256


def timed_ms(run, device: torch.device, repeats: int) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    run()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def nucleus_size(logits: torch.Tensor, temperature: float, top_p: float) -> float:
    """Mean tokens in the rows' top-p nucleus."""
    probs = (logits.float() / temperature).softmax(dim=-1).sort(dim=-1, descending=True).values
    return float(((probs.cumsum(dim=-1) - probs) < top_p).sum(dim=-1).float().mean())


def _triton_config(config: str) -> dict:
    probes, tile, warps = (int(v) for v in config.split(":"))
    return dict(probes=probes, tile=tile, num_warps=warps)


def case(rows: int, scale: float, device: torch.device, repeats: int, temperature: float, top_p: float,
         configs: list[str]) -> dict:
    generator = torch.Generator(device=device).manual_seed(0)
    logits = (scale * torch.randn(rows, VOCAB, generator=generator, device=device)).to(torch.bfloat16)
    sampler = Sampler(eos_token_ids=set(), vocab_size=VOCAB)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=16)
    sampled_rows = [SamplingRow(params, [1], []) for _ in range(rows)]
    # chat-like rows: serving.py's penalties and logprobs over a 512-token prompt and 64 tokens out
    chat = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=128, repetition_penalty=1.1,
                          frequency_penalty=0.3, presence_penalty=0.3, logprobs=1)
    token_ids = torch.randint(VOCAB, (rows, 576), generator=torch.Generator().manual_seed(1)).tolist()
    chat_rows = [SamplingRow(chat, array.array("q", ids[:512]), ids[512:]) for ids in token_ids]  # as the engine
    probs = (logits.float() / temperature).softmax(dim=-1)
    index = torch.arange(rows, device=device)
    top_ps = torch.full((rows,), top_p, device=device)
    result = dict(rows=rows, scale=scale, nucleus_tokens=round(nucleus_size(logits, temperature, top_p), 1),
                  greedy_ms=timed_ms(lambda: sampler.greedy(logits), device, repeats),
                  sampled_ms=timed_ms(lambda: sampler(logits, sampled_rows), device, repeats),
                  penalties_logprobs_ms=timed_ms(lambda: sampler(logits, chat_rows), device, repeats),
                  top_p_ms=timed_ms(lambda: _top_p(probs.clone(), sampled_rows), device, repeats),
                  top_p_torch_ms=timed_ms(lambda: top_p_torch(probs.clone(), index, top_ps), device, repeats),
                  clone_ms=timed_ms(lambda: probs.clone(), device, repeats))
    if device.type == "cuda":
        from kernels import top_p_triton

        result["top_p_triton_ms"] = {
            config: timed_ms(lambda: top_p_triton.top_p_(probs.clone(), index, top_ps, **_triton_config(config)),
                             device, repeats) for config in configs}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="*", default=[32, 128])
    parser.add_argument("--scales", type=float, nargs="*", default=[0.5, 8.0])
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--triton-configs", nargs="*", default=["7:16384:16"],
                        help="the Triton filter's launches to time, each PROBES:TILE:WARPS")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    results = []
    print("| rows | logits std | nucleus tokens | greedy ms | temperature + top-p ms | + penalties, logprobs ms "
          "| of which `_top_p` ms | torch top-p ms | a clone ms | Triton top-p ms by probes:tile:warps |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rows in args.rows:
        for scale in args.scales:
            r = case(rows, scale, device, args.repeats, args.temperature, args.top_p, args.triton_configs)
            results.append(r)
            triton_ms = ", ".join(f"{c}: {ms:.3f}" for c, ms in r.get("top_p_triton_ms", {}).items())
            print(f"| {rows} | {scale} | {r['nucleus_tokens']} | {r['greedy_ms']:.2f} | {r['sampled_ms']:.2f} "
                  f"| {r['penalties_logprobs_ms']:.2f} | {r['top_p_ms']:.2f} | {r['top_p_torch_ms']:.2f} "
                  f"| {r['clone_ms']:.3f} | {triton_ms} |", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sampler.json").write_text(json.dumps(dict(device=str(device), results=results), indent=1))


if __name__ == "__main__":
    main()
