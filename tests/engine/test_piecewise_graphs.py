"""Mixed steps replayed from piecewise CUDA graphs (attention eager between the pieces) against the eager forward."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, EngineConfig, LLMEngine, LoRARequest, SamplingParams
from engine.scheduler import ScheduledSequence
from engine.sequence import Sequence
from tests.tiny_models import make_peft_adapter

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def _engine(model_dir, **overrides) -> LLMEngine:
    settings = dict(enable_lora=True, max_loras=4, max_lora_rank=16) | overrides
    return LLMEngine(EngineConfig(model=str(model_dir), device="cuda", dtype="float32", block_size=4, **settings))


def _random_adapter_slots(engine: LLMEngine, seed: int) -> None:
    """Random weights in every adapter slot, so each slot's delta is its own (the slots start at zero)."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    for linear in engine.model.lora_layers().values():
        for stack in (*linear.lora_a, *linear.lora_b):
            stack.normal_(0.0, 0.05, generator=generator)


def _mixed_step(engine: LLMEngine, rng: random.Random, num_decode: int, prompts: list[tuple[int, int]]):
    """num_decode decode rows, then a prompt chunk per (context, new tokens), with blocks from the allocator;
    the scheduled sequences and an adapter slot (or -1) for each."""
    vocab, bs = engine.hf_config.vocab_size, engine.block_size
    shapes = [(rng.randint(2, 60), 1) for _ in range(num_decode)] + prompts
    scheduled = []
    for seq_id, (context, new) in enumerate(shapes):
        seq = Sequence(seq_id=seq_id, request=None, index=0, token_ids=[rng.randrange(vocab) for _ in range(context)],
                       detokenizer=None, generator=None)
        seq.num_computed_tokens = context - new
        seq.block_table = [engine.allocator.allocate() for _ in range(-(-context // bs))]
        scheduled.append(ScheduledSequence(seq, new))
    slots = [rng.randrange(-1, engine.config.max_loras) for _ in scheduled]
    return scheduled, slots


# one engine runs them in this order: from a bucket on the segment LoRA path to per-token ones and back
STEPS = [
    (30, [(200, 150), (130, 130), (9, 9)]),  # 319 tokens: many decode rows, segment (SGMV) tiles
    (8, [(40, 40)]),  # 48 tokens: decode rows and a fresh prompt, the per-token (BGMV) path
    (0, [(256, 256)]),  # a step filling its bucket
    (0, [(90, 50), (70, 70)]),  # 120 tokens: a continued chunk and a fresh prompt, no decode rows
]


def _compare_with_the_eager_forward(engine: LLMEngine, scheduled, slots) -> None:
    """The step from the pieces, then again eagerly from the same KV cache: the same hidden states, and the
    same KV written everywhere but the scratch block."""
    runner = engine.runner
    for k_cache, v_cache in runner.kv_caches:
        k_cache.normal_()
        v_cache.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    pieces = runner.execute(scheduled, slots).hidden.clone()
    written = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for (k_cache, v_cache), (k, v) in zip(runner.kv_caches, before):
        k_cache.copy_(k)
        v_cache.copy_(v)
    with torch.inference_mode():
        eager = engine.model(runner.build_step(scheduled, slots), runner.kv_caches)
    torch.testing.assert_close(pieces, eager, rtol=1e-4, atol=1e-4)
    scratch = runner.piecewise.padding_row[2] // engine.block_size
    for (k_pieces, v_pieces), (k_eager, v_eager) in zip(written, runner.kv_caches):
        torch.testing.assert_close(k_pieces[:scratch], k_eager[:scratch], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v_pieces[:scratch], v_eager[:scratch], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model, enable_lora, max_lora_rank", [
    ("tiny_llama", True, 16), ("tiny_qwen2", True, 16), ("tiny_llama", False, 16),
    ("tiny_llama", True, 64),  # the 128-token bucket in segments (`lora_tuning.path_for`)
])
def test_mixed_steps_from_the_pieces_match_the_eager_forward(model, enable_lora, max_lora_rank, request):
    engine = _engine(request.getfixturevalue(model), enable_lora=enable_lora, max_lora_rank=max_lora_rank)
    if enable_lora:
        assert engine.runner.piecewise.lora_meta[128].segments == (max_lora_rank == 64)
        _random_adapter_slots(engine, seed=3)
    rng = random.Random(model)
    for num_decode, prompts in STEPS:
        scheduled, slots = _mixed_step(engine, rng, num_decode, prompts)
        if not enable_lora:
            slots = [-1] * len(scheduled)
        assert engine.runner.piecewise.bucket(sum(item.num_new_tokens for item in scheduled)) is not None
        _compare_with_the_eager_forward(engine, scheduled, slots)


def test_requests_arriving_mid_run_get_the_tokens_of_eager_mixed_steps(tiny_llama, tmp_path_factory, monkeypatch):
    root = tmp_path_factory.mktemp("piecewise-adapters")
    loras = [LoRARequest(f"a{i}", i + 1, str(make_peft_adapter(tiny_llama, root / f"a{i}", seed=40 + i, r=8)))
             for i in range(3)]
    prompts = [f"Request {i} says" + " more" * (7 * i) for i in range(9)]

    def run(mode: str):
        llm = LLM(str(tiny_llama), device="cuda", dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16,
                  cudagraph_mode=mode, max_num_batched_tokens=64)
        calls = []
        if llm.engine.runner.piecewise is not None:
            run_pieces = llm.engine.runner.piecewise.run
            monkeypatch.setattr(llm.engine.runner.piecewise, "run", lambda *a: calls.append(1) or run_pieces(*a))
        engine, outputs = llm.engine, {}
        for i, prompt in enumerate(prompts):  # one arrival per step: prompts are admitted beside decode rows
            params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0)
            engine.add_request(prompt, params, [None, *loras][i % 4], request_id=str(i))
            outputs |= {o.request_id: o for o in engine.step()}
        while engine.has_unfinished_requests():
            outputs |= {o.request_id: o for o in engine.step()}
        assert engine.allocator.num_free == engine.allocator.num_blocks
        return [outputs[str(i)] for i in range(len(prompts))], len(calls)

    pieces, replayed = run("full_and_piecewise")
    eager, _ = run("full_decode_only")
    assert replayed >= len(prompts)
    assert [o.outputs[0].token_ids for o in pieces] == [o.outputs[0].token_ids for o in eager]
    for ours, ref in zip(pieces, eager):
        sampled, ref_sampled = ours.outputs[0], ref.outputs[0]
        assert [e[t].logprob for e, t in zip(sampled.logprobs, sampled.token_ids)] == \
            pytest.approx([e[t].logprob for e, t in zip(ref_sampled.logprobs, ref_sampled.token_ids)], abs=1e-4)
        prompt = [next(iter(e.values())).logprob for e in ours.prompt_logprobs[1:]]  # the prompt token's own
        ref_prompt = [next(iter(e.values())).logprob for e in ref.prompt_logprobs[1:]]
        assert prompt == pytest.approx(ref_prompt, abs=1e-4)


def test_full_decode_only_captures_no_pieces(tiny_llama):
    engine = _engine(tiny_llama, cudagraph_mode="full_decode_only")
    assert engine.runner.graphs is not None and engine.runner.piecewise is None
