"""Continuous batching: batched, preempted and aborted requests give the tokens a lone run gives."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.conftest import make_engine, run_to_completion

PROMPTS = [
    "Hello",
    "The capital of France is Paris. The capital of Italy is",
    "def add(a, b):",
    "SELECT name FROM users WHERE age > 30; SELECT",
    "Ahoy matey",
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _alone(engine, prompt, params=GREEDY):
    engine.add_request(prompt, params)
    (output,) = run_to_completion(engine).values()
    return output.outputs[0].token_ids


def test_batched_greedy_equals_one_at_a_time(llama_engine):
    alone = [_alone(llama_engine, p) for p in PROMPTS]
    ids = [llama_engine.add_request(p, GREEDY) for p in PROMPTS]
    batched = run_to_completion(llama_engine)
    assert [batched[i].outputs[0].token_ids for i in ids] == alone


def test_greedy_equals_transformers_generate(llama_engine, hf_llama):
    tokenizer = llama_engine.tokenizer
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            ref = hf_llama.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert _alone(llama_engine, prompt) == ref[0, ids.shape[1]:].tolist()


def test_greedy_results_do_not_depend_on_whether_the_batch_takes_the_samplers_fast_path(llama_engine):
    """All-greedy batches skip the sampler's per-row work; a row asking for logprobs sends the same
    batch through the general path, and the other row's tokens and logprobs must not move."""
    def run(second):
        ids = [llama_engine.add_request(PROMPTS[1], GREEDY), llama_engine.add_request(PROMPTS[2], second)]
        outputs = run_to_completion(llama_engine)
        return [(outputs[i].outputs[0].token_ids, outputs[i].outputs[0].cumulative_logprob) for i in ids]

    fast = run(GREEDY)
    general = run(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1))
    assert general[0] == fast[0]
    assert general[1][0] == fast[1][0]  # (its logprobs come from log_softmax, equal to about 1e-7)


def test_requests_join_a_running_batch(llama_engine):
    first = llama_engine.add_request(PROMPTS[0], GREEDY)
    llama_engine.step()
    llama_engine.step()
    second = llama_engine.add_request(PROMPTS[1], GREEDY)
    plan_sizes = []
    outputs = {}
    while llama_engine.has_unfinished_requests():
        plan_sizes.append(len(llama_engine.scheduler.running))
        outputs.update({o.request_id: o for o in llama_engine.step() if o.finished})
    assert max(plan_sizes) == 2
    assert outputs[first].outputs[0].token_ids == _alone(llama_engine, PROMPTS[0])
    assert outputs[second].outputs[0].token_ids == _alone(llama_engine, PROMPTS[1])


def test_chunked_prefill_gives_the_same_tokens(tiny_llama, llama_engine):
    chunked = make_engine(tiny_llama, max_num_batched_tokens=5)
    assert [_alone(chunked, p) for p in PROMPTS] == [_alone(llama_engine, p) for p in PROMPTS]


def test_preemption_recomputes_and_finishes_with_the_same_tokens(tiny_llama, llama_engine):
    expected = [_alone(llama_engine, p) for p in PROMPTS]
    small = make_engine(tiny_llama, block_size=4, num_kv_blocks=12)
    ids = [small.add_request(p, GREEDY) for p in PROMPTS]
    finished = run_to_completion(small)
    assert small.scheduler.num_preemptions > 0
    assert [finished[i].outputs[0].token_ids for i in ids] == expected
    assert small.allocator.num_used == 0


def test_abort_frees_every_block(llama_engine):
    ids = [llama_engine.add_request(p, GREEDY) for p in PROMPTS]
    llama_engine.step()
    llama_engine.step()
    assert llama_engine.allocator.num_used > 0
    for request_id in ids:
        output = llama_engine.abort(request_id)
        assert output.finished and output.outputs[0].finish_reason == "abort"
    assert llama_engine.allocator.num_used == 0
    assert not llama_engine.has_unfinished_requests()
    assert not llama_engine.scheduler.running and not llama_engine.scheduler.waiting


