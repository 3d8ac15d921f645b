"""Segment-tiled ("SGMV") LoRA variants of the fused ops, for prefill-sized steps.

The per-token variants in `fused_triton` read B[slot] once per token: at 8192 tokens that is gigabytes of
B traffic. Here a program takes one tile of the step's `LoRAMetadata` (up to `block_m` tokens of one slot,
gathered through `token_order`) and a chunk of columns: it reads its tile's h rows and the slot's B chunk
once, forms the delta with a tensor-core dot (`lora_triton.delta_tile`, the segment expand's own sum), adds
it to the loaded rows rounded once to their dtype, as the expand followed by the op would, then does the
op's math. Tiles of slot -1 (base tokens) run the plain op, so every token row is written exactly once.
Grids follow the shapes alone (`meta.num_tiles`; unused tiles have no rows), so the launches can be
captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.lora_delta import LoRADelta
from kernels.lora_triton import delta_tile, dot_f32, slot_stacks

MIN_BLOCK_R = 16  # the dot's smallest inner dimension


@dataclass(frozen=True)
class LoRATileConfig:
    """Launch shape of a tiled variant: `chunk` columns per program (silu_and_mul) or per step of a row walk
    (add_rms_norm); `block_r` rank columns per dot (at least 16; larger ranks loop); `rows`: token rows per
    program, a part of a tile (0: the whole tile), for more programs when there are few tiles."""

    chunk: int
    block_r: int
    num_warps: int
    rows: int = 0
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("chunk", "block_r", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.rows and (self.rows < 16 or self.rows & (self.rows - 1)):
            raise ValueError(f"rows must be 0 or a power of two of at least 16, got {self.rows}")


# Untuned: first guesses for Llama-3-8B shapes at 8192 tokens, pending an H200 run of
# `benchmarks/fused_ops.py --lora-only --tokens 8192`. Op name -> config.
LORA_TILE_CONFIGS: dict[str, LoRATileConfig] = {
    "silu_and_mul": LoRATileConfig(chunk=128, block_r=16, num_warps=4),
    "add_rms_norm": LoRATileConfig(chunk=256, block_r=16, num_warps=8, rows=16),
}


def _tile_args(lora: LoRADelta) -> tuple:
    """(h, B_0 .. B_{n-1}, token order, tile slot, start and length, B slot strides .., h strides)."""
    b_slices = slot_stacks(lora.b_slices)
    h = lora.h if lora.h.stride(2) == 1 else lora.h.contiguous()
    meta = lora.meta
    return (h, *b_slices, meta.token_order, meta.tile_slot, meta.tile_start, meta.tile_len,
            *(b.stride(0) for b in b_slices), h.stride(0), h.stride(1))


def _launch(lora: LoRADelta, config: LoRATileConfig) -> dict:
    """The constexprs and launch options every tiled kernel takes: rows per program, rank, rank block."""
    block_m = lora.meta.block_m
    return dict(R=lora.rank, ROWS=min(config.rows or block_m, block_m),
                BLOCK_R=max(MIN_BLOCK_R, min(config.block_r, triton.next_power_of_2(lora.rank))),
                DOT_F32=dot_f32(lora.b_slices[0].dtype), num_warps=config.num_warps, num_stages=config.num_stages)


def _row_blocks(lora: LoRADelta, config: LoRATileConfig) -> int:
    block_m = lora.meta.block_m
    return block_m // min(config.rows or block_m, block_m)


@triton.jit
def _tile_rows(order_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr, tile, part, ROWS: tl.constexpr):
    """Part `part` (ROWS rows) of tile `tile`: its token indices, which are in use, and the tile's slot."""
    start = tl.load(tile_start_ptr + tile)
    length = tl.load(tile_len_ptr + tile)
    offs = part * ROWS + tl.arange(0, ROWS)
    in_use = offs < length
    rows = tl.load(order_ptr + start + offs, mask=in_use, other=0).to(tl.int64)
    return rows, in_use, tl.load(tile_slot_ptr + tile)


