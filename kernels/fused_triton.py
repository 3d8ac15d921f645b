"""Triton versions of the fused per-token ops: one launch each instead of a chain of elementwise kernels.

Rounding follows the torch reference step by step (float32 math, rounded to the model dtype where
torch rounds), so the two agree to the last bit in float32 and within one rounding in bf16.

With a `LoRADelta` each op also applies the LoRA expand of the projection it consumes: a token's
program reads the h row and the B[slot] rows of the columns it produces and adds the delta, rounded
once, before the op's own math (tokens of slot -1 read no B). The B tiles are [columns, rank block],
so the LoRA variants walk their columns in chunks (`LORA_CONFIGS`); without a delta (`HAS_LORA`
false) each kernel compiles to the code it had before.

A LoRA variant whose config has a `group` G > 1 runs a program per tile of the delta's metadata (made with
`block_m` G): up to G tokens of one slot, taken together as [G, columns] chunks, so each B chunk it loads
serves all of them instead of being read again from L2 per token (the delta is a broadcast multiply-sum
over the rank on CUDA cores, G being too few rows for a tensor-core dot). Tiles of slot -1 get the op
without a delta; every token is in one tile. Group 1 reads the per-token slots and compiles to the
one-token code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import lora_tuning
from kernels.lora_delta import LoRADelta
from kernels.lora_triton import _bgmv_rows, delta_rows, slot_stacks
from kernels.pdl_triton import pdl_launch, wait_for_predecessor


@dataclass(frozen=True)
class LoRAOpConfig:
    """Launch shape of a fused op's LoRA variant.

    `chunk`: columns per loop step (add_rms_norm, silu_and_mul) or heads per program (rotary_and_write_kv);
    `block_r`: rank columns of B per step (the rank is padded to a power of two up to this, larger ranks
    loop); `chunks_per_program`: silu_and_mul's column chunks per program; `group`: tokens of one slot per
    program, 1 (a program per token, any metadata) or the metadata's `block_m` (a program per tile).
    """

    chunk: int
    block_r: int
    num_warps: int
    chunks_per_program: int = 1
    group: int = 1

    def __post_init__(self) -> None:
        for name in ("chunk", "block_r", "num_warps", "group"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")


# Group 1: winners of `benchmarks/fused_ops.py --tokens 64 128 --lora-only` on an H200 (Llama-3-8B shapes,
# 64 adapters at rank 16; triton 3.6), 2026-11-29, us at 64 / 128 tokens against the BGMV expand followed by
# the op: add_rms_norm 4.8 / 5.4 against 5.2 / 6.7, silu_and_mul 13.7 / 25.1 against 15.4 / 27.3, rotary and
# KV write 4.2 / 6.5 against 6.8 / 8.8. Larger groups: not yet measured (`benchmarks/fused_ops.py --group 1 2
# 4 8`); [group, columns] chunks sized so that the sm_90 code spills no registers (rotary at 16 aside). A group's
# entry may have group 1: that op then runs per token on the step's grouped metadata. (op, group) -> config
LORA_CONFIGS: dict[tuple[str, int], LoRAOpConfig] = {
    ("add_rms_norm", 1): LoRAOpConfig(chunk=4096, block_r=16, num_warps=32),
    ("add_rms_norm", 2): LoRAOpConfig(chunk=1024, block_r=16, num_warps=32, group=2),
    ("add_rms_norm", 4): LoRAOpConfig(chunk=512, block_r=16, num_warps=32, group=4),
    ("add_rms_norm", 8): LoRAOpConfig(chunk=256, block_r=16, num_warps=32, group=8),
    ("add_rms_norm", 16): LoRAOpConfig(chunk=64, block_r=16, num_warps=32, group=16),
    ("silu_and_mul", 1): LoRAOpConfig(chunk=256, block_r=16, num_warps=4, chunks_per_program=1),
    ("silu_and_mul", 2): LoRAOpConfig(chunk=256, block_r=16, num_warps=8, group=2),
    ("silu_and_mul", 4): LoRAOpConfig(chunk=128, block_r=16, num_warps=8, group=4),
    ("silu_and_mul", 8): LoRAOpConfig(chunk=64, block_r=16, num_warps=8, group=8),
    ("silu_and_mul", 16): LoRAOpConfig(chunk=32, block_r=16, num_warps=8, group=16),
    ("rotary_and_write_kv", 1): LoRAOpConfig(chunk=4, block_r=16, num_warps=4),
    ("rotary_and_write_kv", 2): LoRAOpConfig(chunk=4, block_r=16, num_warps=16, group=2),
    ("rotary_and_write_kv", 4): LoRAOpConfig(chunk=2, block_r=16, num_warps=16, group=4),
    ("rotary_and_write_kv", 8): LoRAOpConfig(chunk=1, block_r=16, num_warps=16, group=8),
    ("rotary_and_write_kv", 16): LoRAOpConfig(chunk=1, block_r=16, num_warps=32, group=16),
}


def lora_config(op: str, group: int | None = None) -> LoRAOpConfig:
    """The launch shape of `op`'s LoRA variant for `group` tokens per program; by default the per-token LoRA
    kernels' (`lora_tuning.bgmv_group()`), whose metadata the step's fused ops share."""
    group = lora_tuning.bgmv_group() if group is None else group
    if (op, group) not in LORA_CONFIGS:
        known = sorted(g for name, g in LORA_CONFIGS if name == op)
        raise ValueError(f"no {op} LoRA launch shape for group {group}; groups: {known}")
    return LORA_CONFIGS[(op, group)]


def _programs(rows: int, lora: LoRADelta | None, config: LoRAOpConfig | None) -> int:
    """The grid's first axis: a program per row, or per metadata tile for a grouped config (whose group must
    then be the tile height)."""
    if lora is None or config.group == 1:
        return rows
    if config.group != lora.meta.block_m:
        raise ValueError(f"a fused-op config with group {config.group} needs metadata tiles of {config.group} "
                         f"rows, these have {lora.meta.block_m}")
    return lora.meta.num_tiles


def _lora_args(lora: LoRADelta | None, num_slices: int, placeholder: torch.Tensor) -> tuple:
    """(h, B_0 .. B_{n-1}, adapter slots, token order, tile slots, starts and lengths, rank, B slot strides ..,
    h strides) as the kernels take them; placeholders that no kernel reads without a delta. The rank is a
    constexpr: one compile per rank."""
    if lora is None:
        return (placeholder,) * (num_slices + 6) + (0,) * (num_slices + 3)
    b_slices = slot_stacks(lora.b_slices)
    h = lora.h if lora.h.stride(2) == 1 else lora.h.contiguous()
    meta = lora.meta
    return (h, *b_slices, meta.slots, meta.token_order, meta.tile_slot, meta.tile_start, meta.tile_len, lora.rank,
            *(b.stride(0) for b in b_slices), h.stride(0), h.stride(1))


def _block_r(lora: LoRADelta | None, config: LoRAOpConfig) -> int:
    return 1 if lora is None else min(config.block_r, triton.next_power_of_2(lora.rank))


def _group(lora: LoRADelta | None, config: LoRAOpConfig | None) -> int:
    return 1 if lora is None else config.group


@triton.jit
def _plus_delta(y, b_ptr, cols, col_mask, h_rows, R: tl.constexpr, BLOCK_R: tl.constexpr, GROUP: tl.constexpr):
    """y + h . B[cols]^T, rounded once to y's dtype: B (one slot, rows of R values) at rows `cols` (where
    `col_mask`), h one token's row (GROUP 1, y [len(cols)]) or a [GROUP, 1] column of a tile's (y [GROUP,
    len(cols)])."""
    return (y.to(tl.float32) + delta_rows(b_ptr, cols, col_mask, h_rows, R, BLOCK_R, GROUP)).to(y.dtype)


@triton.jit
def _row_sums(v, GROUP: tl.constexpr):
    """The sum along v's last axis: a scalar for one row (GROUP 1), a [GROUP, 1] column for a tile's rows."""
    if GROUP == 1:
        return tl.sum(v, axis=0)
    else:
        return tl.sum(v, axis=1)[:, None]


@triton.jit
def _add_rms_norm_lora_rows(rows, live, adapter, x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res,
                            stride_out, stride_res_out, n, eps, h_ptr, b_ptr, R: tl.constexpr, stride_bs, stride_ht,
                            HAS_RESIDUAL: tl.constexpr, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr,
                            GROUP: tl.constexpr):
    """Two passes over column chunks of one row or a tile's rows (`rows` as `_bgmv_rows` gives them): x + delta
    (+ residual) stored as the residual out while the squares add up, then the stored rows normalized."""
    b_ptr = b_ptr + adapter.to(tl.int64) * stride_bs
    h_rows = h_ptr + rows * stride_ht
    offs = tl.arange(0, CHUNK)
    squares = tl.zeros((rows + offs).shape, dtype=tl.float32)
    for c0 in range(0, n, CHUNK):
        cols = c0 + offs
        col_mask = cols < n
        mask = live & col_mask
        x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
        if adapter >= 0:
            x = _plus_delta(x, b_ptr, cols, col_mask, h_rows, R, BLOCK_R, GROUP)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rows * stride_res + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + rows * stride_res_out + cols, x, mask=mask)
        h = x.to(tl.float32)
        squares += h * h
    rstd = tl.rsqrt(_row_sums(squares, GROUP) / n + eps)
    tl.debug_barrier()  # the second pass reads what other threads of the program stored
    for c0 in range(0, n, CHUNK):
        cols = c0 + offs
        col_mask = cols < n
        mask = live & col_mask
        x = tl.load(res_out_ptr + rows * stride_res_out + cols, mask=mask, other=0.0)
        normed = (x.to(tl.float32) * rstd).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0)
        tl.store(out_ptr + rows * stride_out + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype),
                 mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, stride_out,
                         stride_res_out, n, eps, h_ptr, b_ptr, adapters_ptr, order_ptr, tile_slot_ptr, tile_start_ptr,
                         tile_len_ptr, R: tl.constexpr, stride_bs, stride_hn, stride_ht,
                         HAS_RESIDUAL: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK: tl.constexpr,
                         BLOCK_R: tl.constexpr, GROUP: tl.constexpr, USE_PDL: tl.constexpr):
    if HAS_LORA:
        wait_for_predecessor(USE_PDL)
        adapter, rows, live = _bgmv_rows(tl.program_id(0), adapters_ptr, order_ptr, tile_slot_ptr, tile_start_ptr,
                                         tile_len_ptr, GROUP)
        _add_rms_norm_lora_rows(rows, live, adapter, x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x,
                                stride_res, stride_out, stride_res_out, n, eps, h_ptr, b_ptr, R, stride_bs, stride_ht,
                                HAS_RESIDUAL, BLOCK, BLOCK_R, GROUP)
    else:
        row = tl.program_id(0).to(tl.int64)
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
                 lora: LoRADelta | None = None, *,
                 config: LoRAOpConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One program per row; with `lora` the row (or a tile's rows) goes in `config.chunk`-column steps (x stays
    as it is)."""
    rows, n = x.shape
    out = torch.empty_like(x)
    hidden = x if residual is None and lora is None else torch.empty_like(x)
    if lora is None:
        block = triton.next_power_of_2(n)
        num_warps = min(16, max(1, block // 256))
    else:
        config = config or lora_config("add_rms_norm")
        block, num_warps = min(config.chunk, triton.next_power_of_2(n)), config.num_warps
    _add_rms_norm_kernel[(_programs(rows, lora, config),)](
        x, residual if residual is not None else x, weight, out, hidden, x.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), hidden.stride(0), n, eps,
        *_lora_args(lora, 1, x), HAS_RESIDUAL=residual is not None, HAS_LORA=lora is not None, BLOCK=block,
        BLOCK_R=_block_r(lora, config), GROUP=_group(lora, config), num_warps=num_warps, **pdl_launch(x.device),
    )
    return out, hidden


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n, h_ptr, b_gate_ptr, b_up_ptr, adapters_ptr,
                         order_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr, R: tl.constexpr, stride_bs_gate,
                         stride_bs_up, stride_hn, stride_ht, HAS_LORA: tl.constexpr, BLOCK: tl.constexpr,
                         CHUNKS: tl.constexpr, BLOCK_R: tl.constexpr, GROUP: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_predecessor(USE_PDL)
    if HAS_LORA:
        adapter, rows, live = _bgmv_rows(tl.program_id(0), adapters_ptr, order_ptr, tile_slot_ptr, tile_start_ptr,
                                         tile_len_ptr, GROUP)
        b_gate_ptr = b_gate_ptr + adapter.to(tl.int64) * stride_bs_gate
        b_up_ptr = b_up_ptr + adapter.to(tl.int64) * stride_bs_up
        h_rows = h_ptr + rows * stride_ht
    else:
        rows = tl.program_id(0).to(tl.int64)
        live = tl.full([], 1, tl.int1)
    for c in tl.static_range(CHUNKS):
        cols = (tl.program_id(1) * CHUNKS + c) * BLOCK + tl.arange(0, BLOCK)
        col_mask = cols < n
        mask = live & col_mask
        gate = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + rows * stride_x + n + cols, mask=mask, other=0.0)
        if HAS_LORA:  # noqa: SIM102 - `adapter` exists only in the HAS_LORA variant
            if adapter >= 0:
                gate = _plus_delta(gate, b_gate_ptr, cols, col_mask, h_rows, R, BLOCK_R, GROUP)
                up = _plus_delta(up, b_up_ptr, cols, col_mask, h_rows + stride_hn, R, BLOCK_R, GROUP)
        g = gate.to(tl.float32)
        activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        tl.store(out_ptr + rows * stride_out + cols, (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype),
                 mask=mask)


