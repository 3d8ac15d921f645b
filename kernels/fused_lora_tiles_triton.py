"""Segment-tiled ("SGMV") LoRA variants of the fused ops, for prefill-sized steps.

The per-token variants in `fused_triton` read B[slot] once per token: at 8192 tokens that is gigabytes of
B traffic. Here a program takes one tile of the step's `LoRAMetadata` (up to `block_m` tokens of one slot,
gathered through `token_order`) and a chunk of columns: it reads its tile's h rows and the slot's B chunk
(below the slot's rank, `meta.tile_rank`, not its padding) once, forms the delta with a tensor-core dot
(`lora_triton.delta_tile`, the segment expand's own sum), adds it to the loaded rows rounded once to their
dtype, as the expand followed by the op would, then does the op's math. Tiles of slot -1 (base tokens) run the
plain op, so every token row is written exactly once. Grids follow the shapes alone (`meta.num_tiles`; unused
tiles have no rows), so the launches can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import lora_tuning
from kernels.fused_math_triton import rotated, silu_times, store_halves, store_normed
from kernels.lora_delta import LoRADelta
from kernels.lora_triton import b_block, delta_tile, dot_f32, plus_h_times_b, rank_columns, row_stride, slot_stacks

MIN_BLOCK_R = 16  # the dot's smallest inner dimension
MIN_COLUMNS = 16  # and its smallest output width
ROW_STEP = 16  # rows a program of silu_and_mul or rotary_and_write_kv takes at a time as it walks its part of a tile


@dataclass(frozen=True)
class LoRATileConfig:
    """Launch shape of a tiled variant: `chunk` columns per program (silu_and_mul), per step of a row walk
    (add_rms_norm) or heads per program (rotary_and_write_kv); `block_r` rank columns per dot (at least 16;
    larger ranks loop); `rows`: token rows per program, a part of a tile (0: the whole tile), for more programs
    when there are few tiles (silu_and_mul and rotary_and_write_kv walk them `ROW_STEP` at a time on B loaded once);
    `num_stages`: Triton's software pipelining depth."""

    chunk: int
    block_r: int
    num_warps: int
    rows: int = 0
    num_stages: int = 2

    def __post_init__(self) -> None:
        lora_tuning.check_powers_of_two(self, ("chunk", "block_r", "num_warps"))
        if self.rows and (self.rows < 16 or self.rows & (self.rows - 1)):
            raise ValueError(f"rows must be 0 or a power of two of at least 16, got {self.rows}")


# Chosen with `benchmarks/fused_ops.py --lora-only` on an H200 (Llama-3-8B shapes; triton 3.6), us over 8 / 64
# adapters, against the SGMV expand followed by the plain op where not said:
# - 2048 tokens (64-row tiles, rank 16): silu_and_mul 89.1 / 113.1 against 120.9 / 153.3; rotary and KV write
#   27.4 / 36.5 against 30.2 / 38.2; add_rms_norm at best 56.9 against 36.1 over 64 adapters, slower, so
#   `lora_tuning.FOLDED_OPS` leaves o and down to the expand on this path.
# - silu_and_mul walking whole tiles on B loaded once (`--tokens 8192 512 256`, rank 16): 220.8 / 239.7, 22.1 /
#   35.9 and 10.0 / 30.9, against 337.3 / 345.9, 23.3 / 51.5 and 11.2 / 36.4 taking 16 rows a program.
# - Its rank block of 64 (the rank's power of two up to 64, so a walk keeps B loaded at ranks 32 and 64; rank 16
#   is unchanged), 8192 / 512 tokens: rank 32 394.7 / 415.8 -> 244.8 / 266.7 and 35.7 / 62.6 -> 25.9 / 51.9;
#   rank 64 651.7 / 714.6 -> 354.3 / 403.8 and 61.3 / 103.5 -> 36.4 / 87.6.
# - rotary_and_write_kv's walk, 32 rows a program (8192 / 512 / 256 tokens, rank 16): 98.2 / 104.1, 8.9 / 13.0 and
#   5.7 / 10.0, against 101.5 / 112.2, 8.7 / 16.2 and 5.8 / 10.1 for 16 rows and 94.7 / 99.3, 12.7 / 12.8 and
#   5.7 / 10.1 for the whole tile.
# - Its rank block of 64 (as silu_and_mul's; rank 16 is unchanged), rank 64, 8192 / 512 tokens: 209.1 / 224.8 ->
#   127.7 / 142.1 and 18.2 / 35.6 -> 12.2 / 26.5, against 150.5 / 169.6 and 19.1 / 41.8.
# Op name -> config.
LORA_TILE_CONFIGS: dict[str, LoRATileConfig] = {
    "silu_and_mul": LoRATileConfig(chunk=128, block_r=64, num_warps=4, rows=0),
    "add_rms_norm": LoRATileConfig(chunk=512, block_r=16, num_warps=8, rows=32),
    "rotary_and_write_kv": LoRATileConfig(chunk=1, block_r=64, num_warps=4, rows=32),
}


