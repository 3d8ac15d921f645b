"""Triton versions of the fused per-token ops: one launch each instead of a chain of elementwise kernels.

Rounding follows the torch reference step by step (float32 math, rounded to the model dtype where
torch rounds), so the two agree to the last bit in float32 and within one rounding in bf16.

With a `LoRADelta` each op also applies the LoRA expand of the projection it consumes: a token's
program reads the h row and the B[slot] rows of the columns it produces (below the slot's rank, not its
padding) and adds the delta, rounded once, before the op's own math (tokens of slot -1 read no B). The B
tiles are [columns, rank block], so the LoRA variants walk their columns in chunks (`LORA_CONFIGS`); without a
delta (`HAS_LORA` false) each kernel compiles to the code it had before. That suits decode-sized steps; on steps
the LoRA kernels run in segments (`LoRAMetadata.path`: prefill sizes, or as the step chose) a delta goes to the
tiled variants of `fused_lora_tiles_triton`, which read B once per tile of same-slot tokens, and so does a delta
the step marked `tiled` (per-token steps whose rows share few adapters, `lora_tuning.tiled_decode_ops`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import fused_lora_tiles_triton as tiles
from kernels import lora_tuning
from kernels.fused_math_triton import rotated, silu_times, store_halves, store_normed
from kernels.lora_delta import LoRADelta
from kernels.lora_triton import delta_rows, rank_columns, row_stride, slot_stacks
from kernels.pdl_triton import pdl_launch, wait_for_predecessor


@dataclass(frozen=True)
class LoRAOpConfig:
    """Launch shape of a fused op's LoRA variant.

    `chunk`: columns per loop step (add_rms_norm, silu_and_mul) or heads per program (rotary_and_write_kv);
    `block_r`: rank columns of B per step (the rank is padded to a power of two up to this, larger ranks
    loop); `chunks_per_program`: silu_and_mul's column chunks per program.
    """

    chunk: int
    block_r: int
    num_warps: int
    chunks_per_program: int = 1

    def __post_init__(self) -> None:
        lora_tuning.check_powers_of_two(self, ("chunk", "block_r", "num_warps"))


# Winners of `benchmarks/fused_ops.py --tokens 64 128 --lora-only` on an H200 (Llama-3-8B shapes, 64 adapters
# at rank 16; triton 3.6), 2026-11-29, us at 64 / 128 tokens against the BGMV expand followed by the op:
# add_rms_norm 4.8 / 5.4 against 5.2 / 6.7, silu_and_mul 13.7 / 25.1 against 15.4 / 27.3, rotary and
# KV write 4.2 / 6.5 against 6.8 / 8.8. Op name -> config.
LORA_CONFIGS: dict[str, LoRAOpConfig] = {
    "add_rms_norm": LoRAOpConfig(chunk=4096, block_r=16, num_warps=32),
    "silu_and_mul": LoRAOpConfig(chunk=256, block_r=16, num_warps=4, chunks_per_program=1),
    "rotary_and_write_kv": LoRAOpConfig(chunk=4, block_r=16, num_warps=4),
}


def _lora_args(lora: LoRADelta | None, num_slices: int, placeholder: torch.Tensor) -> tuple:
    """(h, B_0 .. B_{n-1}, adapter slots, their ranks, max rank, B row stride, B slot strides .., h strides) as the
    kernels take them; placeholders that no kernel reads without a delta. The max rank (the slots' padded rank, or the
    width of B's view) and B's row stride are constexprs: one compile per pair, and B's loads stay 16 bytes wide at
    any row stride divisible by 8 (an integer argument is known divisible by 16 at most); each token's slot rank is
    read on the device."""
    if lora is None:
        return (placeholder,) * (num_slices + 3) + (0,) * (num_slices + 4)
    b_slices = slot_stacks(lora.b_slices)
    h = lora.h if lora.h.stride(2) == 1 else lora.h.contiguous()
    return (h, *b_slices, lora.meta.slots, lora.meta.token_rank, lora.rank, row_stride(b_slices),
            *(b.stride(0) for b in b_slices), h.stride(0), h.stride(1))


def _tiled(lora: LoRADelta) -> bool:
    """Whether a delta goes to the tiled variants: as its step chose (`LoRADelta.tiled`), and always on steps the
    LoRA kernels run in segments (`LoRAMetadata.path`), where reading B once per token would cost more than the fold
    saves."""
    return lora.tiled or lora.meta.path == "sgmv"


def _block_r(lora: LoRADelta | None, config: LoRAOpConfig) -> int:
    return 1 if lora is None else min(config.block_r, triton.next_power_of_2(lora.rank))


@triton.jit
def _plus_delta(y, b_ptr, stride_bn: tl.constexpr, cols, mask, h_row, R: tl.constexpr, rank, BLOCK_R: tl.constexpr):
    """y + h_row . B[cols]^T, rounded once to y's dtype: B (one slot, rows of R values `stride_bn` apart, read below
    the slot's `rank`) at rows `cols`."""
    return (y.to(tl.float32) + delta_rows(b_ptr, stride_bn, cols, mask, h_row, R, rank, BLOCK_R)).to(y.dtype)


@triton.jit
def _row_chunk(ptr, row, stride, cols, mask):
    """Columns `cols` of a row of a [rows, n] tensor, zero where masked."""
    return tl.load(ptr + row * stride + cols, mask=mask, other=0.0)


@triton.jit
def _lora_hidden(row, cols, mask, x_ptr, res_ptr, stride_x, stride_res, adapter, b_ptr, stride_bn: tl.constexpr, h_row,
                 R: tl.constexpr, rank, HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr):
    """x + delta, rounded, (+ residual, rounded) at `cols` of a row. The residual is loaded before the delta's sum,
    with B, not after it. (Loaded ahead of the branch, it made Triton sum the row's squares in another layout,
    so in another order, than before.)"""
    x = _row_chunk(x_ptr, row, stride_x, cols, mask)
    if adapter >= 0:
        if HAS_RESIDUAL:
            r = _row_chunk(res_ptr, row, stride_res, cols, mask)
        x = _plus_delta(x, b_ptr, stride_bn, cols, mask, h_row, R, rank, BLOCK_R)
    else:
        if HAS_RESIDUAL:
            r = _row_chunk(res_ptr, row, stride_res, cols, mask)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _add_rms_norm_lora_row(row, x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, stride_out,
                           stride_res_out, n, eps, h_ptr, b_ptr, adapters_ptr, ranks_ptr, R: tl.constexpr,
                           stride_bn: tl.constexpr, stride_bs, stride_ht, HAS_RESIDUAL: tl.constexpr,
                           CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, ONE_PASS: tl.constexpr, USE_PDL: tl.constexpr):
    """x + delta (+ residual) stored as the residual out, then normalized. A row of one chunk (ONE_PASS) is read
    once and normalized from registers, its weight read while the predecessor finishes. A wider row goes in two
    passes over its chunks: the residual out stored while the squares add up, then reloaded and normalized."""
    if ONE_PASS:
        cols = tl.arange(0, CHUNK)
        mask = cols < n
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)  # a weight: no kernel of the step writes it
    wait_for_predecessor(USE_PDL)
    adapter = tl.load(adapters_ptr + row)
    rank = rank_columns(tl.load(ranks_ptr + row), R)
    b_ptr = b_ptr + adapter.to(tl.int64) * stride_bs
    h_row = h_ptr + row * stride_ht
    if ONE_PASS:
        x = _lora_hidden(row, cols, mask, x_ptr, res_ptr, stride_x, stride_res, adapter, b_ptr, stride_bn, h_row, R,
                         rank, HAS_RESIDUAL, BLOCK_R)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
        h = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n + eps)
        store_normed(out_ptr + row * stride_out + cols, x, rstd, w, mask)
    else:
        squares = tl.zeros([CHUNK], dtype=tl.float32)
        for c0 in range(0, n, CHUNK):
            cols = c0 + tl.arange(0, CHUNK)
            mask = cols < n
            x = _lora_hidden(row, cols, mask, x_ptr, res_ptr, stride_x, stride_res, adapter, b_ptr, stride_bn, h_row,
                             R, rank, HAS_RESIDUAL, BLOCK_R)
            tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
            h = x.to(tl.float32)
            squares += h * h
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / n + eps)
        tl.debug_barrier()  # the second pass reads what other threads of the program stored
        for c0 in range(0, n, CHUNK):
            cols = c0 + tl.arange(0, CHUNK)
            mask = cols < n
            x = _row_chunk(res_out_ptr, row, stride_res_out, cols, mask)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0)
            store_normed(out_ptr + row * stride_out + cols, x, rstd, w, mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, stride_out,
                         stride_res_out, n, eps, h_ptr, b_ptr, adapters_ptr, ranks_ptr, R: tl.constexpr,
                         stride_bn: tl.constexpr, stride_bs, stride_hn, stride_ht,
                         HAS_RESIDUAL: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK: tl.constexpr,
                         BLOCK_R: tl.constexpr, ONE_PASS: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if HAS_LORA:
        _add_rms_norm_lora_row(row, x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, stride_out,
                               stride_res_out, n, eps, h_ptr, b_ptr, adapters_ptr, ranks_ptr, R, stride_bn, stride_bs,
                               stride_ht, HAS_RESIDUAL, BLOCK, BLOCK_R, ONE_PASS, USE_PDL)
    else:
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)  # a weight: read while the predecessor finishes
        wait_for_predecessor(USE_PDL)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
        h = x.to(tl.float32)
        variance = tl.sum(h * h, axis=0) / n
        normed = (h * tl.rsqrt(variance + eps)).to(x.dtype)
        tl.store(out_ptr + row * stride_out + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype),
                 mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 lora: LoRADelta | None = None, *, config: LoRAOpConfig | None = None,
                 tile_config: tiles.LoRATileConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One program per row; with `lora` a row wider than `config.chunk` goes in chunks of that many columns, in
    two passes (x stays as it is). With `lora` on a step of the segment path, the tiled variant in its launch
    shape `tile_config`."""
    rows, n = x.shape
    if lora is not None and _tiled(lora):
        return tiles.add_rms_norm(x, residual, weight, eps, lora, config=tile_config)
    out = torch.empty_like(x)
    hidden = x if residual is None and lora is None else torch.empty_like(x)
    if lora is None:
        block = triton.next_power_of_2(n)
        num_warps = min(16, max(1, block // 256))
    else:
        config = config or LORA_CONFIGS["add_rms_norm"]
        block, num_warps = min(config.chunk, triton.next_power_of_2(n)), config.num_warps
    _add_rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, hidden, x.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), hidden.stride(0), n, eps,
        *_lora_args(lora, 1, x), HAS_RESIDUAL=residual is not None, HAS_LORA=lora is not None, BLOCK=block,
        BLOCK_R=_block_r(lora, config), ONE_PASS=n <= block, num_warps=num_warps, **pdl_launch(x.device),
    )
    return out, hidden


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n, h_ptr, b_gate_ptr, b_up_ptr, adapters_ptr,
                         ranks_ptr, R: tl.constexpr, stride_bn: tl.constexpr, stride_bs_gate, stride_bs_up, stride_hn,
                         stride_ht, HAS_LORA: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
                         BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    wait_for_predecessor(USE_PDL)
    if HAS_LORA:
        adapter = tl.load(adapters_ptr + row)
        rank = rank_columns(tl.load(ranks_ptr + row), R)
        b_gate_ptr = b_gate_ptr + adapter.to(tl.int64) * stride_bs_gate
        b_up_ptr = b_up_ptr + adapter.to(tl.int64) * stride_bs_up
        h_row = h_ptr + row * stride_ht
    for c in tl.static_range(CHUNKS):
        cols = (tl.program_id(1) * CHUNKS + c) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0)
        if HAS_LORA:  # noqa: SIM102 - `adapter` exists only in the HAS_LORA variant
            if adapter >= 0:
                gate = _plus_delta(gate, b_gate_ptr, stride_bn, cols, mask, h_row, R, rank, BLOCK_R)
                up = _plus_delta(up, b_up_ptr, stride_bn, cols, mask, h_row + stride_hn, R, rank, BLOCK_R)
        tl.store(out_ptr + row * stride_out + cols, silu_times(gate, up), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, lora: LoRADelta | None = None, *, config: LoRAOpConfig | None = None,
                 tile_config: tiles.LoRATileConfig | None = None) -> torch.Tensor:
    """A grid of (row, column block); with `lora` a block is `config.chunks_per_program` chunks of
    `config.chunk` columns (gate_up stays as it is). With `lora` on a step of the segment path, or marked `tiled`,
    the tiled variant (`fused_lora_tiles_triton`) in its launch shape `tile_config`."""
    rows, width = gate_up.shape
    if lora is not None and _tiled(lora):
        return tiles.silu_and_mul(gate_up, lora, config=tile_config)
    n = width // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    if lora is None:
        block, chunks, num_warps = min(1024, triton.next_power_of_2(n)), 1, 4
    else:
        config = config or LORA_CONFIGS["silu_and_mul"]
        block, chunks = min(config.chunk, triton.next_power_of_2(n)), config.chunks_per_program
        num_warps = config.num_warps
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block * chunks))](
        gate_up, out, gate_up.stride(0), out.stride(0), n, *_lora_args(lora, 2, gate_up),
        HAS_LORA=lora is not None, BLOCK=block, CHUNKS=chunks, BLOCK_R=_block_r(lora, config), num_warps=num_warps,
        **pdl_launch(gate_up.device),
    )
    return out


@triton.jit
def _rotate(base, cos, sin, mask, HALF: tl.constexpr):
    """Rotate the [heads, D] rows at `base` in place; returns their rotated halves in the tensor's dtype."""
    y1, y2 = rotated(tl.load(base, mask=mask, other=0.0), tl.load(base + HALF, mask=mask, other=0.0), cos, sin)
    tl.store(base, y1, mask=mask)
    tl.store(base + HALF, y2, mask=mask)
    return y1, y2