def silu_and_mul(gate_up: torch.Tensor, lora: LoRADelta | None = None, *,
                 config: LoRAOpConfig | None = None) -> torch.Tensor:
    """A grid of (row, column block); with `lora` a block is `config.chunks_per_program` chunks of
    `config.chunk` columns (gate_up stays as it is), and a grouped config's rows are tiles."""
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    if lora is None:
        block, chunks, num_warps = min(1024, triton.next_power_of_2(n)), 1, 4
    else:
        config = config or lora_config("silu_and_mul")
        block, chunks = min(config.chunk, triton.next_power_of_2(n)), config.chunks_per_program
        num_warps = config.num_warps
    _silu_and_mul_kernel[(_programs(rows, lora, config), triton.cdiv(n, block * chunks))](
        gate_up, out, gate_up.stride(0), out.stride(0), n, *_lora_args(lora, 2, gate_up),
        HAS_LORA=lora is not None, BLOCK=block, CHUNKS=chunks, BLOCK_R=_block_r(lora, config),
        GROUP=_group(lora, config), num_warps=num_warps, **pdl_launch(gate_up.device),
    )
    return out


@triton.jit
def _rotated(x1, x2, cos, sin):
    """The rotary embedding of the halves x1, x2, each rounded to their dtype."""
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    return (a * cos - b * sin).to(x1.dtype), (b * cos + a * sin).to(x1.dtype)


