"""Triton versions of the fused per-token ops: one launch each instead of a chain of elementwise kernels.

Rounding follows the torch reference step by step (float32 math, rounded to the model dtype where
torch rounds), so the two agree to the last bit in float32 and within one rounding in bf16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, stride_out,
                         stride_res_out, n, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / n
    normed = (h * tl.rsqrt(variance + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = x.shape
    out = torch.empty_like(x)
    hidden = x if residual is None else torch.empty_like(x)
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, hidden, x.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), hidden.stride(0), n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return out, hidden


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + cols, (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype),
             mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n,
                                                        BLOCK=block, num_warps=4)
    return out


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, stride_t, stride_h, stride_table, heads,
                   HALF: tl.constexpr, HEADS_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * stride_table + dims)
    sin = tl.load(sin_ptr + pos * stride_table + dims)
    head = tl.arange(0, HEADS_PAD)
    mask = (head < heads)[:, None]
    base = x_ptr + token * stride_t + head[:, None] * stride_h + dims[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(base, (a * cos[None, :] - b * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(base + HALF, (b * cos[None, :] + a * sin[None, :]).to(x1.dtype), mask=mask)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q and k (views of the fused q/k/v output are fine: only the last dim must be dense)."""
    for x in (q, k):
        tokens, heads, dim = x.shape
        _rotary_kernel[(tokens,)](x, cos, sin, positions, x.stride(0), x.stride(1), cos.stride(0), heads,
                                  HALF=dim // 2, HEADS_PAD=triton.next_power_of_2(heads), num_warps=4)
    return q, k
