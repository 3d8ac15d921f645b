"""The fused decoder-layer ops at Llama-3-8B shapes on the GPU: what each replaces against the Triton kernel.

For each op and token count it checks the Triton result against float64 and times both sides
(median of `triton.testing.do_bench`, CUDA-graph replay), so the choice of the CUDA default rests
on a measurement. RMSNorm, SiLU·up and the rotary embedding fused with the KV-cache write are timed
against their torch chains. The greedy choice (argmax and its log-probability over the
128k vocabulary, at decode batch sizes) is timed against the torch chain on float32 logits that
the engine ran before.

    python benchmarks/fused_ops.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import fused_torch, fused_triton, greedy, greedy_triton  # noqa: E402

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, VOCAB = 4096, 14336, 32, 8, 128, 16, 128256
MAX_GREEDY_ROWS = 256  # one row per decoding sequence
DTYPE = torch.bfloat16
TORCH_CHAIN = "torch"
FLOAT32_CHAIN = "float32 upcast, max, logsumexp"


@dataclass
class Case:
    """One op at one token count: the code it replaces, the Triton kernel, and its float64 check."""

    baseline: str
    run_baseline: Callable[[], object]
    run_triton: Callable[[], object]
    check: Callable[[], float]


def _graph_time_us(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _cases(tokens: int) -> dict[str, Case]:
    """op name -> its Case, on fresh random inputs."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=DTYPE, generator=gen)
    residual = torch.randn(tokens, HIDDEN, device="cuda", dtype=DTYPE, generator=gen)
    weight = torch.rand(HIDDEN, device="cuda", dtype=DTYPE, generator=gen) + 0.5
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE, device="cuda", dtype=DTYPE, generator=gen) * 3
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    freqs = torch.outer(torch.arange(8192.0), 1.0 / 500000 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().cuda(), emb.sin().cuda()
    positions = torch.randint(0, 8192, (tokens,), device="cuda", generator=gen)
    num_blocks = tokens // BLOCK_SIZE + 2
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda", generator=gen)[:tokens]

    def qkv_views(buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = buffer.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        return q.view(tokens, HEADS, HEAD_DIM), k.view(tokens, KV_HEADS, HEAD_DIM), v.view(tokens, KV_HEADS, HEAD_DIM)

    def qk(buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return qkv_views(buffer)[:2]

    def caches() -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.zeros(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
                     for _ in range(2))

    def check_norm() -> float:
        out, _ = fused_triton.add_rms_norm(x, residual, weight, 1e-5)
        want, _ = fused_torch.add_rms_norm(x.double(), residual.double(), weight.double(), 1e-5)
        return _rel(out, want)

    def check_silu() -> float:
        return _rel(fused_triton.silu_and_mul(gate_up), fused_torch.silu_and_mul(gate_up.double()))

    def check_rotary_and_write_kv() -> float:
        got, (k_cache, v_cache) = qkv.clone(), caches()
        fused_triton.rotary_and_write_kv(*qkv_views(got), cos, sin, positions, k_cache, v_cache, slots)
        want_q, want_k = fused_torch.rotary(*qk(qkv.double()), cos.double(), sin.double(), positions)
        got_q, got_k, _ = qkv_views(got)
        cached_k, cached_v = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]
        return max(_rel(got_q, want_q), _rel(got_k, want_k), _rel(cached_k, want_k),
                   _rel(cached_v, qkv_views(qkv)[2]))

    scratch = qkv.clone()
    q, k, v = qkv_views(scratch)
    k_cache, v_cache = caches()

    logits = torch.randn(min(tokens, MAX_GREEDY_ROWS), VOCAB, device="cuda", dtype=DTYPE, generator=gen) * 4

    def check_greedy() -> float:
        token_ids, logprobs = greedy_triton.greedy(logits, VOCAB)
        reference = logits.double()
        if not torch.equal(token_ids, reference.argmax(dim=-1)):
            return float("inf")
        return _rel(logprobs, reference.log_softmax(dim=-1).gather(1, token_ids[:, None]).squeeze(1))

    cases = {
        "add_rms_norm": Case(TORCH_CHAIN, lambda: fused_torch.add_rms_norm(x, residual, weight, 1e-5),
                             lambda: fused_triton.add_rms_norm(x, residual, weight, 1e-5), check_norm),
        "silu_and_mul": Case(TORCH_CHAIN, lambda: fused_torch.silu_and_mul(gate_up),
                             lambda: fused_triton.silu_and_mul(gate_up), check_silu),
        "rotary_and_write_kv": Case(
            TORCH_CHAIN, lambda: fused_torch.rotary_and_write_kv(q, k, v, cos, sin, positions, k_cache, v_cache, slots),
            lambda: fused_triton.rotary_and_write_kv(q, k, v, cos, sin, positions, k_cache, v_cache, slots),
            check_rotary_and_write_kv,
        ),
    }
    if tokens <= MAX_GREEDY_ROWS:
        cases["greedy"] = Case(FLOAT32_CHAIN, lambda: greedy.greedy_torch(logits.float(), VOCAB),
                               lambda: greedy_triton.greedy(logits, VOCAB), check_greedy)
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 16, 64, 256, 2048, 8192])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    print(f"{'op':<21}{'tokens':>7}{'baseline us':>13}{'triton us':>11}{'speedup':>9}{'rel err':>10}  baseline")
    for tokens in args.tokens:
        for name, case in _cases(tokens).items():
            err = case.check()
            baseline_us = _graph_time_us(case.run_baseline)
            triton_us = _graph_time_us(case.run_triton)
            rows.append(dict(op=name, tokens=tokens, baseline=case.baseline, baseline_us=baseline_us,
                             triton_us=triton_us, rel_err=err))
            print(f"{name:<21}{tokens:>7}{baseline_us:>13.1f}{triton_us:>11.1f}{baseline_us / triton_us:>8.2f}x"
                  f"{err:>10.1e}  {case.baseline}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fused_ops.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
