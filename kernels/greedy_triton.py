"""Greedy choice in Triton over each row of logits: argmax and its log-probability.

The torch chain it replaces (upcast, max, logsumexp, subtract) reads and writes the float32
logits several times, about 0.3 ms per decode step at Llama-3's 128k vocabulary and batch 64 on
an H200. Here the logits are read once, in their own dtype, keeping a running maximum, its first
index and the sum of exponentials rescaled to that maximum (the online softmax of flash attention).

With one program per row, a few rows leave most multiprocessors idle while each program walks
its row block by block, so each row's columns are split over several programs: each writes its
partial (max, first index of max, sum of exp relative to its max) in float32/int64, and a second
small launch combines a row's partials (ties go to the lower index, sums are rescaled to the row's
maximum). The split count comes from static shapes only (no host syncs, so a CUDA graph can
capture it); with one split a single launch writes the results directly.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device import multiprocessor_count
from kernels.pdl_triton import pdl_launch, wait_for_predecessor

BLOCK = 4096
NUM_WARPS = 8
# Split until about this many programs per multiprocessor. H200, 128256 bf16 columns
# (`benchmarks/greedy_kernel.py`): 16 or 32 splits are fastest at 1-256 rows (64 rows: 38.5 us unsplit,
# 14.2 at 9 splits, 11.7 at 16; 128 rows: 24.0 at 5, 20.2 at 16), which 16 programs per SM give.
PROGRAMS_PER_SM = 16
# Each split covers at least this many columns when the count is chosen automatically.
SPLIT_MIN_COLS = BLOCK
# Splits start on multiples of this many columns, so their loads stay aligned.
SPLIT_ALIGN = 64
MAX_SPLITS = 64


@triton.jit
def _finite_or_zero(best):
    """The shift for exp(x - best): 0 while every value so far is -inf (-inf - -inf would be NaN)."""
    return tl.where(best == -float("inf"), 0.0, best)


@triton.jit
def _scan(base, start, end, BLOCK: tl.constexpr):
    """(max, first index of the max, sum of exp(x - max)) over base[start:end], streamed in blocks.

    All -inf gives (-inf, start, 0)."""
    offs = tl.arange(0, BLOCK)
    cols = start + offs
    x = tl.load(base + cols, mask=cols < end, other=-float("inf")).to(tl.float32)
    best = tl.max(x, 0)
    index = start + tl.argmax(x, 0)
    total = tl.sum(tl.exp(x - _finite_or_zero(best)), 0)
    for block_start in range(start + BLOCK, end, BLOCK):
        cols = block_start + offs
        x = tl.load(base + cols, mask=cols < end, other=-float("inf")).to(tl.float32)
        block_best = tl.max(x, 0)
        new_best = tl.maximum(best, block_best)
        shift = _finite_or_zero(new_best)
        total = total * tl.exp(_finite_or_zero(best) - shift) + tl.sum(tl.exp(x - shift), 0)
        index = tl.where(block_best > best, block_start + tl.argmax(x, 0), index)  # ties keep the earlier index
        best = new_best
    return best, index, total


@triton.jit
def _greedy_kernel(logits_ptr, stride_row, num_cols, token_ptr, logprob_ptr, BLOCK: tl.constexpr,
                   USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    wait_for_predecessor(USE_PDL)
    best, index, total = _scan(logits_ptr + row * stride_row, 0, num_cols, BLOCK)
    tl.store(token_ptr + row, index.to(tl.int64))
    tl.store(logprob_ptr + row, best - _finite_or_zero(best) - tl.log(total))  # best - logsumexp(row)


@triton.jit
def _greedy_split_kernel(logits_ptr, stride_row, num_cols, split_cols, best_ptr, index_ptr, total_ptr,
                         BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start = split * split_cols
    wait_for_predecessor(USE_PDL)
    best, index, total = _scan(logits_ptr + row * stride_row, start, tl.minimum(start + split_cols, num_cols), BLOCK)
    part = row * tl.num_programs(1) + split
    tl.store(best_ptr + part, best)
    tl.store(index_ptr + part, index.to(tl.int64))
    tl.store(total_ptr + part, total)


# The split count follows the batch size; specializing on it would compile a variant per value class.
@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(best_ptr, index_ptr, total_ptr, num_splits, num_cols, token_ptr, logprob_ptr,
                    SPLITS: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, SPLITS)
    used = lanes < num_splits
    parts = row * num_splits + lanes
    wait_for_predecessor(USE_PDL)
    best = tl.load(best_ptr + parts, mask=used, other=-float("inf"))
    index = tl.load(index_ptr + parts, mask=used, other=0)
    total = tl.load(total_ptr + parts, mask=used, other=0.0)
    row_best = tl.max(best, 0)
    # splits cover the columns in order and each holds its first maximum: the lowest tied index is the row's first
    token = tl.min(tl.where(used & (best == row_best), index, num_cols), 0)
    shift = _finite_or_zero(row_best)
    row_total = tl.sum(total * tl.exp(best - shift), 0)  # an all -inf split adds 0 * 0
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, row_best - shift - tl.log(row_total))


def split_layout(num_cols: int, splits: int) -> tuple[int, int]:
    """(columns per split, splits used) when num_cols are asked to be split `splits` ways: each split
    starts on a multiple of SPLIT_ALIGN, so fewer may be needed (never an empty one)."""
    split_cols = triton.cdiv(triton.cdiv(num_cols, splits), SPLIT_ALIGN) * SPLIT_ALIGN
    return split_cols, triton.cdiv(num_cols, split_cols)


def default_splits(rows: int, num_cols: int, multiprocessors: int) -> int:
    """Splits that give every multiprocessor about PROGRAMS_PER_SM programs, each split at least
    SPLIT_MIN_COLS wide; 1 off CUDA (one multiprocessor)."""
    if multiprocessors <= 1:
        return 1
    wanted = triton.cdiv(PROGRAMS_PER_SM * multiprocessors, rows)
    return max(1, min(wanted, triton.cdiv(num_cols, SPLIT_MIN_COLS), MAX_SPLITS))


def greedy(logits: torch.Tensor, num_cols: int, splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids int64 [B], their float32 log-probabilities [B]) over the first num_cols columns.

    `splits` forces how many programs share a row (benchmarks and tests); None picks it from the
    shapes and the device's multiprocessor count."""
    rows = logits.shape[0]
    if num_cols < 1:
        raise ValueError(f"num_cols must be at least 1, got {num_cols}")
    if num_cols > logits.shape[1]:
        raise ValueError(f"num_cols {num_cols} is more than the logits' {logits.shape[1]} columns")
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int)
                               or not 1 <= splits <= MAX_SPLITS):
        raise ValueError(f"splits must be an int in [1, {MAX_SPLITS}], got {splits!r}")
    token_ids = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return token_ids, logprobs
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if splits is None:
        splits = default_splits(rows, num_cols, multiprocessor_count(logits.device))
    split_cols, splits = split_layout(num_cols, splits)
    pdl = pdl_launch(logits.device)
    if splits == 1:
        _greedy_kernel[(rows,)](logits, logits.stride(0), num_cols, token_ids, logprobs, BLOCK=BLOCK,
                                num_warps=NUM_WARPS, **pdl)
        return token_ids, logprobs
    best = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows, splits, dtype=torch.long, device=logits.device)
    total = torch.empty_like(best)
    _greedy_split_kernel[(rows, splits)](logits, logits.stride(0), num_cols, split_cols, best, index, total,
                                         BLOCK=BLOCK, num_warps=NUM_WARPS, **pdl)
    _combine_kernel[(rows,)](best, index, total, splits, num_cols, token_ids, logprobs, SPLITS=MAX_SPLITS,
                             num_warps=1, **pdl)
    return token_ids, logprobs