@triton.jit
def _plus_delta_tile(y, h_rows, in_use, b_ptr, cols, col_mask, R: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_R: tl.constexpr, DOT_F32: tl.constexpr):
    """y [ROWS, cols] + h[rows] @ B[cols]^T, rounded once to y's dtype."""
    delta = delta_tile(h_rows, in_use, b_ptr, cols, col_mask, R, ROWS, BLOCK_R, DOT_F32)
    return (y.to(tl.float32) + delta).to(y.dtype)


@triton.jit
def _silu_and_mul_tiles_kernel(x_ptr, out_ptr, stride_x, stride_out, n, h_ptr, b_gate_ptr, b_up_ptr, order_ptr,
                               tile_slot_ptr, tile_start_ptr, tile_len_ptr, stride_bs_gate, stride_bs_up, stride_hn,
                               stride_ht, R: tl.constexpr, ROWS: tl.constexpr,
                               CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, DOT_F32: tl.constexpr):
    rows, in_use, slot = _tile_rows(order_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr, tl.program_id(0),
                                    tl.program_id(2), ROWS)
    cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    col_mask = cols < n
    mask = in_use[:, None] & col_mask[None, :]
    x_rows = x_ptr + rows[:, None] * stride_x + cols[None, :]
    gate = tl.load(x_rows, mask=mask, other=0.0)
    up = tl.load(x_rows + n, mask=mask, other=0.0)
    if slot >= 0:
        h_rows = h_ptr + rows[:, None] * stride_ht
        gate = _plus_delta_tile(gate, h_rows, in_use, b_gate_ptr + slot.to(tl.int64) * stride_bs_gate, cols,
                                col_mask, R, ROWS, BLOCK_R, DOT_F32)
        up = _plus_delta_tile(up, h_rows + stride_hn, in_use, b_up_ptr + slot.to(tl.int64) * stride_bs_up, cols,
                              col_mask, R, ROWS, BLOCK_R, DOT_F32)
    g = gate.to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :],
             (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


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
    chunk = min(config.chunk, max(16, triton.next_power_of_2(n)))
    grid = (lora.meta.num_tiles, triton.cdiv(n, chunk), _row_blocks(lora, config))
    _silu_and_mul_tiles_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), n, *_tile_args(lora),
                                     CHUNK=chunk, **_launch(lora, config))
    return out


@triton.jit
def _add_rms_norm_tiles_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, stride_out,
                               stride_res_out, n, eps, h_ptr, b_ptr, order_ptr, tile_slot_ptr, tile_start_ptr,
                               tile_len_ptr, stride_bs, stride_hn, stride_ht, HAS_RESIDUAL: tl.constexpr,
                               R: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
                               BLOCK_R: tl.constexpr, DOT_F32: tl.constexpr):
    """Two walks over the rows' columns: x + delta (+ residual), each rounded, stored as the residual out while
    the squares add up; then the stored rows reloaded and normalized."""
    rows, in_use, slot = _tile_rows(order_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr, tl.program_id(0),
                                    tl.program_id(1), ROWS)
    h_rows = h_ptr + rows[:, None] * stride_ht
    b_ptr = b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs
    squares = tl.zeros([ROWS, CHUNK], dtype=tl.float32)
    for c0 in range(0, n, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        col_mask = cols < n
        mask = in_use[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        if slot >= 0:
            x = _plus_delta_tile(x, h_rows, in_use, b_ptr, cols, col_mask, R, ROWS, BLOCK_R, DOT_F32)
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
        normed = (x.to(tl.float32) * rstd).to(x.dtype)
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :],
                 (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


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
    chunk = min(config.chunk, max(16, triton.next_power_of_2(n)))
    _add_rms_norm_tiles_kernel[(lora.meta.num_tiles, _row_blocks(lora, config))](
        x, residual if residual is not None else x, weight, normed, hidden, x.stride(0),
        residual.stride(0) if residual is not None else 0, normed.stride(0), hidden.stride(0), n, eps,
        *_tile_args(lora), HAS_RESIDUAL=residual is not None, CHUNK=chunk, **_launch(lora, config),
    )
    return normed, hidden