def _tile_args(lora: LoRADelta) -> tuple:
    """(h, B_0 .. B_{n-1}, token order, tile slot, its rank, start and length, B slot strides .., B row stride, h
    strides). B's row stride is a constexpr, as the max rank is (`fused_triton._lora_args`)."""
    b_slices = slot_stacks(lora.b_slices)
    h = lora.h if lora.h.stride(2) == 1 else lora.h.contiguous()
    meta = lora.meta
    return (h, *b_slices, meta.token_order, meta.tile_slot, meta.tile_rank, meta.tile_start, meta.tile_len,
            *(b.stride(0) for b in b_slices), row_stride(b_slices), h.stride(0), h.stride(1))


def _rows_per_program(lora: LoRADelta, config: LoRATileConfig) -> int:
    block_m = lora.meta.block_m
    return min(config.rows or block_m, block_m)


def _launch(lora: LoRADelta, config: LoRATileConfig) -> dict:
    """The constexprs and launch options every tiled kernel takes: rows per program, rank, rank block."""
    return {"R": lora.rank, "ROWS": _rows_per_program(lora, config),
            "BLOCK_R": max(MIN_BLOCK_R, min(config.block_r, triton.next_power_of_2(lora.rank))),
            "DOT_F32": dot_f32(lora.b_slices[0].dtype), "num_warps": config.num_warps,
            "num_stages": config.num_stages}


def _row_blocks(lora: LoRADelta, config: LoRATileConfig) -> int:
    return lora.meta.block_m // _rows_per_program(lora, config)


@triton.jit
def _tile_part(tile_slot_ptr, tile_rank_ptr, tile_start_ptr, tile_len_ptr, tile, part, R: tl.constexpr,
               ROWS: tl.constexpr):
    """Part `part` (ROWS rows) of tile `tile`: the tile's start in `token_order`, the part's first row and its end (at
    the tile's length; none past `first` for an unused tile or the end of a short one), the tile's slot and the
    columns of its B to read (`rank_columns`: past them is padding, not read)."""
    slot = tl.load(tile_slot_ptr + tile)
    rank = rank_columns(tl.load(tile_rank_ptr + tile), R)
    start = tl.load(tile_start_ptr + tile)
    first = part * ROWS
    end = tl.minimum(tl.load(tile_len_ptr + tile), first + ROWS)
    return start, first, end, slot, rank


@triton.jit
def _step_rows(order_ptr, start, row0, end, STEP: tl.constexpr):
    """Rows row0 .. row0 + STEP of a tile: their token indices and which are in use (short of `end`)."""
    offs = row0 + tl.arange(0, STEP)
    in_use = offs < end
    return tl.load(order_ptr + start + offs, mask=in_use, other=0).to(tl.int64), in_use


@triton.jit
def _tile_rows(order_ptr, tile_slot_ptr, tile_rank_ptr, tile_start_ptr, tile_len_ptr, tile, part, R: tl.constexpr,
               ROWS: tl.constexpr):
    """Part `part` (ROWS rows) of tile `tile` taken at once: its token indices, which are in use, the tile's slot and
    its rank, and whether the part has any rows."""
    start, first, end, slot, rank = _tile_part(tile_slot_ptr, tile_rank_ptr, tile_start_ptr, tile_len_ptr, tile, part,
                                               R, ROWS)
    rows, in_use = _step_rows(order_ptr, start, first, end, ROWS)
    return rows, in_use, slot, rank, first < end


