"""Fused per-token ops of a decoder layer: RMSNorm with the residual add, SiLU·up, rotary embedding.

The torch reference runs by default everywhere. `LORASERVE_FUSED_BACKEND=triton` selects the Triton
kernels (one launch per op instead of a chain of small elementwise kernels; under
`TRITON_INTERPRET=1` they run on the CPU, which is how CI checks them).
"""
from __future__ import annotations

import torch

from kernels import fused_torch
from kernels.backend import use_triton

BACKEND_ENV = "LORASERVE_FUSED_BACKEND"


def _backend():
    if use_triton(BACKEND_ENV, default=False):
        from kernels import fused_triton

        return fused_triton
    return fused_torch


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual) for x [T, N]; without a residual, x is the residual."""
    return _backend().add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2N] = [gate | up]."""
    return _backend().silu_and_mul(gate_up)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, KVH, D] (cos/sin tables [P, D] with equal halves)."""
    return _backend().rotary(q, k, cos, sin, positions)
