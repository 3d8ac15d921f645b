"""Triton decode attention over the paged KV cache, split over the context ("flash-decoding").

One program per (sequence, KV head, split) serves all query heads of its KV head (GQA), so K and V
are read once per KV head, with an online softmax over its share of the sequence's tokens. The
split count is static (from the batch size, KV heads and the block table's width: no host syncs,
so a CUDA graph can capture it); each sequence's tiles are spread evenly over the splits on the
device, so short sequences in a wide table still use every split and splits past the end exit at
once. With one split the program writes the output; otherwise it writes its partial (max, sum,
unnormalised output) in fp32 and a second launch combines the splits. A row with length 0 is
left as is.

Launch parameters (tile, warps, stages, split target) come from a small table per shape class,
chosen offline with `benchmarks/decode_attention.py --sweep` and looked up by shape at call time
(nothing is searched at run time). The class is the dtype (16-bit or fp32) and the batch x KV
heads bucket, both static, so a CUDA graph's launch is fixed when it is captured.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from kernels.device import multiprocessor_count
from kernels.online_softmax_triton import LOG2_E, fold_tile
from kernels.pdl_triton import pdl_launch, wait_for_predecessor

# Split until about this many programs per multiprocessor (each class's DecodeConfig carries its own; this is
# the default). Measured on the H200 (132 of them) with benchmarks/decode_attention.py: batch x KV heads >= 512
# programs run fastest unsplit, fewer gain up to 15x at long contexts (batch 1, 8192 tokens: 234 -> 15 us).
PROGRAMS_PER_SM = 4
# A table this many tokens wide or narrower is never split: the combine launch would cost more.
SINGLE_PASS_TOKENS = 256
# Each split covers at least this many tokens of the table's width.
SPLIT_MIN_TOKENS = 64
MAX_SPLITS = 32


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel for one shape class."""

    tokens: int  # context tokens per inner step (a power of two >= 16; raised to the KV block size)
    num_warps: int
    num_stages: int
    programs_per_sm: int = PROGRAMS_PER_SM  # split target of `default_num_splits`

    def __post_init__(self) -> None:
        if self.tokens < 16 or self.tokens & (self.tokens - 1):
            raise ValueError(f"tokens must be a power of two >= 16 (tl.dot's minimum), got {self.tokens}")


# (dtype class, batch x KV heads bucket) -> config; a shape takes the smallest bucket at or above its
# batch x KV heads, the largest bucket above them all. The 256/512/1024 lines (batches 32, 64, 128 at 8 KV
# heads) are the winners of `benchmarks/decode_attention.py --sweep` on an H200 (bf16, head dim 128, group 4,
# contexts 544-2048; triton 3.6), 2026-11-29: at 544 tokens, batch 32 28.0 -> 22.7 us, 64 39.0 -> 38.4,
# 128 74.3 -> 69.8. Smaller shapes (and fp32, not swept) launch as before: 64-token tiles (32 in fp32),
# 4 warps, 3 stages, 4 programs per SM.
DECODE_CONFIGS: dict[tuple[str, int], DecodeConfig] = {
    ("16bit", 128): DecodeConfig(tokens=64, num_warps=4, num_stages=3, programs_per_sm=4),
    ("16bit", 256): DecodeConfig(tokens=128, num_warps=4, num_stages=2, programs_per_sm=2),
    ("16bit", 512): DecodeConfig(tokens=64, num_warps=2, num_stages=2, programs_per_sm=4),
    ("16bit", 1024): DecodeConfig(tokens=32, num_warps=2, num_stages=2, programs_per_sm=8),
    ("fp32", 128): DecodeConfig(tokens=32, num_warps=4, num_stages=3, programs_per_sm=4),
}


def decode_class(dtype: torch.dtype, batch: int, kv_heads: int) -> tuple[str, int]:
    """The shape class a launch belongs to: the dtype class and batch x KV heads rounded up to a power of two."""
    return ("fp32" if dtype == torch.float32 else "16bit", triton.next_power_of_2(batch * kv_heads))


@cache
def decode_config(dtype: torch.dtype, batch: int, kv_heads: int) -> DecodeConfig:
    """The table's config for this shape: the smallest bucket of its dtype class at or above batch x KV heads."""
    dtype_class, programs = decode_class(dtype, batch, kv_heads)
    buckets = [key for cls, key in DECODE_CONFIGS if cls == dtype_class]
    above = [key for key in buckets if key >= programs]
    return DECODE_CONFIGS[(dtype_class, min(above) if above else max(buckets))]