@triton.jit
def _plus_delta_tile(y, h_rows, in_use, b_ptr, stride_bn: tl.constexpr, cols, col_mask, R: tl.constexpr, rank,
                     ROWS: tl.constexpr, BLOCK_R: tl.constexpr, DOT_F32: tl.constexpr):
    """y [ROWS, cols] + h[rows] @ B[cols]^T (B's rows `stride_bn` apart, read below the slot's `rank`), rounded once
    to y's dtype."""
    delta = delta_tile(h_rows, in_use, b_ptr, stride_bn, cols, col_mask, R, rank, ROWS, BLOCK_R, DOT_F32)
    return (y.to(tl.float32) + delta).to(y.dtype)


@triton.jit
def _plus_delta_block(y, h_rows, in_use, bv, rank, BLOCK_R: tl.constexpr, DOT_F32: tl.constexpr):
    """y + h[rows] @ B^T for a rank of at most BLOCK_R, B^T's block already loaded (`b_block`): `_plus_delta_tile`'s
    sum."""
    delta = plus_h_times_b(tl.zeros(y.shape, dtype=tl.float32), h_rows, in_use, bv, 0, rank, BLOCK_R, DOT_F32)
    return (y.to(tl.float32) + delta).to(y.dtype)


@triton.jit
def _plus_delta(y, h_rows, in_use, bv, b_ptr, stride_bn: tl.constexpr, cols, col_mask, R: tl.constexpr, rank,
                STEP: tl.constexpr, BLOCK_R: tl.constexpr, DOT_F32: tl.constexpr):
    """y [STEP, cols] + h[rows] @ B[cols]^T in a program's walk over its rows, B read below the slot's `rank`: on B^T's
    block `bv`, loaded once for the walk (`b_block`), when the max rank R fits one rank block; otherwise reading B at
    `b_ptr`."""
    if R <= BLOCK_R:
        return _plus_delta_block(y, h_rows, in_use, bv, rank, BLOCK_R, DOT_F32)
    else:
        return _plus_delta_tile(y, h_rows, in_use, b_ptr, stride_bn, cols, col_mask, R, rank, STEP, BLOCK_R, DOT_F32)


@triton.jit
def _halves_plus_delta(x_rows, offset, mask, h1_rows, h2_rows, in_use, b1, b2, b1_ptr, b2_ptr, stride_bn: tl.constexpr,
                       cols1, cols2, col_mask, R: tl.constexpr, rank, STEP: tl.constexpr, BLOCK_R: tl.constexpr,
                       DOT_F32: tl.constexpr, HAS_DELTA: tl.constexpr):
    """A step's two halves, at `x_rows` and `x_rows + offset` ([STEP, cols]), each plus (HAS_DELTA) its h rows
    times its B chunk (`_plus_delta`: B^T's block `b1` / `b2`, or read at `b1_ptr` / `b2_ptr`, columns `cols1` /
    `cols2`): gate and up of silu_and_mul, the rotary halves of q, k and v."""
    x1 = tl.load(x_rows, mask=mask, other=0.0)
    x2 = tl.load(x_rows + offset, mask=mask, other=0.0)
    if HAS_DELTA:
        x1 = _plus_delta(x1, h1_rows, in_use, b1, b1_ptr, stride_bn, cols1, col_mask, R, rank, STEP, BLOCK_R, DOT_F32)
        x2 = _plus_delta(x2, h2_rows, in_use, b2, b2_ptr, stride_bn, cols2, col_mask, R, rank, STEP, BLOCK_R, DOT_F32)
    return x1, x2