def test_seeded_sampling_is_the_same_whatever_the_batch(llama_engine):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = _alone(llama_engine, PROMPTS[2], seeded)
    noisy = SamplingParams(temperature=1.2, max_tokens=16, ignore_eos=True)
    others = [llama_engine.add_request(p, noisy) for p in PROMPTS[:2]]
    target = llama_engine.add_request(PROMPTS[2], seeded)
    others.append(llama_engine.add_request(PROMPTS[3], SamplingParams(temperature=0.7, seed=7, max_tokens=5)))
    finished = run_to_completion(llama_engine)
    assert finished[target].outputs[0].token_ids == alone


def test_prompt_and_max_tokens_past_the_context_window_is_refused(tiny_llama):
    engine = make_engine(tiny_llama, max_model_len=32)
    prompt = list(range(10, 30))
    try:
        engine.add_request(prompt, SamplingParams(max_tokens=20))
    except ValueError as exc:
        assert "maximum context length is 32" in str(exc)
    else:
        raise AssertionError("expected ValueError")
    assert not engine.has_unfinished_requests()


def test_llm_generate_returns_outputs_in_prompt_order(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu")
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    assert [o.outputs[0].token_ids for o in outputs] == [_alone(llm.engine, p) for p in PROMPTS]


def test_a_step_that_schedules_nothing_still_delivers_pending_text(llama_engine, monkeypatch):
    from engine.scheduler import SchedulerOutput

    request_id = llama_engine.add_request(PROMPTS[1], GREEDY)
    llama_engine.step()
    llama_engine.step()
    original = llama_engine.scheduler.schedule
    monkeypatch.setattr(llama_engine.scheduler, "schedule", lambda: SchedulerOutput())
    (output,) = llama_engine.step()
    assert output.request_id == request_id and len(output.outputs[0].token_ids) == 2
    monkeypatch.setattr(llama_engine.scheduler, "schedule", original)
    final = run_to_completion(llama_engine)[request_id]
    assert final.outputs[0].token_ids == _alone(llama_engine, PROMPTS[1])


def test_prompt_logprobs_are_the_same_when_the_prefill_is_preempted(tiny_llama):
    """A request preempted in the middle of its chunked prefill recomputes it; its prompt logprobs are recorded once."""
    prompt = list(range(5, 45))

    def prompt_logprobs(num_kv_blocks: int):
        engine = make_engine(tiny_llama, block_size=4, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=8)
        engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        target = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))
        output = run_to_completion(engine)[target]
        return output.prompt_logprobs, engine.scheduler.num_preemptions

    expected, _ = prompt_logprobs(200)
    got, preemptions = prompt_logprobs(12)
    assert preemptions > 0
    assert len(got) == len(prompt)
    assert [sorted(entry) for entry in got[1:]] == [sorted(entry) for entry in expected[1:]]
    for entry, want in zip(got[1:], expected[1:]):
        assert all(abs(entry[t].logprob - want[t].logprob) < 1e-4 for t in want)


def test_max_tokens_none_is_bounded_by_what_the_kv_cache_holds(tiny_llama):
    """Without max_tokens a request may grow to the context window, unless the KV cache holds less: then to that."""
    engine = make_engine(tiny_llama, block_size=4, num_kv_blocks=4, max_model_len=64)
    request_id = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    finished = {}
    for _ in range(100):  # bounded: before, the request preempted itself and waited for ever
        finished.update({output.request_id: output for output in engine.step() if output.finished})
    assert len(finished[request_id].outputs[0].token_ids) == 4 * 4 - 3


@pytest.mark.parametrize("prompt", [[5.7, 6, 7], ["5", 6]])
def test_a_prompt_of_token_ids_that_are_not_integers_is_refused(llama_engine, prompt):
    with pytest.raises(ValueError, match="integers only"):
        llama_engine.add_request(prompt, GREEDY)
    assert not llama_engine.has_unfinished_requests()