@triton.jit
def _load_halves_plus_delta(base, mask, b_ptr, stride_bn: tl.constexpr, cols, h_row, adapter, R: tl.constexpr, rank,
                            HALF: tl.constexpr, BLOCK_R: tl.constexpr):
    """The halves at `base` and `base + HALF` with the LoRA delta of B rows `cols` and `cols + HALF` added."""
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    if adapter >= 0:
        x1 = _plus_delta(x1, b_ptr, stride_bn, cols, mask, h_row, R, rank, BLOCK_R)
        x2 = _plus_delta(x2, b_ptr, stride_bn, cols + HALF, mask, h_row, R, rank, BLOCK_R)
    return x1, x2


@triton.jit
def _rotary_lora_program(token, j, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos, slot, k_cache_ptr, v_cache_ptr,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_table,
                         stride_cache_slot, stride_cache_head, heads, kv_heads, h_ptr, bq_ptr, bk_ptr, bv_ptr,
                         adapters_ptr, ranks_ptr, R: tl.constexpr, stride_bn: tl.constexpr, sbq, sbk, sbv, stride_hn,
                         stride_ht, HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr,
                         BLOCK_R: tl.constexpr):
    """Program j of a token: a chunk of its q heads, of its k heads (and their cache rows) or of its v heads
    (and theirs), laid out flat as (head, dim in half)."""
    e = tl.arange(0, HEADS_PER_PROGRAM * HALF_PAD)
    dims = e % HALF_PAD
    local_head = e // HALF_PAD
    in_half = dims < HALF
    cos = tl.load(cos_ptr + pos * stride_table + dims, mask=in_half, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_table + dims, mask=in_half, other=0.0)
    adapter = tl.load(adapters_ptr + token)
    rank = rank_columns(tl.load(ranks_ptr + token), R)
    h_row = h_ptr + token * stride_ht
    q_programs = tl.cdiv(heads, HEADS_PER_PROGRAM)
    kv_programs = tl.cdiv(kv_heads, HEADS_PER_PROGRAM)
    if j < q_programs:
        head = j * HEADS_PER_PROGRAM + local_head
        mask = (head < heads) & in_half
        base = q_ptr + token * stride_qt + head * stride_qh + dims
        x1, x2 = _load_halves_plus_delta(base, mask, bq_ptr + adapter.to(tl.int64) * sbq, stride_bn,
                                         head * (2 * HALF) + dims, h_row, adapter, R, rank, HALF, BLOCK_R)
        y1, y2 = rotated(x1, x2, cos, sin)
        store_halves(base, y1, y2, mask, HALF)
    elif j < q_programs + kv_programs:
        head = (j - q_programs) * HEADS_PER_PROGRAM + local_head
        mask = (head < kv_heads) & in_half
        base = k_ptr + token * stride_kt + head * stride_kh + dims
        x1, x2 = _load_halves_plus_delta(base, mask, bk_ptr + adapter.to(tl.int64) * sbk, stride_bn,
                                         head * (2 * HALF) + dims, h_row + stride_hn, adapter, R, rank, HALF, BLOCK_R)
        y1, y2 = rotated(x1, x2, cos, sin)
        store_halves(base, y1, y2, mask, HALF)
        store_halves(k_cache_ptr + slot * stride_cache_slot + head * stride_cache_head + dims, y1, y2, mask, HALF)
    else:
        head = (j - q_programs - kv_programs) * HEADS_PER_PROGRAM + local_head
        mask = (head < kv_heads) & in_half
        base = v_ptr + token * stride_vt + head * stride_vh + dims
        x1, x2 = _load_halves_plus_delta(base, mask, bv_ptr + adapter.to(tl.int64) * sbv, stride_bn,
                                         head * (2 * HALF) + dims, h_row + 2 * stride_hn, adapter, R, rank, HALF,
                                         BLOCK_R)
        if adapter >= 0:
            store_halves(base, x1, x2, mask, HALF)
        store_halves(v_cache_ptr + slot * stride_cache_slot + head * stride_cache_head + dims, x1, x2, mask, HALF)


