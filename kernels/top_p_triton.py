"""Top-p filtering in Triton, without sorting: each row's nucleus threshold is found by searching its bits.

A full-vocabulary sort (what the torch path falls back to, and what a sync-free torch path would need for
every row) took 2.6 ms at 128 rows of Llama-3's 128k vocabulary on an H200; this kernel takes 0.65 ms. The
mass above a candidate threshold t (the sum of the row's probabilities greater than t) only falls as t grows,
and non-negative float32 values order as their bit patterns do, so the smallest t whose mass above is below
top_p is found by searching the integers between 0.0's bits and 1.0's: each pass over the row tests PROBES
thresholds at once and keeps the interval between the last that failed and the first that passed. A last
pass zeroes the tokens below the threshold. One program per row; its row stays in L2 between passes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements a program holds per probe pass (threshold x column): a pass over a row is BLOCK = TILE // probes columns
# at a time, each probe's sums kept per column and reduced across the block once per pass.
# H200, 128256 columns (`benchmarks/sampler.py`): 7 probes, tile 16384, 16 warps took 0.43 / 0.65 / 0.78 ms at
# 32 / 128 / 256 rows; 3 probes at tile 8192 and 8 warps 0.43 / 0.77 / 0.93; 15 probes 0.58 / 0.92 / 1.8.
TILE = 16384
NUM_WARPS = 16
# Thresholds tested per pass: 7 narrow the interval 8-fold (10 passes over 1.0's 2^30 bit patterns).
PROBES = 7
ONE_BITS = 0x3F800000


@triton.jit
def _mass_above(base, num_cols, thresholds, BLOCK: tl.constexpr, PROBES_POW2: tl.constexpr):
    """For each threshold, the sum of the row's values greater than it."""
    mass = tl.zeros([PROBES_POW2, BLOCK], dtype=tl.float32)
    offs = tl.arange(0, BLOCK)
    for start in range(0, num_cols, BLOCK):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < num_cols, other=0.0)
        mass += tl.where(x[None, :] > thresholds[:, None], x[None, :], 0.0)
    return tl.sum(mass, 1)


@triton.jit
def _top_p_kernel(probs_ptr, stride_row, num_cols, rows_ptr, top_p_ptr, BLOCK: tl.constexpr,
                  PROBES: tl.constexpr, PROBES_POW2: tl.constexpr, ONE_BITS: tl.constexpr):
    row = tl.load(rows_ptr + tl.program_id(0))
    base = probs_ptr + row * stride_row
    top_p = tl.load(top_p_ptr + tl.program_id(0))
    probe = tl.arange(0, PROBES_POW2)
    used = probe < PROBES
    lo = tl.zeros([], dtype=tl.int64)  # the answer lies in [lo, hi]; hi passes (nothing is above 1.0)
    hi = tl.zeros([], dtype=tl.int64) + ONE_BITS
    while lo < hi:
        bits = lo + (hi - lo) * (probe + 1) // (PROBES + 1)
        mass = _mass_above(base, num_cols, bits.to(tl.int32).to(tl.float32, bitcast=True), BLOCK, PROBES_POW2)
        passes = mass < top_p
        hi = tl.min(tl.where(used & passes, bits, hi), 0)
        lo = tl.max(tl.where(used & ~passes, bits + 1, lo), 0)
    threshold = lo.to(tl.int32).to(tl.float32, bitcast=True)
    offs = tl.arange(0, BLOCK)
    for start in range(0, num_cols, BLOCK):
        cols = start + offs
        inside = cols < num_cols
        x = tl.load(base + cols, mask=inside, other=0.0)
        tl.store(base + cols, tl.where(x < threshold, 0.0, x), mask=inside)


def top_p_(probs: torch.Tensor, rows: torch.Tensor, top_p: torch.Tensor, probes: int = PROBES, tile: int = TILE,
           num_warps: int = NUM_WARPS) -> torch.Tensor:
    """`kernels.top_p.top_p_` in one launch. `probes`, `tile` and `num_warps` are for benchmarks and tests."""
    if probs.dtype != torch.float32 or probs.stride(-1) != 1:
        raise ValueError(f"probs must be contiguous float32 rows, got {probs.dtype} with strides {probs.stride()}")
    if len(rows):
        probes_pow2 = triton.next_power_of_2(probes)
        _top_p_kernel[(len(rows),)](probs, probs.stride(0), probs.shape[-1], rows, top_p,
                                    BLOCK=max(16, tile // probes_pow2), PROBES=probes, PROBES_POW2=probes_pow2,
                                    ONE_BITS=ONE_BITS, num_warps=num_warps)
    return probs