@triton.jit
def _rotate(base, cos, sin, mask, HALF: tl.constexpr):
    """Rotate the [heads, D] rows at `base` in place; returns their rotated halves in the tensor's dtype."""
    y1, y2 = _rotated(tl.load(base, mask=mask, other=0.0), tl.load(base + HALF, mask=mask, other=0.0), cos, sin)
    tl.store(base, y1, mask=mask)
    tl.store(base + HALF, y2, mask=mask)
    return y1, y2


@triton.jit
def _load_halves_plus_delta(base, mask, b_ptr, cols, col_mask, h_rows, adapter, R: tl.constexpr,
                            HALF: tl.constexpr, BLOCK_R: tl.constexpr, GROUP: tl.constexpr):
    """The halves at `base` and `base + HALF` with the LoRA delta of B rows `cols` and `cols + HALF` added."""
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    if adapter >= 0:
        x1 = _plus_delta(x1, b_ptr, cols, col_mask, h_rows, R, BLOCK_R, GROUP)
        x2 = _plus_delta(x2, b_ptr, cols + HALF, col_mask, h_rows, R, BLOCK_R, GROUP)
    return x1, x2


@triton.jit
def _store_halves(base, x1, x2, mask, HALF: tl.constexpr):
    """Store two halves at `base` and `base + HALF`, converted to the pointer's dtype (a cache's; in place, the
    tensor's own)."""
    tl.store(base, x1.to(base.dtype.element_ty), mask=mask)
    tl.store(base + HALF, x2.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_lora_program(rows, live, adapter, j, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slots_ptr,
                         k_cache_ptr, v_cache_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_table, stride_cache_slot, stride_cache_head, heads, kv_heads, h_ptr, bq_ptr, bk_ptr,
                         bv_ptr, R: tl.constexpr, sbq, sbk, sbv, stride_hn, stride_ht, HALF: tl.constexpr,
                         HALF_PAD: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, BLOCK_R: tl.constexpr,
                         GROUP: tl.constexpr):
    """Program j of a token, or of a tile's tokens (`rows` as `_bgmv_rows` gives them): a chunk of their q heads,
    of their k heads (and the cache rows) or of their v heads (and theirs), laid out flat as (head, dim in
    half)."""
    e = tl.arange(0, HEADS_PER_PROGRAM * HALF_PAD)
    dims = e % HALF_PAD
    local_head = e // HALF_PAD
    in_half = dims < HALF
    pos = tl.load(pos_ptr + rows).to(tl.int64)
    slot = tl.load(slots_ptr + rows).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_table + dims, mask=in_half, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_table + dims, mask=in_half, other=0.0)
    h_rows = h_ptr + rows * stride_ht
    q_programs = tl.cdiv(heads, HEADS_PER_PROGRAM)
    kv_programs = tl.cdiv(kv_heads, HEADS_PER_PROGRAM)
    if j < q_programs:
        head = j * HEADS_PER_PROGRAM + local_head
        col_mask = (head < heads) & in_half
        mask = live & col_mask
        base = q_ptr + rows * stride_qt + head * stride_qh + dims
        x1, x2 = _load_halves_plus_delta(base, mask, bq_ptr + adapter.to(tl.int64) * sbq, head * (2 * HALF) + dims,
                                         col_mask, h_rows, adapter, R, HALF, BLOCK_R, GROUP)
        y1, y2 = _rotated(x1, x2, cos, sin)
        _store_halves(base, y1, y2, mask, HALF)
    elif j < q_programs + kv_programs:
        head = (j - q_programs) * HEADS_PER_PROGRAM + local_head
        col_mask = (head < kv_heads) & in_half
        mask = live & col_mask
        base = k_ptr + rows * stride_kt + head * stride_kh + dims
        x1, x2 = _load_halves_plus_delta(base, mask, bk_ptr + adapter.to(tl.int64) * sbk, head * (2 * HALF) + dims,
                                         col_mask, h_rows + stride_hn, adapter, R, HALF, BLOCK_R, GROUP)
        y1, y2 = _rotated(x1, x2, cos, sin)
        _store_halves(base, y1, y2, mask, HALF)
        _store_halves(k_cache_ptr + slot * stride_cache_slot + head * stride_cache_head + dims, y1, y2, mask, HALF)
    else:
        head = (j - q_programs - kv_programs) * HEADS_PER_PROGRAM + local_head
        col_mask = (head < kv_heads) & in_half
        mask = live & col_mask
        base = v_ptr + rows * stride_vt + head * stride_vh + dims
        x1, x2 = _load_halves_plus_delta(base, mask, bv_ptr + adapter.to(tl.int64) * sbv, head * (2 * HALF) + dims,
                                         col_mask, h_rows + 2 * stride_hn, adapter, R, HALF, BLOCK_R, GROUP)
        if adapter >= 0:
            _store_halves(base, x1, x2, mask, HALF)
        _store_halves(v_cache_ptr + slot * stride_cache_slot + head * stride_cache_head + dims, x1, x2, mask, HALF)


