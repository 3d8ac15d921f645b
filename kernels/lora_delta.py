"""A LoRA expand not yet applied, handed to the fused op that consumes the projection's output.

The consumer (RMSNorm, SiLU·up, rotary + KV write) adds `h[i] @ B_i[slot]^T` to its input as it reads
it, so the expand costs no launch of its own. The result is rounded exactly as `lora_expand_slices`
followed by the op would round it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.lora import lora_expand_slices
from kernels.lora_metadata import LoRAMetadata


@dataclass(frozen=True)
class LoRADelta:
    """y[:, off_i:off_i + N_i] += h[i] @ B_i[slot]^T, slices side by side, for a consumer to apply.

    `h` is float32 [n, T, R] as `lora_shrink_slices` returns it; `b_slices[i]` is a stacked slot tensor
    [S, N_i, R] in the model dtype (rows dense, all slices' rows equally far apart, at least R: a view of the first R
    rank columns of wider slots is taken as it is; any stride between slots); R, the rank, is that width, h's too;
    tokens whose `meta.slots` entry is -1 get no delta. `tiled`: the consumer takes its tiled variant (B read once per
    tile of same-slot tokens) on a per-token-sized step too, as the step chose (`lora_tuning.tiled_decode_ops`);
    steps on the segment path take it regardless.
    """

    h: torch.Tensor
    b_slices: tuple[torch.Tensor, ...]
    meta: LoRAMetadata
    tiled: bool = False

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(b.shape[1] for b in self.b_slices)

    @property
    def rank(self) -> int:
        return self.b_slices[0].shape[2]

    def slice(self, i: int) -> LoRADelta:
        """The delta of slice i alone."""
        return LoRADelta(self.h[i:i + 1], (self.b_slices[i],), self.meta, self.tiled)

    def apply(self, y: torch.Tensor) -> None:
        """The unfused expand: y += delta in place (the torch path, and the oracle)."""
        lora_expand_slices(y, self.h, self.b_slices, self.meta)

    def check(self, num_tokens: int, widths: tuple[int, ...]) -> None:
        """Raise unless this delta fits a consumer of `num_tokens` rows laid out in slices of `widths`."""
        if self.meta.num_tokens != num_tokens:
            raise ValueError(f"LoRA metadata was prepared for {self.meta.num_tokens} tokens, "
                             f"the input has {num_tokens}")
        if self.widths != widths:
            raise ValueError(f"LoRA slices of widths {self.widths} do not match the op's {widths}")
        if self.h.dtype != torch.float32 or tuple(self.h.shape[:2]) != (len(widths), num_tokens) \
                or self.h.shape[2] != self.rank:
            raise ValueError(f"h must be float32 [{len(widths)}, {num_tokens}, {self.rank}], "
                             f"got {self.h.dtype} {list(self.h.shape)}")