@triton.jit
def _silu_rows_step(x_ptr, out_ptr, stride_x, stride_out, n, h_ptr, order_ptr, stride_hn, stride_ht, start, row0, end,
                    cols, col_mask, bg, bu, b_gate, b_up, stride_bn: tl.constexpr, R: tl.constexpr, rank,
                    STEP: tl.constexpr, BLOCK_R: tl.constexpr, DOT_F32: tl.constexpr, HAS_DELTA: tl.constexpr):
    """Rows row0 .. row0 + STEP (short of `end`) of a tile: gate and up plus their deltas, the product stored. B^T's
    chunks `bg` and `bu` come loaded when the rank fits one rank block; otherwise each step reads B."""
    rows, in_use = _step_rows(order_ptr, start, row0, end, STEP)
    mask = in_use[:, None] & col_mask[None, :]
    h_rows = h_ptr + rows[:, None] * stride_ht
    gate, up = _halves_plus_delta(x_ptr + rows[:, None] * stride_x + cols[None, :], n, mask, h_rows,
                                  h_rows + stride_hn, in_use, bg, bu, b_gate, b_up, stride_bn, cols, cols, col_mask, R,
                                  rank, STEP, BLOCK_R, DOT_F32, HAS_DELTA)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], silu_times(gate, up), mask=mask)