# positions and KV slots are views into an eager step's packed inputs, 16-byte aligned only for an even token
# count: not specialized on, or the first step of the other parity would compile a second variant mid-run
@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slots_ptr"])
def _rotary_and_write_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slots_ptr, k_cache_ptr, v_cache_ptr,
                                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_table,
                                stride_cache_slot, stride_cache_head, heads, kv_heads, h_ptr, bq_ptr, bk_ptr, bv_ptr,
                                adapters_ptr, order_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr, R: tl.constexpr,
                                sbq, sbk, sbv, stride_hn, stride_ht, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                                HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HAS_LORA: tl.constexpr,
                                HEADS_PER_PROGRAM: tl.constexpr, BLOCK_R: tl.constexpr, GROUP: tl.constexpr,
                                USE_PDL: tl.constexpr):
    wait_for_predecessor(USE_PDL)  # positions and cache slots may be written on the device
    if HAS_LORA:
        adapter, rows, live = _bgmv_rows(tl.program_id(0), adapters_ptr, order_ptr, tile_slot_ptr, tile_start_ptr,
                                         tile_len_ptr, GROUP)
        _rotary_lora_program(rows, live, adapter, tl.program_id(1), q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr,
                             slots_ptr, k_cache_ptr, v_cache_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                             stride_vt, stride_vh, stride_table, stride_cache_slot, stride_cache_head, heads, kv_heads,
                             h_ptr, bq_ptr, bk_ptr, bv_ptr, R, sbq, sbk, sbv, stride_hn, stride_ht, HALF, HALF_PAD,
                             HEADS_PER_PROGRAM, BLOCK_R, GROUP)
    else:
        token = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + token).to(tl.int64)
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
                        config: LoRAOpConfig | None = None) -> None:
    """One launch: without `lora` one program per token rotates its q and k heads in place and stores its
    rotated k and its v; with `lora` a grid of (token, or tile of a grouped config, chunk of `config.chunk` q,
    k or v heads) also adds the deltas (v's in place too).

    q, k, v may be strided views (only the last dim must be dense); the caches are contiguous and
    of one shape [blocks, block_size, kv_heads, D], so a flat slot is block * block_size + offset.
    """
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    if tokens == 0:
        return
    if lora is None:
        grid, heads_per_program, num_warps = (tokens,), 1, 4
    else:
        config = config or lora_config("rotary_and_write_kv")
        heads_per_program, num_warps = config.chunk, config.num_warps
        grid = (_programs(tokens, lora, config),
                triton.cdiv(heads, heads_per_program) + 2 * triton.cdiv(kv_heads, heads_per_program))
    _rotary_and_write_kv_kernel[grid](
        q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), cos.stride(0), k_cache.stride(1), k_cache.stride(2), heads, kv_heads,
        *_lora_args(lora, 3, q), HALF=dim // 2, HALF_PAD=triton.next_power_of_2(dim // 2),
        HEADS_PAD=triton.next_power_of_2(heads), KV_HEADS_PAD=triton.next_power_of_2(kv_heads),
        HAS_LORA=lora is not None, HEADS_PER_PROGRAM=heads_per_program, BLOCK_R=_block_r(lora, config),
        GROUP=_group(lora, config), num_warps=num_warps, **pdl_launch(q.device),
    )
