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
def _rotate(base, cos, sin, mask, HALF: tl.constexpr):
    """Rotate the [heads, D] rows at `base` in place; returns their rotated halves in the tensor's dtype."""
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    y1 = (a * cos - b * sin).to(x1.dtype)
    y2 = (b * cos + a * sin).to(x1.dtype)
    tl.store(base, y1, mask=mask)
    tl.store(base + HALF, y2, mask=mask)
    return y1, y2


@triton.jit
def _rotary_and_write_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slots_ptr, k_cache_ptr, v_cache_ptr,
                                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_table,
                                stride_cache_slot, stride_cache_head, heads, kv_heads, HALF: tl.constexpr,
                                HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr):
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
    tl.store(v_cache_ptr + cache_row, tl.load(v_row, mask=kv_mask).to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(v_cache_ptr + cache_row + HALF, tl.load(v_row + HALF, mask=kv_mask).to(v_cache_ptr.dtype.element_ty),
             mask=kv_mask)


def rotary_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    """One launch, one program per token: rotate its q and k heads in place, store its rotated k and its v.

    q, k, v may be strided views (only the last dim must be dense); the caches are contiguous and
    of one shape [blocks, block_size, kv_heads, D], so a flat slot is block * block_size + offset.
    """
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    if tokens == 0:
        return
    _rotary_and_write_kv_kernel[(tokens,)](
        q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), cos.stride(0), k_cache.stride(1), k_cache.stride(2), heads, kv_heads,
        HALF=dim // 2, HALF_PAD=triton.next_power_of_2(dim // 2), HEADS_PAD=triton.next_power_of_2(heads),
        KV_HEADS_PAD=triton.next_power_of_2(kv_heads), num_warps=4,
    )
