"""The fused decoder-layer ops, torch reference vs Triton, at Llama-3-8B shapes on the GPU.

For each op and token count it checks the Triton result against float64 and times both backends
(median of `triton.testing.do_bench`, CUDA-graph replay), so the choice of the CUDA default rests
on a measurement.

    python benchmarks/fused_ops.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import fused_torch, fused_triton  # noqa: E402

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
DTYPE = torch.bfloat16


def _graph_time_us(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _cases(tokens: int) -> dict[str, tuple[Callable, Callable]]:
    """op name -> (run with a backend module, float64 reference check returning the relative error)."""
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

    def qk(buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = buffer.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        return q.view(tokens, HEADS, HEAD_DIM), k.view(tokens, KV_HEADS, HEAD_DIM)

    def check_norm() -> float:
        out, _ = fused_triton.add_rms_norm(x, residual, weight, 1e-5)
        want, _ = fused_torch.add_rms_norm(x.double(), residual.double(), weight.double(), 1e-5)
        return _rel(out, want)

    def check_silu() -> float:
        return _rel(fused_triton.silu_and_mul(gate_up), fused_torch.silu_and_mul(gate_up.double()))

    def check_rotary() -> float:
        got = qkv.clone()
        fused_triton.rotary(*qk(got), cos, sin, positions)
        want_q, want_k = fused_torch.rotary(*qk(qkv.double()), cos.double(), sin.double(), positions)
        got_q, got_k = qk(got)
        return max(_rel(got_q, want_q), _rel(got_k, want_k))

    scratch = qkv.clone()
    return {
        "add_rms_norm": (lambda m: m.add_rms_norm(x, residual, weight, 1e-5), check_norm),
        "silu_and_mul": (lambda m: m.silu_and_mul(gate_up), check_silu),
        "rotary": (lambda m: m.rotary(*qk(scratch), cos, sin, positions), check_rotary),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 16, 64, 256, 2048, 8192])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    print(f"{'op':<14}{'tokens':>7}{'torch us':>10}{'triton us':>11}{'speedup':>9}{'rel err':>10}")
    for tokens in args.tokens:
        for name, (run, check) in _cases(tokens).items():
            err = check()
            torch_us = _graph_time_us(lambda: run(fused_torch))
            triton_us = _graph_time_us(lambda: run(fused_triton))
            rows.append(dict(op=name, tokens=tokens, torch_us=torch_us, triton_us=triton_us, rel_err=err))
            print(f"{name:<14}{tokens:>7}{torch_us:>10.1f}{triton_us:>11.1f}{torch_us / triton_us:>8.2f}x{err:>10.1e}",
                  flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fused_ops.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
