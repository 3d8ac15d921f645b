"""Torch reference for the LoRA kernels: the CPU path, and the oracle the Triton kernels are checked against.

Loops over the distinct active slots (one gather, one matmul, one scatter each), never over tokens.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from kernels.lora_metadata import LoRAMetadata


def _groups(meta: LoRAMetadata) -> Iterator[tuple[int, torch.Tensor]]:
    """(slot, token indices) for every slot that has tokens this step."""
    order = meta.token_order[: meta.num_tokens].long()
    counts = meta.group_counts[: meta.num_slots].tolist()
    start = 0
    for slot, count in enumerate(counts):
        if count:
            yield slot, order[start : start + count]
        start += count


def shrink_slices(
    x: torch.Tensor, a_slices: Sequence[torch.Tensor], meta: LoRAMetadata, out: torch.Tensor | None = None
) -> torch.Tensor:
    """h[i] = x @ A_i[slot]^T for each slice i, float32 [n, T, R]; base rows are zero."""
    num_tokens, rank = x.shape[0], a_slices[0].shape[1]
    if out is None:
        out = torch.empty(len(a_slices), num_tokens, rank, dtype=torch.float32, device=x.device)
    out.zero_()
    for slot, rows in _groups(meta):
        xs = x.index_select(0, rows).float()
        for i, a in enumerate(a_slices):
            out[i].index_copy_(0, rows, xs @ a[slot].float().T)
    return out


def expand_slices(y: torch.Tensor, h: torch.Tensor, b_slices: Sequence[torch.Tensor], meta: LoRAMetadata) -> None:
    """y[:, off_i:off_i + N_i] += h[i] @ B_i[slot]^T in place for each slice i; base rows untouched."""
    for slot, rows in _groups(meta):
        ys = y.index_select(0, rows).float()
        col = 0
        for i, b in enumerate(b_slices):
            width = b.shape[1]
            # h rounded to B's dtype, as peft's lora_B receives lora_A's output
            ys[:, col : col + width] += h[i].index_select(0, rows).to(b.dtype).float() @ b[slot].float().T
            col += width
        y.index_copy_(0, rows, ys.to(y.dtype))
