"""The fused ops' elementwise math, shared by the per-token kernels (`fused_triton`) and the tiled LoRA variants
(`fused_lora_tiles_triton`), so that both round alike step by step (a folded delta must give what the expand
followed by the op gives)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def silu_times(gate, up):
    """silu(gate) * up, the activation rounded to gate's dtype before the product, as torch rounds it."""
    g = gate.to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def store_normed(out_ptrs, x, rstd, w, mask):
    """w * (x * rstd, rounded to x's dtype), rounded, stored."""
    normed = (x.to(tl.float32) * rstd).to(x.dtype)
    tl.store(out_ptrs, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


@triton.jit
def rotated(x1, x2, cos, sin):
    """The rotary embedding of the halves x1, x2, each rounded to their dtype."""
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    return (a * cos - b * sin).to(x1.dtype), (b * cos + a * sin).to(x1.dtype)


@triton.jit
def store_halves(base, x1, x2, mask, HALF: tl.constexpr):
    """Store two halves at `base` and `base + HALF`, converted to the pointer's dtype (a cache's; in place, the
    tensor's own)."""
    tl.store(base, x1.to(base.dtype.element_ty), mask=mask)
    tl.store(base + HALF, x2.to(base.dtype.element_ty), mask=mask)