@triton.jit
def _silu_and_mul_tiles_kernel(x_ptr, out_ptr, stride_x, stride_out, n, h_ptr, b_gate_ptr, b_up_ptr, order_ptr,
                               tile_slot_ptr, tile_rank_ptr, tile_start_ptr, tile_len_ptr, stride_bs_gate, stride_bs_up,
                               stride_bn: tl.constexpr, stride_hn, stride_ht, R: tl.constexpr, ROWS: tl.constexpr,
                               CHUNK: tl.constexpr, STEP: tl.constexpr, BLOCK_R: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (tile, chunk, part) walks its part's ROWS rows STEP at a time (`_silu_rows_step`), the slot's B chunks
    loaded once for all steps: B's reads from L2 shrink by ROWS / STEP (H200, 8192 tokens: 337 -> 221 us)."""
    start, first, end, slot, rank = _tile_part(tile_slot_ptr, tile_rank_ptr, tile_start_ptr, tile_len_ptr,
                                               tl.program_id(0), tl.program_id(2), R, ROWS)
    cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    col_mask = cols < n
    step_args = (x_ptr, out_ptr, stride_x, stride_out, n, h_ptr, order_ptr, stride_hn, stride_ht, start)
    if (slot >= 0) & (first < end):  # a part past a short tile's end reads no B
        b_gate = b_gate_ptr + slot.to(tl.int64) * stride_bs_gate
        b_up = b_up_ptr + slot.to(tl.int64) * stride_bs_up
        bg, bu = None, None
        if R <= BLOCK_R:
            bg = b_block(b_gate, stride_bn, cols, col_mask, 0, rank, BLOCK_R)
            bu = b_block(b_up, stride_bn, cols, col_mask, 0, rank, BLOCK_R)
        for row0 in range(first, end, STEP):
            _silu_rows_step(*step_args, row0, end, cols, col_mask, bg, bu, b_gate, b_up, stride_bn, R, rank, STEP,
                            BLOCK_R, DOT_F32, HAS_DELTA=True)
    else:
        for row0 in range(first, end, STEP):
            _silu_rows_step(*step_args, row0, end, cols, col_mask, None, None, None, None, stride_bn, R, rank, STEP,
                            BLOCK_R, DOT_F32, HAS_DELTA=False)


def silu_and_mul(gate_up: torch.Tensor, lora: LoRADelta, *, config: LoRATileConfig | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate + delta) * (up + delta) for gate_up [T, 2N], into `out` [T, N] when given: a grid of (tile,
    chunk of `config.chunk` columns, part of the tile); gate_up stays as it is."""
    rows, width = gate_up.shape
    n = width // 2
    if out is None:
        out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    config = config or LORA_TILE_CONFIGS["silu_and_mul"]
    chunk = max(MIN_COLUMNS, min(config.chunk, triton.next_power_of_2(n)))
    grid = (lora.meta.num_tiles, triton.cdiv(n, chunk), _row_blocks(lora, config))
    _silu_and_mul_tiles_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), n, *_tile_args(lora),
                                     CHUNK=chunk, STEP=ROW_STEP, **_launch(lora, config))
    return out


@triton.jit
def _add_rms_norm_tiles_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, stride_out,
                               stride_res_out, n, eps, h_ptr, b_ptr, order_ptr, tile_slot_ptr, tile_rank_ptr,
                               tile_start_ptr, tile_len_ptr, stride_bs, stride_bn: tl.constexpr, stride_hn, stride_ht,
                               HAS_RESIDUAL: tl.constexpr, R: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
                               BLOCK_R: tl.constexpr, DOT_F32: tl.constexpr):
    """Two walks over the rows' columns: x + delta (+ residual), each rounded, stored as the residual out while
    the squares add up; then the stored rows reloaded and normalized."""
    rows, in_use, slot, rank, has_rows = _tile_rows(order_ptr, tile_slot_ptr, tile_rank_ptr, tile_start_ptr,
                                                    tile_len_ptr, tl.program_id(0), tl.program_id(1), R, ROWS)
    if not has_rows:
        return
    h_rows = h_ptr + rows[:, None] * stride_ht
    b_ptr = b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs
    squares = tl.zeros([ROWS, CHUNK], dtype=tl.float32)
    for c0 in range(0, n, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        col_mask = cols < n
        mask = in_use[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        if slot >= 0:
            x = _plus_delta_tile(x, h_rows, in_use, b_ptr, stride_bn, cols, col_mask, R, rank, ROWS, BLOCK_R,
                                 DOT_F32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + rows[:, None] * stride_res_out + cols[None, :], x, mask=mask)
        h = x.to(tl.float32)
        squares += h * h
    rstd = tl.rsqrt(tl.sum(squares, axis=1) / n + eps)[:, None]
    tl.debug_barrier()  # the second walk reads what other threads of the program stored
    for c0 in range(0, n, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        mask = in_use[:, None] & (cols < n)[None, :]
        x = tl.load(res_out_ptr + rows[:, None] * stride_res_out + cols[None, :], mask=mask, other=0.0)
        w = tl.load(w_ptr + cols, mask=cols < n, other=0.0)[None, :]
        store_normed(out_ptr + rows[:, None] * stride_out + cols[None, :], x, rstd, w, mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, lora: LoRADelta,
                 *, config: LoRATileConfig | None = None,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + delta + residual), x + delta + residual) for x [T, N], into `out` (normed, residual
    out) when given: a grid of (tile, part of the tile), each program walking its rows in chunks of
    `config.chunk` columns; x stays as it is."""
    rows, n = x.shape
    normed, hidden = out if out is not None else (torch.empty_like(x), torch.empty_like(x))
    if rows == 0:
        return normed, hidden
    config = config or LORA_TILE_CONFIGS["add_rms_norm"]
    chunk = max(MIN_COLUMNS, min(config.chunk, triton.next_power_of_2(n)))
    _add_rms_norm_tiles_kernel[(lora.meta.num_tiles, _row_blocks(lora, config))](
        x, residual if residual is not None else x, weight, normed, hidden, x.stride(0),
        residual.stride(0) if residual is not None else 0, normed.stride(0), hidden.stride(0), n, eps,
        *_tile_args(lora), HAS_RESIDUAL=residual is not None, CHUNK=chunk, **_launch(lora, config),
    )
    return normed, hidden


@triton.jit
def _rotary_rows_step(x_ptr, stride_xt, x_cols, cache_ptr, stride_cache_slot, cache_cols, cos_ptr, sin_ptr, pos_ptr,
                      slots_ptr, stride_table, dims, in_half, order_ptr, start, row0, end, h_ptr, stride_ht, col_mask,
                      b1, b2, b_ptr, stride_bn: tl.constexpr, cols, R: tl.constexpr, rank, STEP: tl.constexpr,
                      HALF: tl.constexpr,
                      BLOCK_R: tl.constexpr, DOT_F32: tl.constexpr, HAS_DELTA: tl.constexpr, ROTATE: tl.constexpr,
                      CACHE: tl.constexpr):
    """Rows row0 .. row0 + STEP (short of `end`) of a tile, for a program's heads of q, k or v ([STEP, heads x half],
    columns `x_cols` and `x_cols + HALF`): the halves plus the deltas of B rows `cols` and `cols + HALF` (B^T's
    blocks `b1` and `b2` when the rank fits one rank block, else read from `b_ptr`), rotated (q, k), stored back
    (but for v without a delta, which is as it was) and into the cache (k, v)."""
    rows, in_use = _step_rows(order_ptr, start, row0, end, STEP)
    mask = in_use[:, None] & col_mask[None, :]
    base = x_ptr + rows[:, None] * stride_xt + x_cols[None, :]
    h_rows = h_ptr + rows[:, None] * stride_ht
    x1, x2 = _halves_plus_delta(base, HALF, mask, h_rows, h_rows, in_use, b1, b2, b_ptr, b_ptr, stride_bn, cols,
                                cols + HALF, col_mask, R, rank, STEP, BLOCK_R, DOT_F32, HAS_DELTA)
    if ROTATE:
        pos = tl.load(pos_ptr + rows, mask=in_use, other=0).to(tl.int64)
        table = pos[:, None] * stride_table + dims[None, :]
        table_mask = in_use[:, None] & in_half[None, :]
        x1, x2 = rotated(x1, x2, tl.load(cos_ptr + table, mask=table_mask, other=0.0),
                         tl.load(sin_ptr + table, mask=table_mask, other=0.0))
    if ROTATE or HAS_DELTA:
        store_halves(base, x1, x2, mask, HALF)
    if CACHE:
        cache_slot = tl.load(slots_ptr + rows, mask=in_use, other=0).to(tl.int64)
        store_halves(cache_ptr + cache_slot[:, None] * stride_cache_slot + cache_cols[None, :], x1, x2, mask, HALF)


@triton.jit
def _rotary_walk(x_ptr, stride_xt, stride_xh, cache_ptr, head, num_heads, h_ptr, b_ptr, stride_bs,
                 stride_bn: tl.constexpr, cos_ptr, sin_ptr, pos_ptr, slots_ptr, stride_table, stride_cache_slot,
                 stride_cache_head, dims, in_half, order_ptr, start, first, end, slot, rank, stride_ht, R: tl.constexpr,
                 STEP: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, DOT_F32: tl.constexpr,
                 ROTATE: tl.constexpr, CACHE: tl.constexpr):
    """A program's heads `head` of q, k or v (h's slice at `h_ptr`, B's stack at `b_ptr`) over its part's rows first ..
    end, STEP at a time (`_rotary_rows_step`), the slot's B rows for its heads loaded once for all steps."""
    col_mask = (head < num_heads) & in_half
    cols = head * (2 * HALF) + dims
    step_args = (x_ptr, stride_xt, head * stride_xh + dims, cache_ptr, stride_cache_slot,
                 head * stride_cache_head + dims, cos_ptr, sin_ptr, pos_ptr, slots_ptr, stride_table, dims, in_half,
                 order_ptr, start)
    if (slot >= 0) & (first < end):  # a part past a short tile's end reads no B
        b_ptr = b_ptr + slot.to(tl.int64) * stride_bs
        b1, b2 = None, None
        if R <= BLOCK_R:
            b1 = b_block(b_ptr, stride_bn, cols, col_mask, 0, rank, BLOCK_R)
            b2 = b_block(b_ptr, stride_bn, cols + HALF, col_mask, 0, rank, BLOCK_R)
        for row0 in range(first, end, STEP):
            _rotary_rows_step(*step_args, row0, end, h_ptr, stride_ht, col_mask, b1, b2, b_ptr, stride_bn, cols, R,
                              rank, STEP, HALF, BLOCK_R, DOT_F32, HAS_DELTA=True, ROTATE=ROTATE, CACHE=CACHE)
    else:
        for row0 in range(first, end, STEP):
            _rotary_rows_step(*step_args, row0, end, h_ptr, stride_ht, col_mask, None, None, None, stride_bn, cols, R,
                              rank, STEP, HALF, BLOCK_R, DOT_F32, HAS_DELTA=False, ROTATE=ROTATE, CACHE=CACHE)


# positions and KV slots: not specialized on alignment (see `fused_triton._rotary_and_write_kv_kernel`)
@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slots_ptr"])
def _rotary_tiles_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slots_ptr, k_cache_ptr, v_cache_ptr,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_table,
                         stride_cache_slot, stride_cache_head, heads, kv_heads, h_ptr, bq_ptr, bk_ptr, bv_ptr,
                         order_ptr, tile_slot_ptr, tile_rank_ptr, tile_start_ptr, tile_len_ptr, sbq, sbk, sbv,
                         stride_bn: tl.constexpr, stride_hn, stride_ht, R: tl.constexpr, ROWS: tl.constexpr,
                         STEP: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                         HEADS_PER_PROGRAM: tl.constexpr, BLOCK_R: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (tile, j, part): a chunk of q heads, of k heads (and cache rows) or of v heads (and theirs), laid out
    flat as (head, dim in half) per row, for its part's ROWS rows walked STEP at a time (`_rotary_walk`): the slot's B
    rows loaded once for all steps, so B's reads from L2 shrink by ROWS / STEP."""
    start, first, end, slot, rank = _tile_part(tile_slot_ptr, tile_rank_ptr, tile_start_ptr, tile_len_ptr,
                                               tl.program_id(0), tl.program_id(2), R, ROWS)
    j = tl.program_id(1)
    e = tl.arange(0, HEADS_PER_PROGRAM * HALF_PAD)
    dims = e % HALF_PAD
    local_head = e // HALF_PAD
    walk_args = (cos_ptr, sin_ptr, pos_ptr, slots_ptr, stride_table, stride_cache_slot, stride_cache_head, dims,
                 dims < HALF, order_ptr, start, first, end, slot, rank, stride_ht)
    q_programs = tl.cdiv(heads, HEADS_PER_PROGRAM)
    kv_programs = tl.cdiv(kv_heads, HEADS_PER_PROGRAM)
    if j < q_programs:
        _rotary_walk(q_ptr, stride_qt, stride_qh, None, j * HEADS_PER_PROGRAM + local_head, heads, h_ptr, bq_ptr, sbq,
                     stride_bn, *walk_args, R, STEP, HALF, BLOCK_R, DOT_F32, ROTATE=True, CACHE=False)
    elif j < q_programs + kv_programs:
        _rotary_walk(k_ptr, stride_kt, stride_kh, k_cache_ptr, (j - q_programs) * HEADS_PER_PROGRAM + local_head,
                     kv_heads, h_ptr + stride_hn, bk_ptr, sbk, stride_bn, *walk_args, R, STEP, HALF, BLOCK_R, DOT_F32,
                     ROTATE=True, CACHE=True)
    else:
        _rotary_walk(v_ptr, stride_vt, stride_vh, v_cache_ptr,
                     (j - q_programs - kv_programs) * HEADS_PER_PROGRAM + local_head, kv_heads, h_ptr + 2 * stride_hn,
                     bv_ptr, sbv, stride_bn, *walk_args, R, STEP, HALF, BLOCK_R, DOT_F32, ROTATE=False, CACHE=True)


def rotary_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, lora: LoRADelta, *, config: LoRATileConfig | None = None) -> None:
    """q, k and v plus their deltas, q and k rotated in place, k and v stored in the caches: a grid of (tile, chunk
    of `config.chunk` q, k or v heads, part of the tile); v holds its delta after. Shapes and strides as
    `fused_triton.rotary_and_write_kv` takes them."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    if tokens == 0:
        return
    config = config or LORA_TILE_CONFIGS["rotary_and_write_kv"]
    half_pad = triton.next_power_of_2(dim // 2)
    heads_per_program = max(config.chunk, MIN_COLUMNS // half_pad)
    programs = triton.cdiv(heads, heads_per_program) + 2 * triton.cdiv(kv_heads, heads_per_program)
    _rotary_tiles_kernel[(lora.meta.num_tiles, programs, _row_blocks(lora, config))](
        q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), cos.stride(0), k_cache.stride(1), k_cache.stride(2), heads, kv_heads,
        *_tile_args(lora), STEP=ROW_STEP, HALF=dim // 2, HALF_PAD=half_pad, HEADS_PER_PROGRAM=heads_per_program,
        **_launch(lora, config),
    )
