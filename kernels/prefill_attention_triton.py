"""Triton causal prefill attention over the paged KV cache: all of a step's prefill sequences in one launch.

A flash-attention kernel (online softmax, fp32 accumulation) for chunks of new tokens. The queries of
the step's prefill sequences lie back to back in q; sequence i's are the last query_lens[i] of its
context_lens[i] tokens, all already written to the cache. One program serves a tile of BLOCK_Q
queries of one sequence for every query head of one KV head (GQA), so each K/V tile read through the
block table feeds BLOCK_Q x group rows. The tiles (sequence, first query) come from a `PrefillPlan`,
built once per step on the host and copied to the device in one tensor, so each layer costs one
launch and no host sync. The keys below a tile's first query need no mask and run in a loop of their
own; only the diagonal tiles pay for the causal mask. head_dim (16 or more) and the cache's block
size must be powers of two.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.online_softmax_triton import LOG2_E, fold_tile


@dataclass(frozen=True)
class PrefillConfig:
    """Tile sizes and launch shape of the kernel."""

    block_m: int  # rows of a tile: its query tokens x the query heads of one KV head (group padded to 2^k)
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int

    def block_q(self, group: int) -> int:
        """Query tokens per tile when `group` query heads share a KV head (what a plan is built with)."""
        return max(1, self.block_m // triton.next_power_of_2(group))


# Candidates for benchmarks/prefill_attention.py --sweep. Compiled for sm_90 (bf16, group 4, D 128):
# 128-row tiles spill registers with 4 warps and fit with 8 (190-240 registers); 64-row tiles fit in 4.
CONFIGS = {
    "m128_n64_w8_s3": PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    "m128_n128_w8_s2": PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=2),
    "m64_n64_w4_s3": PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3),
}
DEFAULT_CONFIG = CONFIGS["m128_n64_w8_s3"]


# Fresh prompts (no earlier context) of at least this many tokens are left to torch's SDPA: its
# FlashAttention kernel is faster on long causal prompts. H200, one fresh prompt, per layer, SDPA against
# this kernel: 1024 tokens 35 against 34 us, 2048: 93 against 114, 4096: 293 against 414, 8192: 1037
# against 1673 (benchmarks/prefill_attention.py).
SDPA_MIN_FRESH_TOKENS = 2048


def leaves_to_sdpa(query_len: int, context_len: int) -> bool:
    """True for a sequence a PrefillPlan gives no tiles: a fresh prompt of SDPA_MIN_FRESH_TOKENS or more."""
    return query_len == context_len >= SDPA_MIN_FRESH_TOKENS


@dataclass(frozen=True)
class PrefillPlan:
    """The query tiles of one step's prefill attention and their sequences (device tensors, shared by all layers)."""

    tiles: torch.Tensor  # [2, P]: sequence index, first query of the tile (within the sequence's new tokens)
    sequences: torch.Tensor  # [3, B]: first row in q, query length, context length
    block_q: int

    @property
    def num_tiles(self) -> int:
        return self.tiles.shape[1]

    @staticmethod
    def host_values(query_lens: list[int], context_lens: list[int], block_q: int) -> list[int]:
        """The plan as flat ints (tiles, then sequences), for the caller to copy in one transfer.

        Tiles that read the most keys come first, so the longest programs start early. Sequences the
        kernel leaves to SDPA (`leaves_to_sdpa`) get no tiles.
        """
        tiles = [(ctx - q_len + min(first + block_q, q_len), seq, first)
                 for seq, (q_len, ctx) in enumerate(zip(query_lens, context_lens)) if not leaves_to_sdpa(q_len, ctx)
                 for first in range(0, q_len, block_q)]
        tiles.sort(key=lambda tile: -tile[0])
        starts, offset = [], 0
        for q_len in query_lens:
            starts.append(offset)
            offset += q_len
        return [t[1] for t in tiles] + [t[2] for t in tiles] + starts + list(query_lens) + list(context_lens)

    @classmethod
    def from_values(cls, values: torch.Tensor, num_sequences: int, block_q: int) -> PrefillPlan:
        """Views into `values`, the device copy of `host_values`."""
        num_tiles = (values.shape[0] - 3 * num_sequences) // 2
        return cls(tiles=values[:2 * num_tiles].view(2, num_tiles),
                   sequences=values[2 * num_tiles:].view(3, num_sequences), block_q=block_q)

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], device: torch.device | str,
              block_q: int) -> PrefillPlan:
        values = torch.tensor(cls.host_values(query_lens, context_lens, block_q), dtype=torch.long, device=device)
        return cls.from_values(values, len(query_lens), block_q)


