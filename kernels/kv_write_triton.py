"""Triton KV-cache write: one launch stores both the keys and the values of the new tokens.

The model now writes the cache in `kernels.fused.rotary_and_write_kv`; this kernel stays as the
baseline that `benchmarks/fused_ops.py` and `benchmarks/decode_attention.py` time it against. One
program copies one token's K and V rows (all KV heads) to its flat cache slot, casting to the cache
dtype on the way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_kt, stride_kh, stride_vt,
                     stride_vh, row, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < row
    head = cols // HEAD_DIM
    dim = cols % HEAD_DIM
    slot = tl.load(slots_ptr + token).to(tl.int64)
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dim, mask=mask)
    tl.store(k_cache_ptr + slot * row + cols, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * row + cols, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, kv_heads, D] (last dim contiguous) into contiguous caches [blocks, block_size, kv_heads, D]."""
    tokens, kv_heads, head_dim = k.shape
    row = kv_heads * head_dim
    if tokens == 0:
        return
    block = min(1024, triton.next_power_of_2(row))
    _write_kv_kernel[(tokens, triton.cdiv(row, block))](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1), row,
        HEAD_DIM=head_dim, BLOCK=block, num_warps=4,
    )
