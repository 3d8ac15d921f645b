"""Two untried ways to cut what LoRA costs a prefill-sized step, probed before either is built (H200).

1. **Shrinks beside the base GEMM.** A prefill GEMM is compute-bound and a segment shrink memory-bound, so
   a shrink forked onto a side stream might hide under the GEMM, as the decode graphs' shrinks hide beside
   their skinny GEMMs. Per projection: the GEMM alone, the shrink alone, both in sequence, both forked.
2. **The expand's read of y moved into the GEMM.** The segment expand reads and writes the projection's
   output (`y += h B^T`). If the expand wrote the delta and the GEMM then added its product to it (beta = 1,
   C = D), the read of y would ride in the GEMM's epilogue. Per projection: `mm` against `addmm_` into y
   (what reading C costs the GEMM) and the expand it would replace.

Each variant is one CUDA-graph replay (`triton.testing.do_bench_cudagraph`), at Llama-3-8B shapes, rank 16,
bf16, tokens spread evenly over the adapters in shuffled order. o and down are the projections whose
expands the segment path keeps (`lora_tuning.FOLDED_OPS`); qkv and gate/up are timed too, for the shrinks.

    python benchmarks/prefill_lora_overlap.py [--tokens 8192] [--adapters 8 64] [--out DIR]
    python benchmarks/prefill_lora_overlap.py --smoke   # tiny shapes on a CPU: checks the variants agree
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels
from benchmarks.lora_kernels import (
    LLAMA3_8B,
    NUM_SLOTS,
    SMOKE,
    Group,
    Weights,
    assign_slots,
    rand,
)
from benchmarks.timing import graph_time_us

RANK = 16


@dataclass
class Projection:
    """One projection's step: input, base weight, output buffer, adapter stacks and the step's metadata."""

    group: Group
    x: torch.Tensor
    w: torch.Tensor
    y: torch.Tensor
    a: list[torch.Tensor]
    b: list[torch.Tensor]
    meta: kernels.LoRAMetadata

    @classmethod
    def make(cls, group: Group, weights: Weights, tokens: int, adapters: int) -> Projection:
        n = sum(group.widths)
        meta = kernels.prepare_lora_metadata(assign_slots(tokens, adapters), NUM_SLOTS)
        return cls(group, rand(tokens, group.k), rand(n, group.k, scale=group.k ** -0.5), rand(tokens, n),
                   weights.a[group.name], weights.b[group.name], meta)

    def gemm(self) -> None:
        torch.mm(self.x, self.w.t(), out=self.y)

    def shrink(self) -> torch.Tensor:
        return kernels.lora_shrink_slices(self.x, self.a, self.meta)

    def forked(self, side: torch.cuda.Stream | None) -> torch.Tensor:
        """The shrink on `side` while the GEMM runs on the current stream (in sequence without a side stream)."""
        if side is None:
            self.gemm()
            return self.shrink()
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            h = self.shrink()
        self.gemm()
        main.wait_stream(side)
        return h

    def gemm_accumulate(self) -> None:
        self.y.addmm_(self.x, self.w.t())

    def expand(self, h: torch.Tensor) -> None:
        kernels.lora_expand_slices(self.y, h, self.b, self.meta)


@dataclass
class Row:
    projection: str
    tokens: int
    adapters: int
    gemm_us: float
    shrink_us: float
    serial_us: float
    forked_us: float
    gemm_accumulate_us: float
    expand_us: float


def check(p: Projection, side: torch.cuda.Stream | None) -> None:
    """The forked step gives the serial one's y, and its h up to summation order (the shrink splits K and adds
    the parts atomically); the delta added by a beta-1 GEMM matches the expand's within bf16 rounding."""
    h_serial = p.forked(None).float()
    y_serial = p.y.clone()
    h_forked = p.forked(side).float()
    assert torch.equal(y_serial, p.y), "forked GEMM differs from serial"
    h_err = ((h_forked - h_serial).norm() / h_serial.norm()).item()
    assert h_err < 1e-5, f"forked shrink differs from serial by {h_err:.1e}"
    p.expand(h_serial)
    want = p.y.float()
    p.y.zero_()
    p.expand(h_serial)
    p.gemm_accumulate()
    err = ((p.y.float() - want).norm() / want.norm()).item()
    assert err < 1e-2, f"{p.group.name}: beta-1 GEMM over the delta differs from GEMM then expand by {err:.1e}"


def measure(p: Projection, side: torch.cuda.Stream | None, device: torch.device) -> Row:
    h = p.shrink()

    def time_us(fn: Callable[[], object]) -> float:
        return graph_time_us(fn, device)

    return Row(p.group.name, p.x.shape[0], int((p.meta.group_counts[:-1] > 0).sum()),
               time_us(p.gemm), time_us(p.shrink), time_us(lambda: p.forked(None)), time_us(lambda: p.forked(side)),
               time_us(p.gemm_accumulate), time_us(lambda: p.expand(h)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192])
    parser.add_argument("--adapters", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on a CPU")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        parser.error("needs a GPU; --smoke runs tiny shapes on the CPU")
    groups, tokens = (SMOKE, [48]) if args.smoke else (LLAMA3_8B, args.tokens)
    adapters = sorted({min(a, 4) for a in args.adapters}) if args.smoke else args.adapters
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    weights = Weights(groups, RANK)
    rows = []
    print("| projection | tokens | adapters | GEMM | shrink | GEMM, shrink | forked | saved | GEMM beta 1 "
          "| C read | expand |\n|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for t in tokens:
        for a in adapters:
            for group in groups:
                p = Projection.make(group, weights, t, a)
                check(p, side)
                r = measure(p, side, device)
                rows.append(r)
                print(f"| {r.projection} | {r.tokens} | {r.adapters} | {r.gemm_us:.1f} | {r.shrink_us:.1f} | "
                      f"{r.serial_us:.1f} | {r.forked_us:.1f} | {r.serial_us - r.forked_us:.1f} | "
                      f"{r.gemm_accumulate_us:.1f} | {r.gemm_accumulate_us - r.gemm_us:.1f} | {r.expand_us:.1f} |",
                      flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prefill_lora_overlap.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
