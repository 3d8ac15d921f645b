"""Fused per-token ops of a decoder layer: RMSNorm with the residual add, SiLU·up, rotary embedding.

CUDA tensors take the Triton kernels (one launch per op instead of a chain of small elementwise
kernels: 7-15x faster at decode shapes on the H200, see BENCHMARKS.md); other tensors take the torch
reference. `LORASERVE_FUSED_BACKEND=triton|torch` forces one (with `TRITON_INTERPRET=1` the Triton
kernels run on the CPU, which is how CI checks them).
"""
from __future__ import annotations

import torch

from kernels import fused_torch
from kernels.backend import use_triton

BACKEND_ENV = "LORASERVE_FUSED_BACKEND"


def _backend(x: torch.Tensor):
    if use_triton(BACKEND_ENV, default=x.is_cuda):
        from kernels import fused_triton

        return fused_triton
    return fused_torch


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual) for x [T, N]; without a residual, x is the residual."""
    return _backend(x).add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2N] = [gate | up]."""
    return _backend(gate_up).silu_and_mul(gate_up)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, KVH, D] (cos/sin tables [P, D] with equal halves)."""
    return _backend(q).rotary(q, k, cos, sin, positions)
