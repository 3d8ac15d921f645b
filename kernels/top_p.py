"""Top-p (nucleus) filtering of probability rows, in place: Triton on CUDA, torch elsewhere.

A row keeps every token whose probability is at least its nucleus threshold: the smallest probability t for
which the tokens more likely than t hold less than top_p. So a token stays when the tokens more likely than it
are still below top_p, the most likely token always stays, and ties with the last token of the nucleus stay
with it (as `top_k` keeps ties with the k-th). `LORASERVE_TOP_P_BACKEND=triton|torch` forces one
implementation (with `TRITON_INTERPRET=1` the Triton kernel runs on the CPU). The two sum probabilities in a
different order, so a token whose mass above lies within float32 rounding of top_p may fall on either side (with
top_p within rounding of the row's whole mass, a tail of tokens holding less than 1e-7 together may).
"""
from __future__ import annotations

import torch

from kernels.backend import use_triton

BACKEND_ENV = "LORASERVE_TOP_P_BACKEND"
# The nucleus is looked for among this many most likely tokens before a row's full vocabulary is sorted.
CANDIDATES = 256


def top_p_torch(probs: torch.Tensor, rows: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The reference (and the CPU path). A full sort is slow on the CPU, so each row's nucleus is looked for
    among its most likely candidates first, and only the rows where it is not there are sorted whole (which
    reads a count back: a host sync)."""
    sub = probs.index_select(0, rows)
    candidates = sub.topk(min(CANDIDATES, sub.shape[-1]), dim=-1).values
    threshold = _threshold(candidates, top_p)
    outside = (candidates.sum(dim=-1) < top_p).nonzero().flatten()
    if len(outside):
        threshold[outside] = _threshold(sub[outside].sort(dim=-1, descending=True).values, top_p[outside])
    return probs.index_copy_(0, rows, sub.masked_fill(sub < threshold[:, None], 0.0))


def _threshold(ordered: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's smallest probability whose predecessors, sorted descending, sum to less than top_p."""
    above = ordered.cumsum(dim=-1) - ordered
    return ordered.masked_fill(above >= top_p[:, None], float("inf")).amin(dim=-1)


def top_p_(probs: torch.Tensor, rows: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zeroes, in place, the tokens outside the nucleus of each listed row of probs [B, V] (float32; rows int64
    [R], each row listed once; top_p float32 [R] in (0, 1): a row with top_p 1 keeps everything, so it is not
    listed) and returns probs. The Triton kernel reads nothing back to the host, so a step filtering with it can
    stay in flight."""
    if use_triton(BACKEND_ENV, default=probs.is_cuda):
        from kernels import top_p_triton

        return top_p_triton.top_p_(probs, rows, top_p)
    return top_p_torch(probs, rows, top_p)