@triton.jit
def _attend_tile(acc, m, denom, q, qpos, qk_scale, k_ptr, v_ptr, table_row, kv_offset, first_key, dims,
                 stride_kb, stride_kt, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, IEEE: tl.constexpr):
    """Fold keys first_key .. first_key + BLOCK_N into the running softmax (scores in log2 units)."""
    keys = first_key + tl.arange(0, BLOCK_N)
    if CAUSAL:
        visible = keys[None, :] <= qpos[:, None]
        in_cache = keys <= tl.max(qpos, axis=0)
        blocks = tl.load(table_row + keys // BLOCK_SIZE, mask=in_cache, other=0)
    else:
        blocks = tl.load(table_row + keys // BLOCK_SIZE)
    rows = blocks.to(tl.int64) * stride_kb + (keys % BLOCK_SIZE) * stride_kt + kv_offset
    if CAUSAL:
        k = tl.load(k_ptr + rows[:, None] + dims[None, :], mask=in_cache[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None] + dims[None, :], mask=in_cache[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + rows[:, None] + dims[None, :])
        v = tl.load(v_ptr + rows[:, None] + dims[None, :])
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    else:
        scores = tl.dot(q, tl.trans(k)) * qk_scale
    if CAUSAL:
        scores = tl.where(visible, scores, float("-inf"))
    return fold_tile(acc, m, denom, scores, v, IEEE)


# Sizes that change from step to step are not specialized on (Triton otherwise compiles a variant for
# each value that is 1 or a multiple of 16): the block table's width, the tile and sequence counts.
# tables_ptr is the step's block tables past its decode rows: 16-byte aligned or not with their count
@triton.jit(do_not_specialize=["stride_tb", "stride_tiles", "stride_seqs"],
            do_not_specialize_on_alignment=["tables_ptr", "tiles_ptr", "sequences_ptr"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, tiles_ptr, sequences_ptr, out_ptr, qk_scale,
                    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, stride_ot, stride_oh,
                    stride_tiles, stride_seqs, num_kv_heads, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    # the KV heads of one tile are neighbours, so the plan's heaviest-first order holds across heads
    tile = tl.program_id(0) // num_kv_heads
    kv_head = tl.program_id(0) % num_kv_heads
    seq = tl.load(tiles_ptr + tile)
    first_query = tl.load(tiles_ptr + stride_tiles + tile).to(tl.int32)
    q_row = tl.load(sequences_ptr + seq).to(tl.int32)
    q_len = tl.load(sequences_ptr + stride_seqs + seq).to(tl.int32)
    ctx_len = tl.load(sequences_ptr + 2 * stride_seqs + seq).to(tl.int32)
    # row r of the tile: query token first_query + r // GROUP_PAD, head kv_head * GROUP + r % GROUP_PAD
    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    token = first_query + r // GROUP_PAD
    head = kv_head * GROUP + r % GROUP_PAD
    row_ok = (token < q_len) & (r % GROUP_PAD < GROUP)
    # rows past the sequence take its last position: finite scores, never stored
    qpos = tl.minimum(ctx_len - q_len + token, ctx_len - 1)
    dims = tl.arange(0, HEAD_DIM)
    q_offsets = (q_row + token).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None], other=0.0)
    m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)
    table_row = tables_ptr + seq * stride_tb
    kv_offset = kv_head * stride_kh
    # every row sees keys up to the tile's first position; the rest are masked tile by tile
    unmasked_end = (ctx_len - q_len + first_query + 1) // BLOCK_N * BLOCK_N
    end = ctx_len - q_len + tl.minimum(first_query + BLOCK_Q, q_len)
    for first_key in range(0, unmasked_end, BLOCK_N):
        acc, m, denom = _attend_tile(acc, m, denom, q, qpos, qk_scale, k_ptr, v_ptr, table_row, kv_offset,
                                     first_key, dims, stride_kb, stride_kt, BLOCK_SIZE, BLOCK_N, False, IEEE)
    for first_key in range(unmasked_end, end, BLOCK_N):
        acc, m, denom = _attend_tile(acc, m, denom, q, qpos, qk_scale, k_ptr, v_ptr, table_row, kv_offset,
                                     first_key, dims, stride_kb, stride_kt, BLOCK_SIZE, BLOCK_N, True, IEEE)
    out_offsets = (q_row + token).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offsets, (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, plan: PrefillPlan, scale: float,
                            out: torch.Tensor | None = None,
                            config: PrefillConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """q [T, H, D] (the plan's sequences back to back) -> [T, H, D]; caches [blocks, block_size, kv_heads, D].

    `block_tables` has one row per plan sequence; the plan's tiles must be `config.block_q(group)` queries.
    The rows of sequences the plan leaves to SDPA are not written (`kernels.attention.prefill_attention`
    runs them).
    """
    tokens, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    for name, size in (("head_dim", head_dim), ("block_size", block_size)):
        if size < 1 or size & (size - 1):
            raise ValueError(f"the Triton prefill attention needs a power-of-two {name}, got {size}")
    if head_dim < 16:
        raise ValueError(f"the Triton prefill attention needs head_dim >= 16, got {head_dim}")
    group = heads // kv_heads
    if plan.block_q != config.block_q(group):
        raise ValueError(f"the plan has {plan.block_q}-query tiles, the config {config.block_q(group)}")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"q ({q.dtype}) and the caches ({k_cache.dtype}, {v_cache.dtype}) need one dtype")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("q and the caches need a contiguous last dimension, and the caches one layout")
    if out is None:
        out = torch.empty_like(q)
    if out.stride(2) != 1:
        raise ValueError("out needs a contiguous last dimension")
    if tokens == 0 or plan.num_tiles == 0:
        return out
    _prefill_kernel[(plan.num_tiles * kv_heads,)](
        q, k_cache, v_cache, block_tables, plan.tiles, plan.sequences, out, scale * LOG2_E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), plan.tiles.stride(0), plan.sequences.stride(0),
        kv_heads,
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_Q=plan.block_q, BLOCK_N=config.block_n, IEEE=q.dtype == torch.float32,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
