"""Public multi-LoRA entry points: Triton on CUDA, the torch reference elsewhere.

`LORASERVE_LORA_BACKEND=triton|torch` forces one backend (with `TRITON_INTERPRET=1` the
Triton kernels run on the CPU). The Triton module is imported on first use, so `kernels`
imports without CUDA.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kernels import lora_torch
from kernels.backend import use_triton
from kernels.lora_metadata import LoRAMetadata, prepare_lora_metadata

BACKEND_ENV = "LORASERVE_LORA_BACKEND"


def _backend(x: torch.Tensor):
    if use_triton(BACKEND_ENV, default=x.is_cuda):
        from kernels import lora_triton

        return lora_triton
    return lora_torch


def _metadata(slots_or_meta: torch.Tensor | LoRAMetadata, num_slots: int) -> LoRAMetadata:
    if isinstance(slots_or_meta, LoRAMetadata):
        return slots_or_meta
    return prepare_lora_metadata(slots_or_meta, num_slots)


def lora_shrink_slices(
    x: torch.Tensor,
    a_slices: Sequence[torch.Tensor],
    slots_or_meta: torch.Tensor | LoRAMetadata,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """h[i] = x @ A_i[slot]^T for every slice, in one launch reading x once: float32 [n, T, R], base rows zero.

    Each `a_slices[i]` is a stacked slot tensor [S, R, K] in x's dtype.
    """
    meta = _metadata(slots_or_meta, a_slices[0].shape[0])
    return _backend(x).shrink_slices(x, a_slices, meta, out)


def lora_expand_slices(
    y: torch.Tensor,
    h: torch.Tensor,
    b_slices: Sequence[torch.Tensor],
    slots_or_meta: torch.Tensor | LoRAMetadata,
) -> None:
    """y[:, off_i:off_i + N_i] += h[i] @ B_i[slot]^T in place, slices side by side in y; base rows untouched.

    Each `b_slices[i]` is a stacked slot tensor [S, N_i, R] in y's dtype, scaling folded in.
    """
    meta = _metadata(slots_or_meta, b_slices[0].shape[0])
    _backend(y).expand_slices(y, h, b_slices, meta)


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, slots_or_meta: torch.Tensor | LoRAMetadata, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """h = x @ A[slot]^T, float32 [T, R]; rows of base-model tokens (slot -1) are zero."""
    return lora_shrink_slices(x, (a,), slots_or_meta, out=None if out is None else out.unsqueeze(0))[0]


def lora_expand(
    y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, slots_or_meta: torch.Tensor | LoRAMetadata
) -> None:
    """y += h @ B[slot]^T in place; rows of base-model tokens (slot -1) are untouched."""
    lora_expand_slices(y, h.unsqueeze(0), (b,), slots_or_meta)
