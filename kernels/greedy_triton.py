"""Greedy choice in one Triton pass over each row of logits: argmax and its log-probability.

The torch chain it replaces (upcast, max, logsumexp, subtract) reads and writes the float32
logits several times, about 0.3 ms per decode step at Llama-3's 128k vocabulary and batch 64 on
an H200. Here one program per row streams the row once in its own dtype, keeping a running
maximum, its first index and the sum of exponentials rescaled to that maximum (the online
softmax of flash attention).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _finite_or_zero(best):
    """The shift for exp(x - best): 0 while every value so far is -inf (-inf - -inf would be NaN)."""
    return tl.where(best == -float("inf"), 0.0, best)


@triton.jit
def _greedy_kernel(logits_ptr, stride_row, num_cols, token_ptr, logprob_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK)
    x = tl.load(base + offs, mask=offs < num_cols, other=-float("inf")).to(tl.float32)
    best = tl.max(x, 0)
    index = tl.argmax(x, 0)
    total = tl.sum(tl.exp(x - _finite_or_zero(best)), 0)
    for start in range(BLOCK, num_cols, BLOCK):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < num_cols, other=-float("inf")).to(tl.float32)
        block_best = tl.max(x, 0)
        new_best = tl.maximum(best, block_best)
        shift = _finite_or_zero(new_best)
        total = total * tl.exp(_finite_or_zero(best) - shift) + tl.sum(tl.exp(x - shift), 0)
        index = tl.where(block_best > best, start + tl.argmax(x, 0), index)  # ties keep the earlier index
        best = new_best
    tl.store(token_ptr + row, index.to(tl.int64))
    tl.store(logprob_ptr + row, best - _finite_or_zero(best) - tl.log(total))  # best - logsumexp(row)


def greedy(logits: torch.Tensor, num_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids int64 [B], their float32 log-probabilities [B]) over the first num_cols columns."""
    rows = logits.shape[0]
    if num_cols > logits.shape[1]:
        raise ValueError(f"num_cols {num_cols} is more than the logits' {logits.shape[1]} columns")
    token_ids = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return token_ids, logprobs
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    _greedy_kernel[(rows,)](logits, logits.stride(0), num_cols, token_ids, logprobs, BLOCK=BLOCK,
                            num_warps=NUM_WARPS)
    return token_ids, logprobs
