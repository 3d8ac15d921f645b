"""Stopping rules, n, and logprobs as the engine applies them end to end."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.engine.conftest import run_to_completion

PROMPT = "The capital of France is"


def _generate(engine, params, prompt=PROMPT):
    engine.add_request(prompt, params)
    (output,) = run_to_completion(engine).values()
    return output


def _greedy_tokens(engine, count):
    return _generate(engine, SamplingParams(temperature=0, max_tokens=count, ignore_eos=True)).outputs[0].token_ids


def test_max_tokens_ends_with_length(llama_engine):
    out = _generate(llama_engine, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)).outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_token_id_ends_with_stop_and_its_reason(llama_engine):
    tokens = _greedy_tokens(llama_engine, 10)
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    out = _generate(llama_engine, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id])).outputs[0]
    assert out.token_ids == tokens[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_min_tokens_suppresses_an_early_stop_token(llama_engine):
    tokens = _greedy_tokens(llama_engine, 10)
    stop_id = tokens[0]
    out = _generate(llama_engine, SamplingParams(temperature=0, max_tokens=10, min_tokens=3,
                                                 stop_token_ids=[stop_id])).outputs[0]
    assert len(out.token_ids) >= 3
    assert stop_id not in out.token_ids[:3]


def test_stop_string_truncates_the_text(llama_engine):
    full = _generate(llama_engine, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)).outputs[0].text
    stop = full[5:8]
    out = _generate(llama_engine, SamplingParams(temperature=0, max_tokens=12, stop=[stop])).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[:full.index(stop)]


def test_include_stop_str_in_output_keeps_it(llama_engine):
    full = _generate(llama_engine, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)).outputs[0].text
    stop = full[5:8]
    out = _generate(llama_engine, SamplingParams(temperature=0, max_tokens=12, stop=stop,
                                                 include_stop_str_in_output=True)).outputs[0]
    assert out.text == full[:full.index(stop) + len(stop)]


def test_n_gives_n_independent_completions(llama_engine):
    out = _generate(llama_engine, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_logprobs_agree_with_log_softmax_by_hand(llama_engine, hf_llama):
    out = _generate(llama_engine, SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True))
    completion = out.outputs[0]
    full = torch.tensor([out.prompt_token_ids + completion.token_ids])
    with torch.no_grad():
        logits = hf_llama(full).logits[0, len(out.prompt_token_ids) - 1:-1].float()
    by_hand = torch.log_softmax(logits, dim=-1)
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        top = by_hand[step].topk(3).indices.tolist()
        assert set(entry) == set(top) | {token}
        for token_id, lp in entry.items():
            assert lp.logprob == pytest.approx(by_hand[step, token_id].item(), abs=1e-4)
    assert completion.cumulative_logprob == pytest.approx(
        sum(by_hand[i, t].item() for i, t in enumerate(completion.token_ids)), abs=1e-3)


def test_prompt_logprobs_score_every_prompt_token(llama_engine, hf_llama):
    out = _generate(llama_engine, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    prompt = out.prompt_token_ids
    with torch.no_grad():
        by_hand = torch.log_softmax(hf_llama(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry[prompt[pos]].logprob == pytest.approx(by_hand[pos - 1, prompt[pos]].item(), abs=1e-4)
        assert len(entry) in (2, 3)


def test_eos_ends_the_sequence_unless_ignored(llama_engine):
    tokens = _greedy_tokens(llama_engine, 10)
    eos = tokens[2]
    llama_engine.eos_token_ids.add(eos)
    llama_engine.sampler.eos_token_ids.add(eos)
    try:
        stopped = _generate(llama_engine, SamplingParams(temperature=0, max_tokens=10)).outputs[0]
        ignored = _generate(llama_engine, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)).outputs[0]
    finally:
        llama_engine.eos_token_ids.discard(eos)
        llama_engine.sampler.eos_token_ids.discard(eos)
    assert stopped.token_ids == tokens[:tokens.index(eos) + 1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == tokens and ignored.finish_reason == "length"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llama_engine):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = llama_engine.tokenize(PROMPT)
    truncated = _generate(llama_engine, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                       truncate_prompt_tokens=3))
    assert truncated.prompt_token_ids == prompt[-3:]
    assert truncated.outputs[0].token_ids == _generate(llama_engine, params, prompt[-3:]).outputs[0].token_ids


def test_allowed_token_ids_bound_the_output(llama_engine):
    allowed = _greedy_tokens(llama_engine, 6)[3:] + [7, 8]
    out = _generate(llama_engine, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                 allowed_token_ids=allowed)).outputs[0]
    assert set(out.token_ids) <= set(allowed)


def test_bad_words_never_appear_in_the_output(llama_engine):
    from engine.sampling_params import bad_words_token_ids

    tokenizer = llama_engine.tokenizer
    free = _generate(llama_engine, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)).outputs[0]
    # a word the free output spells with the tokens that the word's own encoding gives
    words = [tokenizer.decode(free.token_ids[i:i + 2]).strip() for i in range(len(free.token_ids) - 1)]
    word = next(w for w in words if w and any(_contains(free.token_ids, ids)
                                              for ids in bad_words_token_ids([w], tokenizer)))
    out = _generate(llama_engine, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                 bad_words=[word])).outputs[0]
    assert out.token_ids != free.token_ids
    assert not any(_contains(out.token_ids, ids) for ids in bad_words_token_ids([word], tokenizer))


def _contains(tokens: list[int], part: list[int]) -> bool:
    return any(tokens[i:i + len(part)] == part for i in range(len(tokens) - len(part) + 1))
