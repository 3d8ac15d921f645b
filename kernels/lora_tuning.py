"""Launch parameters for the LoRA kernels, per shape class, chosen offline on an H200.

Looked up by shape at call time; nothing is searched at run time. `benchmarks/lora_kernels.py
--sweep` times candidates per class and prints the winners that go here (see BENCHMARKS.md).
Classes: the path (BGMV, or SGMV with its tile height `block_m`), the rank bucket (the
smallest key >= the rank; larger ranks loop), and for shrink whether several slices share
the launch (their accumulators share registers). Also here: which path a batch takes
(`choose_path` by the token count, `step_path` by the rank and the rows' adapters too), which expands steps fold
into the fused op after them (`folded_ops`), and which of those folds a per-token step hands to the ops' tiled
variants (`tiled_decode_ops`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from kernels.backend import env_switch

# Batches with at least this many tokens take the segment (SGMV) path; smaller ones go per token (BGMV).
# The decode graphs' top bucket (128) stays per token: per layer at rank 16 on an H200, 128 tokens over
# 64 adapters take 94.8 us on the per-token path against 111.4 us in segments, over 32 adapters 86.1 against 83.2;
# from 256 tokens segments win (64 adapters 117 against 145 us, one adapter 66 against 122).
SGMV_MIN_TOKENS = 129
# SGMV tiles are 16 rows for metadata made for fewer than this many tokens, SGMV_BLOCK_M rows otherwise.
SGMV_LARGE_TOKENS = 512
SGMV_BLOCK_M = 64
# A decode step has one row per sequence, spread over the adapters (512 rows over 64 adapters: 8 each), so the
# decode graphs' metadata keeps 16-row tiles at every bucket. H200, Llama-3-8B, rank 16, graph replay of a
# 512-row decode step: 64 adapters 25.56 -> 24.09 ms, 1 adapter 23.17 -> 22.94 ms against 64-row tiles.
DECODE_BLOCK_M = 16
# Slots are as wide as the server's max rank; a decode step whose adapters all fit this narrower width reads views
# of the slots this wide and takes the rank-16 launch shapes (`rank_width`). H200, Llama-3-8B, rank-16 adapters in
# rank-64 slots, decode step at batch 64 over 64 adapters: 12.79 ms reading the padding, 9.39 ms skipping it at the
# slots' width, 8.47 ms at this width (7.61 ms in rank-16 slots).
NARROW_RANK_WIDTH = 16
# Leave expands to the fused ops that consume the projections (`LoRAStep.fold_into`, `folded_ops`), in decode
# graphs, eager steps and piecewise mixed steps alike (on the segment path the ops' tiled variants add the
# deltas). `LORASERVE_LORA_FOLD=1|0` overrides, for measuring both.
FOLD_EXPAND = True
FOLD_EXPAND_ENV = "LORASERVE_LORA_FOLD"


@dataclass(frozen=True)
class ShrinkConfig:
    block_r: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class ExpandConfig:
    block_n: int
    block_r: int
    num_warps: int
    num_stages: int
    n_blocks: int = 1  # column blocks per program


# Winners of `benchmarks/lora_kernels.py --sweep` on an H200 (torch 2.11, triton 3.6), 2026-11-29: BGMV scored
# at 16 and 64 tokens, the 16-row SGMV class at 128 and 256 (before 128 tokens moved to BGMV; the script
# now scores BGMV at 128 and that SGMV class at 256 only), the 64-row class at 1024 and 8192.
# 2026-11-30: the 64-row single-slice rank-16 shrink takes split_k 6 (down: 110.9 -> 103.2 us).
# 2026-12-03: the 16-row rank-16 shrinks take block_k 64, split_k 32, 2 warps, 2 stages (the 16-row class runs the
# decode graphs of 129-512 rows and the piecewise graphs of mixed steps below 512 tokens; more programs along K
# for their few tiles). `benchmarks/decode_shrinks.py`, one layer's four shrinks as a decode graph runs them, us,
# the old config (block_k 128, split_k 8, 4 warps, 3 stages) against it: 256 rows on 1 / 8 / 64 adapters 29.9 /
# 33.6 / 51.3 against 25.8 / 30.4 / 48.0; 512 rows 38.3 / 41.0 / 53.7 against 30.0 / 33.5 / 50.0 (no group slower).
# (path, block_m or 0 for BGMV, rank bucket, several slices) -> config
_SHRINK: dict[tuple[str, int, int, bool], ShrinkConfig] = {
    ("bgmv", 0, 16, False): ShrinkConfig(block_r=2, block_k=8192, split_k=1, num_warps=8, num_stages=1),
    ("bgmv", 0, 16, True): ShrinkConfig(block_r=1, block_k=16384, split_k=1, num_warps=4, num_stages=1),
    ("bgmv", 0, 64, False): ShrinkConfig(block_r=1, block_k=2048, split_k=1, num_warps=4, num_stages=1),
    ("bgmv", 0, 64, True): ShrinkConfig(block_r=1, block_k=16384, split_k=1, num_warps=8, num_stages=1),
    ("sgmv", 16, 16, False): ShrinkConfig(block_r=16, block_k=64, split_k=32, num_warps=2, num_stages=2),
    ("sgmv", 16, 16, True): ShrinkConfig(block_r=16, block_k=64, split_k=32, num_warps=2, num_stages=2),
    ("sgmv", 16, 64, False): ShrinkConfig(block_r=64, block_k=128, split_k=16, num_warps=4, num_stages=2),
    ("sgmv", 16, 64, True): ShrinkConfig(block_r=64, block_k=128, split_k=4, num_warps=4, num_stages=3),
    ("sgmv", 64, 16, False): ShrinkConfig(block_r=16, block_k=128, split_k=6, num_warps=8, num_stages=3),
    ("sgmv", 64, 16, True): ShrinkConfig(block_r=16, block_k=64, split_k=4, num_warps=4, num_stages=4),
    ("sgmv", 64, 64, False): ShrinkConfig(block_r=64, block_k=128, split_k=4, num_warps=8, num_stages=3),
    ("sgmv", 64, 64, True): ShrinkConfig(block_r=64, block_k=128, split_k=1, num_warps=8, num_stages=3),
}
# (path, block_m or 0 for BGMV, rank bucket) -> config
_EXPAND: dict[tuple[str, int, int], ExpandConfig] = {
    ("bgmv", 0, 16): ExpandConfig(block_n=256, block_r=16, num_warps=4, num_stages=1, n_blocks=1),
    ("bgmv", 0, 64): ExpandConfig(block_n=64, block_r=64, num_warps=2, num_stages=1, n_blocks=1),
    ("sgmv", 16, 16): ExpandConfig(block_n=128, block_r=16, num_warps=4, num_stages=2, n_blocks=1),
    ("sgmv", 16, 64): ExpandConfig(block_n=128, block_r=64, num_warps=4, num_stages=2, n_blocks=1),
    ("sgmv", 64, 16): ExpandConfig(block_n=128, block_r=16, num_warps=4, num_stages=2, n_blocks=1),
    ("sgmv", 64, 64): ExpandConfig(block_n=128, block_r=64, num_warps=4, num_stages=3, n_blocks=4),
}


def check_powers_of_two(config: object, names: tuple[str, ...]) -> None:
    """Raise unless each named field of a launch config is a power of two (Triton's block shapes must be)."""
    for name in names:
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")


def choose_path(num_tokens: int) -> str:
    """The path by the token count alone."""
    return "sgmv" if num_tokens >= SGMV_MIN_TOKENS else "bgmv"


# Below SGMV_MIN_TOKENS a step runs the LoRA kernels in segments from these token counts, per rank class (the smallest
# key at least the rank width the step reads the slots at): `shared` when its rows share few adapters
# (`shares_few_adapters`), `spread` otherwise. Per token, every row reads its adapter's A and B (from L2 after the
# first); in segments, each 16-row tile of one adapter reads them once, on tensor cores. H200, Llama-3-8B,
# decode-graph replay in ms, per token (with the tiled SiLU·up where it applies) against segments, rows on
# 1 / 8 adapters (BENCHMARKS.md, seventeenth session):
#   rank 64:  32 rows 6.95 / -  against 6.61 / -;  64 rows 8.66 / 9.05 against 7.28 / 7.97;  128 rows 12.45 / 13.23
#             against 9.05 / 9.55
#   rank 32:  32 rows 6.06 against 6.23;  48 rows 6.66 against 6.61;  64 rows 7.14 / 7.32 against 6.88 / 7.38;
#             96 rows 8.85 / 9.08 against 7.88 / 8.30;  128 rows 9.95 / 10.14 against 8.56 / 8.95
#   rank 16:  per token wins or ties at every size (64 rows 6.35 / 6.54 against 6.74 / 7.18; 128 rows 8.42 / 8.69
#             against 8.42 / 8.78)
# Rows spread over 32 adapters (2.5 to 4 rows each), the same replay: rank 64, 80 / 96 / 112 / 128 rows 12.78 / 14.66 /
# 16.11 / 17.24 against 10.50 / 10.84 / 11.25 / 11.57; rank 32, 9.31 / 10.11 / 10.95 / 11.73 against 9.05 / 9.35 /
# 9.75 / 10.15. At 64 rows over 64 adapters per token wins (one layer's LoRA kernels, rank 32 119.2 against 141.7 us,
# rank 64 190.3 against 232.3).
# `LORASERVE_LORA_DECODE_SEGMENTS=0` keeps every step below SGMV_MIN_TOKENS per token, for measuring both.
@dataclass(frozen=True)
class SegmentsFrom:
    spread: int
    shared: int


SEGMENTS_FROM = {16: SegmentsFrom(spread=SGMV_MIN_TOKENS, shared=SGMV_MIN_TOKENS),
                 32: SegmentsFrom(spread=80, shared=64),
                 64: SegmentsFrom(spread=80, shared=32)}
DECODE_SEGMENTS = True
DECODE_SEGMENTS_ENV = "LORASERVE_LORA_DECODE_SEGMENTS"


def path_for(num_tokens: int, rank: int, shared: bool) -> str:
    """The path of a step of `num_tokens` tokens reading the slots at width `rank`, whose rows share few adapters
    (`shared`) or not: by the token count (`choose_path`), or in segments below SGMV_MIN_TOKENS where SEGMENTS_FROM
    says."""
    if num_tokens >= SGMV_MIN_TOKENS:
        return "sgmv"
    if not env_switch(DECODE_SEGMENTS_ENV, "1", "0", DECODE_SEGMENTS):
        return "bgmv"
    start = SEGMENTS_FROM[_nearest(SEGMENTS_FROM, rank)]
    return "sgmv" if num_tokens >= (start.shared if shared else start.spread) else "bgmv"


def step_path(num_tokens: int, rank: int, lora_slots: Iterable[int]) -> str:
    """The path a step's LoRA kernels take (`path_for`), from its rows' adapter slots (`lora_slots`, one per token,
    -1: none)."""
    if num_tokens >= SGMV_MIN_TOKENS:
        return "sgmv"
    return path_for(num_tokens, rank, shares_few_adapters(lora_slots))


def fold_expand() -> bool:
    """Whether steps fold the expands into the fused ops: FOLD_EXPAND unless LORASERVE_LORA_FOLD says otherwise."""
    return env_switch(FOLD_EXPAND_ENV, "1", "0", FOLD_EXPAND)


# The fused ops that take their projection's delta, per path. On the segment path the tiled RMSNorm walks each
# row twice and loses to the SGMV expand followed by the plain op (H200, 2048 tokens over 64 adapters at rank 16:
# 56.9 against 36.1 us at its best launch shape), so o and down expand there; SiLU·up and the rotary take theirs
# (113.1 against 153.3 us and 36.5 against 38.2).
FUSED_CONSUMERS = frozenset({"rotary_and_write_kv", "silu_and_mul", "add_rms_norm"})
FOLDED_OPS = {
    "bgmv": FUSED_CONSUMERS,
    "sgmv": frozenset({"rotary_and_write_kv", "silu_and_mul"}),
}


def folded_ops(path: str) -> frozenset[str]:
    """The fused ops that add the LoRA delta of the projection they read, in a step on this path (none when the
    fold is switched off)."""
    return FOLDED_OPS[path] if fold_expand() else frozenset()


# On the per-token path the SiLU·up fold reads the token's gate/up B ([28672, 16] bf16, 917 KB on Llama-3-8B) once
# per token, L2-bound when many rows share few adapters; the tiled variant reads it once per 16-row tile of
# same-slot tokens. H200, Llama-3-8B gate/up at rank 16, us per-token fold against the tiled variant (chunk 128,
# 16-row parts), tokens x distinct adapters (benchmarks/results_decode_tiled_fold_h200.json):
#   32 x 1 / 4 / 16 / 64:  5.1 / 5.2 / 5.5 / 6.0  against 4.3 / 4.6 / 9.5 / 13.8
#   64 x 1 / 4 / 16 / 64:  8.8 / 8.9 / 9.3 / 13.6 against 5.1 / 5.7 / 9.7 / 24.9
#  128 x 1 / 4 / 16 / 64: 16.4 / 16.5 / 16.9 / 24.5 against 6.5 / 7.8 / 10.3 / 34.3
#   16 x any: 3.6-4.0 against 3.9-8.9
# So from 32 tokens, with at least 8 adapter rows per distinct adapter, SiLU·up takes the tiled variant. The rotary
# (tiled wins only at 128 tokens, by about 1 us) and the RMSNorm (tiled 5x slower) stay per token.
# `LORASERVE_LORA_DECODE_TILES=1|0` overrides, for measuring both.
DECODE_TILES = True
DECODE_TILES_ENV = "LORASERVE_LORA_DECODE_TILES"
DECODE_TILES_MIN_TOKENS = 32
DECODE_TILES_MIN_ROWS_PER_ADAPTER = 8
DECODE_TILED_OPS = frozenset({"silu_and_mul"})


def decode_tiles() -> bool:
    """Whether per-token steps may hand folds to the tiled variants: DECODE_TILES unless
    LORASERVE_LORA_DECODE_TILES says otherwise."""
    return env_switch(DECODE_TILES_ENV, "1", "0", DECODE_TILES)


def tileable_decode_ops(num_tokens: int) -> frozenset[str]:
    """The folds a per-token step of `num_tokens` tokens can hand to the tiled variants, whatever its adapters
    (empty on the segment path, where every fold is tiled anyway, below DECODE_TILES_MIN_TOKENS, or when the
    switch or the fold is off): the decode graphs capture a tiled variant only where this is not empty."""
    if choose_path(num_tokens) != "bgmv" or num_tokens < DECODE_TILES_MIN_TOKENS or not decode_tiles():
        return frozenset()
    return DECODE_TILED_OPS & folded_ops("bgmv")


# SMs the base matmul of a decode graph leaves to the side-stream shrinks beside it, in buckets of at least
# SIDE_STREAM_CARVEOUT_MIN_TOKENS tokens; the matmul then runs through cuBLASLt, the only path on which torch applies
# an SM carveout. H200, decode graph replay, 0 against 8 SMs left (`decode_step.py --cases lora --cudagraph-mode
# full_decode_only`; 112 rows on a second board, 128 x 1 and 128 x 64 on both), ms:
#   rows x adapters  16 x 64  64 x 64  96 x 1  96 x 64  112 x 1  112 x 64  128 x 1    128 x 16   128 x 64
#   0                5.50     7.18     7.72    8.63     8.08     9.03      8.77/8.75  9.05/9.07  9.74/9.71
#   8                5.53     7.29     8.19    9.15     7.85     9.05      8.61/8.51  8.86/8.86  9.57/9.53
# Larger buckets take the segment path, which has no side stream. `LORASERVE_LORA_SIDE_CARVEOUT=N` sets the SMs
# (0: none).
SIDE_STREAM_CARVEOUT = 8
SIDE_STREAM_CARVEOUT_ENV = "LORASERVE_LORA_SIDE_CARVEOUT"
SIDE_STREAM_CARVEOUT_MIN_TOKENS = 112


def side_stream_carveout(num_tokens: int) -> int:
    """SMs left to the side-stream shrinks in a bucket of `num_tokens` tokens: none below
    SIDE_STREAM_CARVEOUT_MIN_TOKENS, else SIDE_STREAM_CARVEOUT unless LORASERVE_LORA_SIDE_CARVEOUT says otherwise."""
    if num_tokens < SIDE_STREAM_CARVEOUT_MIN_TOKENS:
        return 0
    value = os.environ.get(SIDE_STREAM_CARVEOUT_ENV, "")
    if not value:
        return SIDE_STREAM_CARVEOUT
    if not value.isdigit():
        raise ValueError(f"{SIDE_STREAM_CARVEOUT_ENV} must be a number of SMs (0: none), got {value!r}")
    return int(value)


def tiled_decode_ops(num_tokens: int, lora_slots: Iterable[int]) -> frozenset[str]:
    """The folds of a per-token step of `num_tokens` tokens that take the tiled variants: those of
    `tileable_decode_ops` when its rows share few adapters (`shares_few_adapters`); else none."""
    ops = tileable_decode_ops(num_tokens)
    return ops if ops and shares_few_adapters(lora_slots) else frozenset()


def narrow_rank_width(max_rank: int) -> int | None:
    """The rank width, below the slots' `max_rank`, that decode graphs are also captured at: the smallest rank
    class of the tables (16). Adapters of rank 16 or less in wider slots then take rank-16 launches, not the
    slots' (None: the slots are that narrow already)."""
    return NARROW_RANK_WIDTH if max_rank > NARROW_RANK_WIDTH else None


def rank_width(largest_rank: int, max_rank: int) -> int | None:
    """The rank width a decode step whose adapters' largest rank is `largest_rank` reads its slots at
    (`narrow_rank_width`), or None for the slots' whole `max_rank`."""
    narrow = narrow_rank_width(max_rank)
    return narrow if narrow is not None and largest_rank <= narrow else None


def shares_few_adapters(lora_slots: Iterable[int]) -> bool:
    """Whether the rows using an adapter (`lora_slots`, one per row, -1: the base model, not counted) are at
    least DECODE_TILES_MIN_ROWS_PER_ADAPTER per distinct adapter (and there is one)."""
    slots = lora_slots if isinstance(lora_slots, list) else list(lora_slots)
    adapters = set(slots)  # set and count: a step's host work, kept to C loops
    adapters.discard(-1)
    adapter_rows = len(slots) - slots.count(-1)
    return bool(adapters) and adapter_rows >= DECODE_TILES_MIN_ROWS_PER_ADAPTER * len(adapters)


def sgmv_block_m(max_tokens: int) -> int:
    """Rows per SGMV tile, fixed when the metadata buffers are made."""
    return 16 if max_tokens < SGMV_LARGE_TOKENS else SGMV_BLOCK_M


def _nearest(keys, value: int) -> int:
    below = [k for k in keys if k >= value]
    return min(below) if below else max(keys)


@lru_cache(maxsize=None)
def shrink_config(path: str, block_m: int, rank: int, num_slices: int) -> ShrinkConfig:
    block_m = 0 if path == "bgmv" else _nearest({k[1] for k in _SHRINK if k[0] == path}, block_m)
    bucket = _nearest({k[2] for k in _SHRINK if k[:2] == (path, block_m)}, rank)
    return _SHRINK[(path, block_m, bucket, num_slices > 1)]


@lru_cache(maxsize=None)
def expand_config(path: str, block_m: int, rank: int) -> ExpandConfig:
    block_m = 0 if path == "bgmv" else _nearest({k[1] for k in _EXPAND if k[0] == path}, block_m)
    bucket = _nearest({k[2] for k in _EXPAND if k[:2] == (path, block_m)}, rank)
    return _EXPAND[(path, block_m, bucket)]
