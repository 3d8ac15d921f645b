"""Launch parameters for the skinny (small-M) Triton linear, per shape class, chosen offline on an H200.

Looked up by shape at call time; nothing is searched at run time. `benchmarks/skinny_gemm.py`
times candidates per (M bucket, N, K) against cuBLAS and prints the winners that go in `_TUNED`;
only classes where the Triton kernel beat cuBLAS are listed, so `tuned_config` returning None
means "use cuBLAS here" (the table stays empty until an H200 run fills it). M buckets: the smallest
key >= M (decode batches up to 128).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

M_BUCKETS = (1, 16, 32, 64, 128)
# Enough programs to keep every SM streaming: two per SM.
PROGRAMS_PER_SM = 2
MAX_SPLIT_K = 8


@dataclass(frozen=True)
class LinearConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False  # compute (W @ x^T)^T: W's rows fill the dot's M side, x's rows its N side
    tma: bool = False  # copy x and W tiles with TMA (where both are 16-byte aligned), not per-thread loads
    prefetch: int = 2  # with PDL: K blocks of W each program prefetches into L2 before waiting for its inputs


# (M bucket, N, K) -> config; filled from `benchmarks/skinny_gemm.py` on an H200.
_TUNED: dict[tuple[int, int, int], LinearConfig] = {}


def m_bucket(m: int) -> int | None:
    """The smallest bucket holding m rows, None past the largest."""
    return next((b for b in M_BUCKETS if b >= m), None)


@cache
def tuned_config(m: int, n: int, k: int) -> LinearConfig | None:
    """The H200 winner for this shape class, or None where cuBLAS was faster or the class was not timed."""
    bucket = m_bucket(m)
    return None if bucket is None else _TUNED.get((bucket, n, k))


@cache
def default_config(m: int, n: int, k: int, multiprocessors: int) -> LinearConfig:
    """A config for shapes without a tuned one: 64-column blocks, K split until about PROGRAMS_PER_SM programs
    per SM stream W, each split keeping at least four K blocks; shallower K blocks past 64 rows (shared memory)."""
    block_n, block_k = 64, 256 if m <= 64 else 128
    n_blocks = -(-n // block_n)
    target = PROGRAMS_PER_SM * multiprocessors
    split_k = 1
    while (split_k < MAX_SPLIT_K and n_blocks * split_k * 2 <= target
           and k >= 2 * split_k * 4 * block_k):
        split_k *= 2
    return LinearConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4,
                        num_stages=3 if 32 < m <= 64 else 4)


def choose_config(m: int, n: int, k: int, multiprocessors: int) -> LinearConfig:
    """The tuned config of the shape class, else the default for a device with this many SMs."""
    return tuned_config(m, n, k) or default_config(m, n, k, multiprocessors)
