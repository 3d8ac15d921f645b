"""Torch reference for the fused per-token ops of a decoder layer (the CPU path and the oracle); a LoRA
delta is applied by the unfused expand, then the op runs."""
from __future__ import annotations

import torch

from kernels.attention import write_kv_torch
from kernels.lora_delta import LoRADelta


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 lora: LoRADelta | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual); without a residual, x is the residual.

    With `lora`, x + delta (on a copy) stands for x.
    """
    if lora is not None:
        x = x.clone()
        lora.apply(x)
    hidden = x if residual is None else x + residual
    h = hidden.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), hidden


def silu_and_mul(gate_up: torch.Tensor, lora: LoRADelta | None = None) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension; with `lora`, of gate_up + delta
    (on a copy)."""
    if lora is not None:
        gate_up = gate_up.clone()
        lora.apply(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, KVH, D] by the positions' angles (cos/sin tables [P, D], halves equal)."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    return _rotate(q, c, s), _rotate(k, c, s)


def rotary_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, lora: LoRADelta | None = None) -> None:
    """`rotary` written back into q and k, then `write_kv_torch` of the rotated k and of v.

    With `lora` (slices q, k, v), each of q, k and v first gets its delta in place.
    """
    if lora is not None:
        for i, t in enumerate((q, k, v)):
            lora.slice(i).apply(t.view(t.shape[0], -1))
    rotated_q, rotated_k = rotary(q, k, cos, sin, positions)
    q.copy_(rotated_q)
    k.copy_(rotated_k)
    write_kv_torch(k_cache, v_cache, k, v, slot_mapping)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
