"""Fused per-token ops of a decoder layer: RMSNorm with the residual add, SiLU·up, rotary + KV-cache write.

CUDA tensors take the Triton kernels (one launch per op instead of a chain of small elementwise
kernels: 7-15x faster at decode shapes on the H200, see BENCHMARKS.md); other tensors take the torch
reference. `LORASERVE_FUSED_BACKEND=triton|torch` forces one (with `TRITON_INTERPRET=1` the Triton
kernels run on the CPU, which is how CI checks them).

Each op takes an optional `lora` (`LoRADelta`): the LoRA expand of the projection whose output it
consumes. The op then computes as if `lora_expand_slices` had run on its input first, with the same
rounding, and the Triton kernel adds the delta as it reads its input: one launch fewer per projection.
"""
from __future__ import annotations

import torch

from kernels import fused_torch
from kernels.backend import use_triton
from kernels.lora_delta import LoRADelta

BACKEND_ENV = "LORASERVE_FUSED_BACKEND"


def _backend(x: torch.Tensor):
    if use_triton(BACKEND_ENV, default=x.is_cuda):
        from kernels import fused_triton

        return fused_triton
    return fused_torch


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 lora: LoRADelta | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual) for x [T, N]; without a residual, x is the residual.

    With `lora` (one slice of width N), x + delta stands for x; x itself is not modified.
    """
    if lora is not None:
        lora.check(x.shape[0], (x.shape[1],))
    return _backend(x).add_rms_norm(x, residual, weight, eps, lora)


def silu_and_mul(gate_up: torch.Tensor, lora: LoRADelta | None = None) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2N] = [gate | up].

    With `lora` (slices gate and up, N each), gate_up + delta stands for gate_up, which is not modified.
    """
    if lora is not None:
        half = gate_up.shape[1] // 2
        lora.check(gate_up.shape[0], (half, half))
    return _backend(gate_up).silu_and_mul(gate_up, lora)


def rotary_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, lora: LoRADelta | None = None) -> None:
    """Rotate q [T, H, D] and k [T, KVH, D] in place, then store the rotated k and v [T, KVH, D] in the caches.

    cos/sin are tables [P, D] with equal halves, indexed by `positions` [T]; the caches are
    [blocks, block_size, KVH, D] and `slot_mapping` [T] holds each token's flat slot
    (block * block_size + offset). On the Triton path this is one launch where rotary(q),
    rotary(k) and the KV write were three.

    With `lora` (slices q [H*D], k [KVH*D], v [KVH*D]), q, k and v first get their deltas in place: q and
    k end rotated after their delta, v holds v + delta, and the caches receive both.
    """
    if lora is not None:
        lora.check(q.shape[0], (q.shape[1] * q.shape[2], k.shape[1] * k.shape[2], v.shape[1] * v.shape[2]))
    _backend(q).rotary_and_write_kv(q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping, lora)
