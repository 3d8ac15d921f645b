"""Kernel launches at engine start, so Triton compiles there and not in the first requests.

CUDA-graph capture compiles the decode kernels and, with piecewise graphs, the kernels of mixed steps
up to the largest bucket, between their attentions. The rest runs eagerly (attention always; mixed steps
past that bucket or without piecewise graphs) and compiles on first use: the LoRA kernels per tile class
(up to 128 tokens go per token, fewer than 512 in 16-row tiles, more in 64-row tiles), the prefill
attention, the decode attention of a mixed step's decode rows (a variant per batch class and split: every
row count is launched), and the greedy choice after the LM head. Each takes a second or more on an H200,
which the first requests of a fresh server would wait for. Mixed steps of dummy sequences cover the LoRA
kernels and the prefill attention; the decode attention and the greedy choice are launched directly. Of the
KV cache they use only the scratch block (the one CUDA-graph padding rows write to), so no block a sequence
owns is touched.
"""
from __future__ import annotations

import torch

from kernels.attention import decode_attention

from .model_runner import ModelRunner
from .sampler import Sampler
from .scheduler import ScheduledSequence
from .sequence import Sequence

# prefill tokens of a step in the per-token and 16-row tile classes (the third step fills the token budget)
_SMALL_PREFILLS = (16, 200)


def _dummy(context: int, new_tokens: int, scratch_block: int, block_size: int) -> ScheduledSequence:
    seq = Sequence(seq_id=-1, request=None, index=0, token_ids=[0] * context, detokenizer=None, generator=None)
    seq.num_computed_tokens = context - new_tokens
    seq.block_table = [scratch_block] * -(-context // block_size)
    return ScheduledSequence(seq, new_tokens)


def warm_up_eager_steps(runner: ModelRunner, *, max_num_batched_tokens: int, max_model_len: int,
                        scratch_block: int, lora_slot: int | None) -> None:
    """Run one mixed step per tile class: a decode row, a continued prompt (earlier context) and fresh
    prompts up to the size. lora_slot: a slot for half of the sequences (the others use none), or None."""
    bs = runner.block_size
    longest = max(1, max_model_len - 1)  # a prompt's tokens, leaving a position for the decode row's context
    prefill_budget = max(max_num_batched_tokens - 1, 1)  # a step holds the decode row too
    for size in sorted({min(size, prefill_budget) for size in (*_SMALL_PREFILLS, prefill_budget)}):
        scheduled = [_dummy(min(2, max_model_len), 1, scratch_block, bs)]
        continued = min(size // 2, longest // 2)
        if continued:
            scheduled.append(_dummy(2 * continued, continued, scratch_block, bs))
        left = size - continued
        while left > 0:
            fresh = min(left, longest)
            scheduled.append(_dummy(fresh, fresh, scratch_block, bs))
            left -= fresh
        slots = [lora_slot if lora_slot is not None and i % 2 else -1 for i in range(len(scheduled))]
        runner.execute(scheduled, slots)


def warm_up_decode_attention(runner: ModelRunner, *, max_num_seqs: int, max_model_len: int,
                             scratch_block: int) -> None:
    """Decode attention over the scratch block for every row count up to max_num_seqs, with a one-block table
    and one as wide as max_model_len: a mixed step's decode rows launch with their batch's tuning class and,
    past a few blocks, split the context as far as their count says, and each such variant compiles on first
    use. Powers of two alone missed counts just past one: at 8 KV heads, 33 rows take the 64-row class split in
    two, 65 and 66 the 128-row class split in two (a 753 ms step of workload (d) on the H200, its decode kernel
    compiled with the 2 warps of those classes, and the combine launch). Once compiled, a launch costs tens of
    microseconds."""
    attn = runner.model.layers[0].self_attn
    k_cache, v_cache = runner.kv_caches[0]
    widths = sorted({1, -(-max_model_len // runner.block_size)})
    for rows in range(1, max_num_seqs + 1):
        q = torch.zeros(rows, attn.num_heads, attn.head_dim, dtype=k_cache.dtype, device=k_cache.device)
        lens = torch.ones(rows, dtype=torch.long, device=k_cache.device)
        for width in widths:
            tables = torch.full((rows, width), scratch_block, dtype=torch.long, device=k_cache.device)
            decode_attention(q, k_cache, v_cache, tables, lens, attn.scale)


def warm_up_greedy(sampler: Sampler, dtype: torch.dtype, device: torch.device, max_rows: int) -> None:
    """Greedy choices over one row and over max_rows rows of logits shaped and typed as the LM head's: the
    kernel splits few rows' columns over many programs and runs many rows in one pass, two compiles."""
    for rows in sorted({1, max_rows}):
        sampler.greedy(torch.zeros(rows, sampler.vocab_size, dtype=dtype, device=device))
