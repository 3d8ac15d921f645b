"""Launch parameters for the LoRA kernels, per shape class, chosen offline on an H200.

Looked up by shape at call time; nothing is searched at run time. `benchmarks/lora_kernels.py`
sweeps candidates and prints the winners that go here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

# Batches with at least this many tokens take the segment (SGMV) path; smaller ones go per token (BGMV).
SGMV_MIN_TOKENS = 128


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


# (path, rank bucket) -> config; the bucket is the smallest key >= the padded rank.
_SHRINK: dict[tuple[str, int], ShrinkConfig] = {
    ("bgmv", 16): ShrinkConfig(block_r=4, block_k=1024, split_k=1, num_warps=4, num_stages=1),
    ("bgmv", 64): ShrinkConfig(block_r=4, block_k=1024, split_k=1, num_warps=4, num_stages=1),
    ("bgmv", 256): ShrinkConfig(block_r=4, block_k=512, split_k=1, num_warps=4, num_stages=1),
    ("sgmv", 16): ShrinkConfig(block_r=16, block_k=64, split_k=2, num_warps=4, num_stages=3),
    ("sgmv", 64): ShrinkConfig(block_r=64, block_k=64, split_k=2, num_warps=4, num_stages=3),
    ("sgmv", 256): ShrinkConfig(block_r=64, block_k=32, split_k=2, num_warps=4, num_stages=2),
}
_EXPAND: dict[tuple[str, int], ExpandConfig] = {
    ("bgmv", 16): ExpandConfig(block_n=256, block_r=16, num_warps=4, num_stages=1),
    ("bgmv", 64): ExpandConfig(block_n=128, block_r=64, num_warps=4, num_stages=1),
    ("bgmv", 256): ExpandConfig(block_n=64, block_r=64, num_warps=4, num_stages=1),
    ("sgmv", 16): ExpandConfig(block_n=128, block_r=16, num_warps=4, num_stages=2),
    ("sgmv", 64): ExpandConfig(block_n=128, block_r=64, num_warps=4, num_stages=2),
    ("sgmv", 256): ExpandConfig(block_n=64, block_r=64, num_warps=4, num_stages=2),
}


def choose_path(num_tokens: int) -> str:
    return "sgmv" if num_tokens >= SGMV_MIN_TOKENS else "bgmv"


def sgmv_block_m(max_tokens: int) -> int:
    """Rows per SGMV tile, fixed when the metadata buffers are made."""
    return 16 if max_tokens < 512 else 64


def _bucket(table: dict, path: str, rank: int) -> tuple[str, int]:
    buckets = sorted(b for p, b in table if p == path)
    return path, next((b for b in buckets if b >= rank), buckets[-1])


@lru_cache(maxsize=None)
def shrink_config(path: str, rank: int) -> ShrinkConfig:
    return _SHRINK[_bucket(_SHRINK, path, rank)]


@lru_cache(maxsize=None)
def expand_config(path: str, rank: int) -> ExpandConfig:
    return _EXPAND[_bucket(_EXPAND, path, rank)]
