"""Greedy token choice with its log-probability: Triton on CUDA, torch elsewhere.

`LORASERVE_GREEDY_BACKEND=triton|torch` forces one (with `TRITON_INTERPRET=1` the Triton kernel
runs on the CPU). Both take the first maximum on ties, as `torch.argmax` does. They differ only on
logits no model should produce: on NaN, torch picks the NaN and the Triton kernel skips it.
"""
from __future__ import annotations

import torch

from kernels.backend import use_triton

BACKEND_ENV = "LORASERVE_GREEDY_BACKEND"


def greedy_torch(logits: torch.Tensor, num_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference (and the CPU path): a float32 copy of the vocabulary columns, then max and logsumexp."""
    raw = logits[:, :num_cols].float()
    values, token_ids = raw.max(dim=-1)
    return token_ids, values - torch.logsumexp(raw, dim=-1)


def greedy(logits: torch.Tensor, num_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of logits [B, >= num_cols] (any float dtype): the argmax over the first num_cols columns
    (int64) and its log-probability under their softmax (float32)."""
    if use_triton(BACKEND_ENV, default=logits.is_cuda):
        from kernels import greedy_triton

        return greedy_triton.greedy(logits, num_cols)
    return greedy_torch(logits, num_cols)
