"""Triton multi-LoRA kernels: shrink `h = x @ A[slot]^T` and expand `y += h @ B[slot]^T`.

Two paths per op, as the metadata says (`LoRAMetadata.path`: by batch size, `lora_tuning.choose_path`, or in
segments where the step chose them, `lora_tuning.step_path`):
- BGMV, one program per token: decode, where most tokens carry distinct adapters.
- SGMV, one program per tile of same-slot tokens (from `LoRAMetadata`), a tensor-core dot
  per tile: prefill and large batches, and decode-sized steps at ranks above 16 (`lora_tuning.SEGMENTS_FROM`: from
  fewer rows when they share few adapters), where a tile reads its adapter once for many rows.
Multi-slice forms take up to three weight stacks in one launch (q/k/v, gate/up). Grids depend
on shapes only and every launch reads its indices from device tensors, so the calls can be
captured in a CUDA graph. h is float32; accumulation is float32.
Split-K shrinks add their partial sums into h with relaxed atomics: nothing reads h before the launch ends, so
the adds need no ordering (H100, the 16-row SGMV shrinks of a 512-row decode step over 64 adapters: 61.2 -> 52.0 us
a layer against the default acq_rel).
Slots are padded to the stacks' rank R: a program reads its slot's A rows below the slot's own rank only
(`LoRAMetadata.token_rank`, `tile_rank`, loaded beside the slot), and its B columns (and h's) up to that rank rounded
up to whole vectors (`rank_columns`), so the padding costs no memory traffic; the shrink leaves h zero past the rank.
The stacks may be views of the first R rank columns (B) or rows (A) of wider slots: R, the rank width every launch
shape follows (configs, rank blocks, grids, h's width), is the stacks' own, and the kernels step over A's and B's rows
by their strides (`stride_ar`, `stride_bn`), not by K or R.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from kernels import lora_tuning
from kernels.lora_metadata import LoRAMetadata
from kernels.lora_tuning import ExpandConfig, ShrinkConfig
from kernels.pdl_triton import INTERPRETED, pdl_launch, wait_for_predecessor

MAX_SLICES = 3
# B's and h's rank columns are read in runs of this many (16 bytes of bf16): `rank_columns`
RANK_VECTOR = tl.constexpr(8)
# h's slices are this many token rows apart at least, rounded up: its slice stride (an argument of every kernel
# reading h) is then divisible by 16 whatever a step's token count, and Triton, which specializes on that,
# compiles one variant, not a second one mid-run at the first step of another size.
H_ROWS_ALIGN = 16


@triton.jit
def _shrink_bgmv_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, slots_ptr, ranks_ptr, h_ptr,
    K, R, stride_xt, stride_as, stride_ar, stride_hn, stride_ht, k_per_split,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    tok = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_s = tl.program_id(2)
    sl = pid_s // SPLIT_K
    ks = pid_s % SPLIT_K
    wait_for_predecessor(USE_PDL)
    slot = tl.load(slots_ptr + tok)
    rank = tl.minimum(tl.load(ranks_ptr + tok), R)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    h_ptrs = h_ptr + sl * stride_hn + tok.to(tl.int64) * stride_ht + offs_r
    if (slot < 0) | (pid_r * BLOCK_R >= rank):  # a base token, or a rank block wholly in the slot's padding
        if SPLIT_K == 1:
            tl.store(h_ptrs, tl.zeros([BLOCK_R], dtype=tl.float32), mask=r_mask)
        return
    if sl == 0:
        a_ptr = a0_ptr
    elif sl == 1:
        a_ptr = a1_ptr
    else:
        a_ptr = a2_ptr
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + offs_r[:, None] * stride_ar
    a_mask = offs_r < rank  # A's rows past the slot's rank are padding, not read: h is zero there
    x_row = x_ptr + tok.to(tl.int64) * stride_xt
    k_lo = ks * k_per_split
    hv = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            xv = tl.load(x_row + offs_k)
            av = tl.load(a_rows + offs_k[None, :], mask=a_mask[:, None], other=0.0)
        else:
            k_mask = offs_k < K
            xv = tl.load(x_row + offs_k, mask=k_mask, other=0.0)
            av = tl.load(a_rows + offs_k[None, :], mask=a_mask[:, None] & k_mask[None, :], other=0.0)
        hv += tl.sum(av.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
    if SPLIT_K == 1:
        tl.store(h_ptrs, hv, mask=r_mask)
    else:
        tl.atomic_add(h_ptrs, hv, mask=r_mask, sem="relaxed")


@triton.jit
def _dot_acc(acc, a, b, DOT_F32: tl.constexpr):
    """acc + a @ b; DOT_F32 computes in true float32 (float32 inputs must not round through tf32, and
    the interpreter's dot mishandles bfloat16)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _shrink_sgmv_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, order_ptr, tile_slot_ptr, tile_rank_ptr, tile_start_ptr, tile_len_ptr, h_ptr,
    K, R, stride_xt, stride_as, stride_ar, stride_hn, stride_ht, k_per_split,
    NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, USE_PDL: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_r = tl.program_id(1)
    ks = tl.program_id(2)
    wait_for_predecessor(USE_PDL)
    slot = tl.load(tile_slot_ptr + tile)
    rank = tl.minimum(tl.load(tile_rank_ptr + tile), R)
    start = tl.load(tile_start_ptr + tile)
    length = tl.load(tile_len_ptr + tile)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < length
    rows = tl.load(order_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    h_ptrs = h_ptr + rows[:, None] * stride_ht + offs_r[None, :]
    h_mask = m_mask[:, None] & r_mask[None, :]
    if (slot < 0) | (pid_r * BLOCK_R >= rank):  # base tokens, or a rank block wholly in the slot's padding
        if SPLIT_K == 1:
            for i in tl.static_range(NUM_SLICES):
                tl.store(h_ptrs + i * stride_hn, tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32), mask=h_mask)
        return
    a_offs = slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar
    a_in_rank = offs_r < rank  # A's rows past the slot's rank are padding, not read: h is zero there
    x_rows = x_ptr + rows[:, None] * stride_xt
    acc0 = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    k_lo = ks * k_per_split
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x_mask = m_mask[:, None]
            a_mask = a_in_rank[None, :]
        else:
            k_mask = offs_k < K
            x_mask = m_mask[:, None] & k_mask[None, :]
            a_mask = a_in_rank[None, :] & k_mask[:, None]
        xv = tl.load(x_rows + offs_k[None, :], mask=x_mask, other=0.0)
        a_ptrs = a_offs + offs_k[:, None]
        acc0 = _dot_acc(acc0, xv, tl.load(a0_ptr + a_ptrs, mask=a_mask, other=0.0), DOT_F32)
        if NUM_SLICES > 1:
            acc1 = _dot_acc(acc1, xv, tl.load(a1_ptr + a_ptrs, mask=a_mask, other=0.0), DOT_F32)
        if NUM_SLICES > 2:
            acc2 = _dot_acc(acc2, xv, tl.load(a2_ptr + a_ptrs, mask=a_mask, other=0.0), DOT_F32)
    if SPLIT_K == 1:
        tl.store(h_ptrs, acc0, mask=h_mask)
        if NUM_SLICES > 1:
            tl.store(h_ptrs + stride_hn, acc1, mask=h_mask)
        if NUM_SLICES > 2:
            tl.store(h_ptrs + 2 * stride_hn, acc2, mask=h_mask)
    else:
        tl.atomic_add(h_ptrs, acc0, mask=h_mask, sem="relaxed")
        if NUM_SLICES > 1:
            tl.atomic_add(h_ptrs + stride_hn, acc1, mask=h_mask, sem="relaxed")
        if NUM_SLICES > 2:
            tl.atomic_add(h_ptrs + 2 * stride_hn, acc2, mask=h_mask, sem="relaxed")


@triton.jit
def _expand_slice(j, b0_ptr, b1_ptr, b2_ptr, N0, N1, N2, NB0, NB01, SB0, SB1, SB2, slot):
    """Map a flat column-chunk index over all slices to (slice, chunk in slice, width, first column, B of
    `slot`)."""
    in1 = (j >= NB0).to(tl.int32)
    in2 = (j >= NB01).to(tl.int32)
    sl = in1 + in2
    chunk = j - in1 * NB0 - in2 * (NB01 - NB0)
    width = N0 + in1 * (N1 - N0) + in2 * (N2 - N1)
    col = in1 * N0 + in2 * N1
    if sl == 0:
        b_ptr = b0_ptr
    elif sl == 1:
        b_ptr = b1_ptr
    else:
        b_ptr = b2_ptr
    slot_stride = SB0 + in1 * (SB1 - SB0) + in2 * (SB2 - SB1)
    return sl, chunk, width, col, b_ptr + slot.to(tl.int64) * slot_stride


@triton.jit
def rank_columns(rank, R):
    """The rank columns of a slot's B (and of h) a kernel reads: the slot's rank rounded up to RANK_VECTOR, at most R.

    A load mask at the rank itself, a loaded value of no known divisibility, would make Triton split each row's
    load into single elements (the BGMV expand compiled for sm_90: 32 2-byte loads a thread where 6 16-byte ones
    did); rounded up, the mask holds over whole vectors. The columns between the rank and there are zero padding
    (`engine.lora_layout`) in the 32-byte sectors the rank's last columns occupy anyway: no extra memory traffic."""
    return tl.minimum((rank + RANK_VECTOR - 1) // RANK_VECTOR * RANK_VECTOR, R)


@triton.jit
def delta_rows(b_ptr, stride_bn, rows, mask, h_row, R, rank, BLOCK_R: tl.constexpr):
    """float32 h_row . B[rows]^T for one slot's B (rows of R values, `stride_bn` apart), read in its first `rank`
    columns (`rank_columns`; the rest is padding): the per-token expand's sum, which the fused ops also add as they
    read a projection's output (`fused_triton`)."""
    acc = tl.zeros(rows.shape, dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        hv = tl.load(h_row + offs_r, mask=r_mask, other=0.0)
        bv = tl.load(b_ptr + rows[:, None] * stride_bn + offs_r[None, :], mask=mask[:, None] & r_mask[None, :],
                     other=0.0)
        # h rounded to B's dtype, as peft's lora_B receives lora_A's output (and as `delta_tile` does)
        acc += tl.sum(bv.to(tl.float32) * hv.to(bv.dtype).to(tl.float32)[None, :], axis=1)
    return acc


@triton.jit
def b_block(b_ptr, stride_bn, cols, n_mask, r0, rank, BLOCK_R: tl.constexpr):
    """One rank block of one slot's B (rows `stride_bn` apart) transposed: B[cols, r0 : r0 + BLOCK_R]^T,
    [BLOCK_R, len(cols)], zero past its first `rank` columns (`rank_columns`; padding, not read); loaded apart from
    h so a program can keep it for several row tiles."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    return tl.load(b_ptr + cols[None, :] * stride_bn + offs_r[:, None], mask=(offs_r < rank)[:, None] & n_mask[None, :],
                   other=0.0)


@triton.jit
def plus_h_times_b(acc, h_rows, m_mask, bv, r0, rank, BLOCK_R: tl.constexpr, DOT_F32: tl.constexpr):
    """acc + h[rows, r0 : r0 + BLOCK_R] @ bv (`b_block`), h read in its first `rank` columns (`rank_columns`; zero
    past the slot's rank); h is float32, rounded to B's dtype, as peft's lora_B receives lora_A's output."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    hv = tl.load(h_rows + offs_r[None, :], mask=m_mask[:, None] & (offs_r < rank)[None, :], other=0.0)
    return _dot_acc(acc, hv.to(bv.dtype), bv, DOT_F32)


@triton.jit
def delta_tile(h_rows, m_mask, b_ptr, stride_bn, cols, n_mask, R, rank, BLOCK_M: tl.constexpr,
               BLOCK_R: tl.constexpr, DOT_F32: tl.constexpr):
    """float32 [BLOCK_M, len(cols)] h[rows] @ B[cols]^T for a tile of one slot's tokens: `h_rows` points at the
    tile's h rows ([BLOCK_M, 1]), B (one slot, rows of R values `stride_bn` apart, read in its first `rank` columns,
    `rank_columns`) is read once for the whole tile. The segment expand's sum, which the fused ops' tiled variants
    also add as they read a projection's output (`fused_lora_tiles_triton`)."""
    acc = tl.zeros([BLOCK_M, cols.shape[0]], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        acc = plus_h_times_b(acc, h_rows, m_mask, b_block(b_ptr, stride_bn, cols, n_mask, r0, rank, BLOCK_R), r0,
                             rank, BLOCK_R, DOT_F32)
    return acc


@triton.jit
def _expand_bgmv_kernel(
    h_ptr, b0_ptr, b1_ptr, b2_ptr, slots_ptr, ranks_ptr, y_ptr,
    R, N0, N1, N2, NB0, NB01, SB0, SB1, SB2, stride_bn, stride_hn, stride_ht, stride_yt,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, N_BLOCKS: tl.constexpr, USE_PDL: tl.constexpr,
):
    tok = tl.program_id(0)
    j = tl.program_id(1)
    wait_for_predecessor(USE_PDL)
    slot = tl.load(slots_ptr + tok)
    rank = rank_columns(tl.load(ranks_ptr + tok), R)
    if slot < 0:
        return
    sl, chunk, width, col, b_ptr = _expand_slice(j, b0_ptr, b1_ptr, b2_ptr, N0, N1, N2, NB0, NB01, SB0, SB1, SB2, slot)
    h_row = h_ptr + sl * stride_hn + tok.to(tl.int64) * stride_ht
    y_row = y_ptr + tok.to(tl.int64) * stride_yt + col
    for g in range(N_BLOCKS):
        offs_n = (chunk * N_BLOCKS + g) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < width
        yv = tl.load(y_row + offs_n, mask=n_mask, other=0.0)  # issued before the B loads it waits on
        acc = delta_rows(b_ptr, stride_bn, offs_n, n_mask, h_row, R, rank, BLOCK_R)
        tl.store(y_row + offs_n, (yv.to(tl.float32) + acc).to(yv.dtype), mask=n_mask)


@triton.jit
def _expand_sgmv_kernel(
    h_ptr, b0_ptr, b1_ptr, b2_ptr, order_ptr, tile_slot_ptr, tile_rank_ptr, tile_start_ptr, tile_len_ptr, y_ptr,
    R, N0, N1, N2, NB0, NB01, SB0, SB1, SB2, stride_bn, stride_hn, stride_ht, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, N_BLOCKS: tl.constexpr,
    DOT_F32: tl.constexpr, USE_PDL: tl.constexpr,
):
    tile = tl.program_id(0)
    j = tl.program_id(1)
    wait_for_predecessor(USE_PDL)
    slot = tl.load(tile_slot_ptr + tile)
    rank = rank_columns(tl.load(tile_rank_ptr + tile), R)
    if slot < 0:
        return
    start = tl.load(tile_start_ptr + tile)
    length = tl.load(tile_len_ptr + tile)
    sl, chunk, width, col, b_ptr = _expand_slice(j, b0_ptr, b1_ptr, b2_ptr, N0, N1, N2, NB0, NB01, SB0, SB1, SB2, slot)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < length
    rows = tl.load(order_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    h_rows = h_ptr + sl * stride_hn + rows[:, None] * stride_ht
    y_rows = y_ptr + rows[:, None] * stride_yt + col
    for g in range(N_BLOCKS):
        offs_n = (chunk * N_BLOCKS + g) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < width
        y_mask = m_mask[:, None] & n_mask[None, :]
        yv = tl.load(y_rows + offs_n[None, :], mask=y_mask, other=0.0)
        acc = delta_tile(h_rows, m_mask, b_ptr, stride_bn, offs_n, n_mask, R, rank, BLOCK_M, BLOCK_R, DOT_F32)
        tl.store(y_rows + offs_n[None, :], (yv.to(tl.float32) + acc).to(yv.dtype), mask=y_mask)


def dot_f32(dtype: torch.dtype) -> bool:
    """Interpreted (TRITON_INTERPRET=1), dots of bfloat16 go through float32."""
    return dtype == torch.float32 or (INTERPRETED and dtype == torch.bfloat16)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def _padded(seq: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Pad a list of 1..3 tensors to exactly three kernel arguments (unused ones repeat the first)."""
    if not 1 <= len(seq) <= MAX_SLICES:
        raise ValueError(f"between 1 and {MAX_SLICES} slices are supported, got {len(seq)}")
    return list(seq) + [seq[0]] * (MAX_SLICES - len(seq))


def slot_stacks(stacks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Stacked slot tensors [S, rows, cols] as the kernels read them: each row dense, rows at least `cols` apart, any
    stride between slots. Such stacks are taken as they are, not copied: the engine's slots are views of one
    [S, slot size] buffer, and a step whose adapters' ranks fit a width W hands B in as a view of its first W rank
    columns (rows as far apart as the slots' max rank) and A as one of its first W rows."""
    return [t if t.stride(2) == 1 and t.stride(1) >= t.shape[2] else t.contiguous() for t in stacks]


def row_stride(stacks: Sequence[torch.Tensor]) -> int:
    """The row stride the stacks of one launch share, one kernel argument for all their slices: raises unless they
    share it (a layer's slices are views of slots of one max rank)."""
    strides = sorted({t.stride(1) for t in stacks})
    if len(strides) > 1:
        raise ValueError(f"the slices of one LoRA launch must share their row stride, got strides {strides} "
                         f"(shapes {[list(t.shape) for t in stacks]})")
    return strides[0]


def _pdl_for(path: str, device: torch.device) -> dict[str, bool]:
    """PDL for the per-token kernels only. H200, rank 16, one decoder layer's 8 launches in a graph, PDL off
    against on: BGMV 64 tokens x 64 adapters 74.8 / 70.1 us, 16 x 8 36.6 / 32.2; SGMV 256 x 1 65.9 / 74.9,
    256 x 8 69.5 / 78.1, 8192 x 8 594 / 605 (`LORASERVE_PDL=0|1 benchmarks/lora_kernels.py --ranks 16`)."""
    return pdl_launch(device, wanted=path == "bgmv")


def _check_tokens(meta: LoRAMetadata, num_tokens: int) -> None:
    if meta.num_tokens != num_tokens:
        raise ValueError(f"metadata was prepared for {meta.num_tokens} tokens, the input has {num_tokens}")


def shrink_slices(
    x: torch.Tensor,
    a_slices: Sequence[torch.Tensor],
    meta: LoRAMetadata,
    out: torch.Tensor | None = None,
    *,
    path: str | None = None,
    config: ShrinkConfig | None = None,
) -> torch.Tensor:
    """h[i] = x @ A_i[slot]^T for each slice i, float32 [n, T, R]; base rows are zero."""
    num_tokens, k = x.shape
    rank = a_slices[0].shape[1]
    n = len(a_slices)
    _check_tokens(meta, num_tokens)
    if x.stride(1) != 1:
        x = x.contiguous()
    a_slices = slot_stacks(a_slices)
    if len({a.stride()[:2] for a in a_slices}) > 1:
        a_slices = [a.contiguous() for a in a_slices]  # one slot and row stride for all slices (same shapes)
    if out is None:
        rows = triton.cdiv(num_tokens, H_ROWS_ALIGN) * H_ROWS_ALIGN
        out = torch.empty(n, rows, rank, dtype=torch.float32, device=x.device)[:, :num_tokens]
    if num_tokens == 0:
        return out
    path = path or meta.path
    cfg = config or lora_tuning.shrink_config(path, meta.block_m, rank, n)
    min_block = 16 if path == "sgmv" else 1
    block_r = max(min_block, min(cfg.block_r, _pow2(rank)))
    block_k = max(16, min(cfg.block_k, _pow2(k)))
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), block_k) * block_k
    even_k = k_per_split * cfg.split_k == k
    if cfg.split_k > 1:
        out.zero_()
    a0, a1, a2 = _padded(a_slices)
    common = (k, rank, x.stride(0), a0.stride(0), a0.stride(1), out.stride(0), out.stride(1), k_per_split)
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_pdl_for(path, x.device))
    if path == "bgmv":
        grid = (num_tokens, triton.cdiv(rank, block_r), n * cfg.split_k)
        _shrink_bgmv_kernel[grid](
            x, a0, a1, a2, meta.slots, meta.token_rank, out, *common,
            BLOCK_R=block_r, BLOCK_K=block_k, SPLIT_K=cfg.split_k, EVEN_K=even_k, **launch,
        )
    else:
        grid = (meta.num_tiles, triton.cdiv(rank, block_r), cfg.split_k)
        _shrink_sgmv_kernel[grid](
            x, a0, a1, a2, meta.token_order, meta.tile_slot, meta.tile_rank, meta.tile_start, meta.tile_len, out,
            *common,
            NUM_SLICES=n, BLOCK_M=meta.block_m, BLOCK_R=block_r, BLOCK_K=block_k, SPLIT_K=cfg.split_k,
            EVEN_K=even_k, DOT_F32=dot_f32(x.dtype), **launch,
        )
    return out


def expand_slices(
    y: torch.Tensor,
    h: torch.Tensor,
    b_slices: Sequence[torch.Tensor],
    meta: LoRAMetadata,
    *,
    path: str | None = None,
    config: ExpandConfig | None = None,
) -> None:
    """y[:, off_i:off_i + N_i] += h[i] @ B_i[slot]^T in place for each slice i; base rows untouched."""
    num_tokens = y.shape[0]
    _check_tokens(meta, num_tokens)
    if num_tokens == 0:
        return
    if y.stride(1) != 1:
        raise ValueError("y must have unit stride along its columns")
    rank = b_slices[0].shape[2]
    b_slices = slot_stacks(b_slices)
    stride_bn = row_stride(b_slices)
    if h.stride(2) != 1:
        h = h.contiguous()
    path = path or meta.path
    cfg = config or lora_tuning.expand_config(path, meta.block_m, rank)
    min_block = 16 if path == "sgmv" else 1
    block_r = max(min_block, min(cfg.block_r, _pow2(rank)))
    widths = [b.shape[1] for b in b_slices] + [0] * (MAX_SLICES - len(b_slices))
    blocks = [triton.cdiv(w, cfg.block_n * cfg.n_blocks) for w in widths]
    b0, b1, b2 = _padded(b_slices)
    slot_strides = [b.stride(0) for b in b_slices] + [0] * (MAX_SLICES - len(b_slices))
    common = (rank, *widths, blocks[0], blocks[0] + blocks[1], *slot_strides, stride_bn, h.stride(0), h.stride(1),
              y.stride(0))
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_pdl_for(path, y.device))
    if path == "bgmv":
        _expand_bgmv_kernel[(num_tokens, sum(blocks))](
            h, b0, b1, b2, meta.slots, meta.token_rank, y, *common, BLOCK_N=cfg.block_n, BLOCK_R=block_r,
            N_BLOCKS=cfg.n_blocks, **launch,
        )
    else:
        _expand_sgmv_kernel[(meta.num_tiles, sum(blocks))](
            h, b0, b1, b2, meta.token_order, meta.tile_slot, meta.tile_rank, meta.tile_start, meta.tile_len, y,
            *common, BLOCK_M=meta.block_m, BLOCK_N=cfg.block_n, BLOCK_R=block_r, N_BLOCKS=cfg.n_blocks,
            DOT_F32=dot_f32(y.dtype), **launch,
        )