# positions and KV slots are views into an eager step's packed inputs, 16-byte aligned only for an even token
# count: not specialized on, or the first step of the other parity would compile a second variant mid-run
@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slots_ptr"])
def _rotary_and_write_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slots_ptr, k_cache_ptr, v_cache_ptr,
                                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_table,
                                stride_cache_slot, stride_cache_head, heads, kv_heads, h_ptr, bq_ptr, bk_ptr, bv_ptr,
                                adapters_ptr, ranks_ptr, R: tl.constexpr, stride_bn: tl.constexpr, sbq, sbk, sbv,
                                stride_hn, stride_ht, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                                HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HAS_LORA: tl.constexpr,
                                HEADS_PER_PROGRAM: tl.constexpr, BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    wait_for_predecessor(USE_PDL)  # positions and cache slots may be written on the device
    pos = tl.load(pos_ptr + token).to(tl.int64)
    if HAS_LORA:
        slot = tl.load(slots_ptr + token).to(tl.int64)
        _rotary_lora_program(token, tl.program_id(1), q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos, slot, k_cache_ptr,
                             v_cache_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                             stride_table, stride_cache_slot, stride_cache_head, heads, kv_heads, h_ptr, bq_ptr,
                             bk_ptr, bv_ptr, adapters_ptr, ranks_ptr, R, stride_bn, sbq, sbk, sbv, stride_hn,
                             stride_ht, HALF, HALF_PAD, HEADS_PER_PROGRAM, BLOCK_R)
    else:
        dims = tl.arange(0, HALF_PAD)
        in_half = dims < HALF
        cos = tl.load(cos_ptr + pos * stride_table + dims, mask=in_half, other=0.0)[None, :]
        sin = tl.load(sin_ptr + pos * stride_table + dims, mask=in_half, other=0.0)[None, :]
        head = tl.arange(0, HEADS_PAD)
        _rotate(q_ptr + token * stride_qt + head[:, None] * stride_qh + dims[None, :], cos, sin,
                (head < heads)[:, None] & in_half[None, :], HALF)
        kv_head = tl.arange(0, KV_HEADS_PAD)[:, None]
        kv_mask = (kv_head < kv_heads) & in_half[None, :]
        k1, k2 = _rotate(k_ptr + token * stride_kt + kv_head * stride_kh + dims[None, :], cos, sin, kv_mask, HALF)
        slot = tl.load(slots_ptr + token).to(tl.int64)
        cache_row = slot * stride_cache_slot + kv_head * stride_cache_head + dims[None, :]
        tl.store(k_cache_ptr + cache_row, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(k_cache_ptr + cache_row + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        v_row = v_ptr + token * stride_vt + kv_head * stride_vh + dims[None, :]
        tl.store(v_cache_ptr + cache_row, tl.load(v_row, mask=kv_mask).to(v_cache_ptr.dtype.element_ty),
                 mask=kv_mask)
        tl.store(v_cache_ptr + cache_row + HALF,
                 tl.load(v_row + HALF, mask=kv_mask).to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def rotary_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, lora: LoRADelta | None = None, *,
                        config: LoRAOpConfig | None = None, tile_config: tiles.LoRATileConfig | None = None) -> None:
    """One launch: without `lora` one program per token rotates its q and k heads in place and stores its
    rotated k and its v; with `lora` a grid of (token, chunk of `config.chunk` q, k or v heads) also adds
    the deltas (v's in place too), or on a step of the segment path the tiled variant in `tile_config`.

    q, k, v may be strided views (only the last dim must be dense); the caches are contiguous and
    of one shape [blocks, block_size, kv_heads, D], so a flat slot is block * block_size + offset.
    """
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    if tokens == 0:
        return
    if lora is not None and _tiled(lora):
        tiles.rotary_and_write_kv(q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping, lora,
                                  config=tile_config)
        return
    if lora is None:
        grid, heads_per_program, num_warps = (tokens,), 1, 4
    else:
        config = config or LORA_CONFIGS["rotary_and_write_kv"]
        heads_per_program, num_warps = config.chunk, config.num_warps
        grid = (tokens, triton.cdiv(heads, heads_per_program) + 2 * triton.cdiv(kv_heads, heads_per_program))
    _rotary_and_write_kv_kernel[grid](
        q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), cos.stride(0), k_cache.stride(1), k_cache.stride(2), heads, kv_heads,
        *_lora_args(lora, 3, q), HALF=dim // 2, HALF_PAD=triton.next_power_of_2(dim // 2),
        HEADS_PAD=triton.next_power_of_2(heads), KV_HEADS_PAD=triton.next_power_of_2(kv_heads),
        HAS_LORA=lora is not None, HEADS_PER_PROGRAM=heads_per_program, BLOCK_R=_block_r(lora, config),
        num_warps=num_warps, **pdl_launch(q.device),
    )