# Sizes that change from step to step are not specialized on (Triton otherwise compiles a variant for
# each value that is 1 or a multiple of 16): an eager step's block table is as wide as its longest
# sequence, and its split count follows, so each new width would stall a step for a compile.
@triton.jit(do_not_specialize=["stride_tb", "num_splits"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, qk_scale,
                   stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, stride_ob, stride_oh,
                   num_heads, num_splits, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
                   USE_PDL: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    wait_for_predecessor(USE_PDL)  # the predecessor writes this step's K and V into the cache
    length = tl.load(lens_ptr + seq).to(tl.int32)
    tiles_per_split = tl.cdiv(tl.cdiv(length, TOKENS), num_splits)
    start = split * tiles_per_split * TOKENS
    if start >= length:
        return
    end = tl.minimum(start + tiles_per_split * TOKENS, length)
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    head_ok = tl.arange(0, GROUP_PAD) < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=head_ok[:, None], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    offsets = tl.arange(0, TOKENS)
    for first in range(start, end, TOKENS):
        tokens = first + offsets
        valid = tokens < end
        blocks = tl.load(tables_ptr + seq * stride_tb + tokens // BLOCK_SIZE, mask=valid, other=0)
        rows = blocks.to(tl.int64) * stride_kb + (tokens % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        k = tl.load(k_ptr + rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(valid[None, :], scores * qk_scale, float("-inf"))
        acc, m, denom = fold_tile(acc, m, denom, scores, v, IEEE)
    if SPLIT:
        part = (seq * num_heads + heads) * num_splits + split
        tl.store(m_ptr + part, m, mask=head_ok)
        tl.store(l_ptr + part, denom, mask=head_ok)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=head_ok[:, None])
    else:
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(m_ptr, l_ptr, acc_ptr, lens_ptr, out_ptr, stride_ob, stride_oh, num_heads, num_splits,
                    HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr, SPLITS_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    wait_for_predecessor(USE_PDL)
    length = tl.load(lens_ptr + seq).to(tl.int32)
    if length <= 0:
        return
    tiles = tl.cdiv(length, TOKENS)
    used = tl.cdiv(tiles, tl.cdiv(tiles, num_splits))
    parts = tl.arange(0, SPLITS_PAD)
    ok = parts < used
    dims = tl.arange(0, HEAD_DIM)
    base = (seq * num_heads + head) * num_splits
    m = tl.load(m_ptr + base + parts, mask=ok, other=float("-inf"))
    l = tl.load(l_ptr + base + parts, mask=ok, other=0.0)
    acc = tl.load(acc_ptr + (base + parts)[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None], other=0.0)
    weight = tl.exp2(m - tl.max(m, axis=0))  # the partial maxima are in log2 units
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.sum(weight * l, axis=0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def default_num_splits(batch: int, kv_heads: int, max_context: int, multiprocessors: int,
                       programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Splits that give every multiprocessor about `programs_per_sm` programs, from static shapes only."""
    if max_context <= SINGLE_PASS_TOKENS:
        return 1
    wanted = programs_per_sm * multiprocessors // (batch * kv_heads)
    return max(1, min(wanted, triton.cdiv(max_context, SPLIT_MIN_TOKENS), MAX_SPLITS))


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, num_splits: int | None = None,
                           config: DecodeConfig | None = None) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]; caches [blocks, block_size, kv_heads, D]; a row with length 0 is left as is.

    `num_splits` overrides the static split count (tests use it to split tiny contexts); `config`
    overrides the table's launch parameters (the benchmark's sweep times candidates with it).
    """
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    if out is None:
        out = torch.empty_like(q)
    if config is None:
        config = decode_config(q.dtype, batch, kv_heads)
    if num_splits is None:
        num_splits = default_num_splits(batch, kv_heads, block_tables.shape[1] * block_size,
                                        multiprocessor_count(q.device), config.programs_per_sm)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    tokens = max(block_size, config.tokens)
    if num_splits == 1:
        m = l = acc = out
    else:
        m = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        acc = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, m, l, acc, scale * LOG2_E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), heads, num_splits,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TOKENS=tokens, SPLIT=num_splits > 1, IEEE=q.dtype == torch.float32,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(q.device),
    )
    if num_splits > 1:
        _combine_kernel[(batch, heads)](
            m, l, acc, context_lens, out, out.stride(0), out.stride(1), heads, num_splits,
            HEAD_DIM=head_dim, TOKENS=tokens, SPLITS_PAD=MAX_SPLITS,  # one variant for every split count
            num_warps=4, **pdl_launch(q.device),
        )
    return out
