"""Eager warm-up steps at engine start (run on CUDA; checked here on the CPU): dummy sequences touch the
scratch block and nothing a real sequence could own."""
from __future__ import annotations

import pytest
import torch

from engine.warmup import warm_up_decode_attention, warm_up_eager_steps, warm_up_greedy
from tests.engine.conftest import make_engine


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("max_model_len, budget", [(96, 300), (2, 8)], ids=["long-steps", "two-token-window"])
def test_warm_up_writes_only_the_scratch_block(tiny_llama, lora, max_model_len, budget):
    engine = make_engine(tiny_llama, num_kv_blocks=8, max_model_len=max_model_len, max_num_batched_tokens=budget,
                         enable_lora=lora)
    scratch = engine.allocator.num_blocks
    before = [(k.clone(), v.clone()) for k, v in engine.runner.kv_caches]
    warm_up_eager_steps(engine.runner, max_num_batched_tokens=budget, max_model_len=max_model_len,
                        scratch_block=scratch, lora_slot=0 if lora else None)
    for (k, v), (k0, v0) in zip(engine.runner.kv_caches, before):
        assert torch.equal(k[:scratch], k0[:scratch]) and torch.equal(v[:scratch], v0[:scratch])
        assert not torch.equal(k[scratch], k0[scratch])
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_greedy_warm_up_chooses_over_one_row_and_the_largest_batch_shaped_and_typed_as_the_lm_heads(
        tiny_llama, monkeypatch):
    engine = make_engine(tiny_llama)
    seen = []
    monkeypatch.setattr("engine.sampler.greedy", lambda logits, num_cols: seen.append(
        (tuple(logits.shape), logits.dtype, num_cols)) or (torch.zeros(1, dtype=torch.long), torch.zeros(1)))
    warm_up_greedy(engine.sampler, torch.bfloat16, torch.device("cpu"), max_rows=8)
    vocab = engine.sampler.vocab_size
    assert seen == [((1, vocab), torch.bfloat16, vocab), ((8, vocab), torch.bfloat16, vocab)]


def test_decode_attention_warm_up_launches_every_row_count_narrow_and_wide(tiny_llama, monkeypatch):
    engine = make_engine(tiny_llama, num_kv_blocks=8, max_model_len=96)
    scratch = engine.allocator.num_blocks
    launches = []
    monkeypatch.setattr("engine.warmup.decode_attention", lambda q, k, v, tables, lens, scale: launches.append(
        (q.shape[0], tables.shape[1], set(tables.flatten().tolist()), lens.tolist())))
    warm_up_decode_attention(engine.runner, max_num_seqs=12, max_model_len=96, scratch_block=scratch)
    wide = 96 // engine.runner.block_size
    assert [(rows, width) for rows, width, _, _ in launches] == [
        (rows, width) for rows in range(1, 13) for width in (1, wide)]
    assert all(blocks == {scratch} and lens == [1] * rows for rows, _, blocks, lens in launches)


def test_decode_attention_warm_up_leaves_the_kv_cache_as_it_was(tiny_llama):
    engine = make_engine(tiny_llama, num_kv_blocks=8, max_model_len=96)
    before = [(k.clone(), v.clone()) for k, v in engine.runner.kv_caches]
    warm_up_decode_attention(engine.runner, max_num_seqs=4, max_model_len=96, scratch_block=engine.allocator.num_blocks)
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(engine.runner.kv_caches, before))
