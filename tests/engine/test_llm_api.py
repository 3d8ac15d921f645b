"""vLLM's offline API surface: argument forms and the errors raised before anything runs."""
from __future__ import annotations

import pytest

from engine import LLM, LoRARequest, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def lora_llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=2)


def test_token_id_prompts_and_string_prompts_agree(llm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ids = llm.get_tokenizer()("Hello world")["input_ids"]
    by_text, by_ids = llm.generate(["Hello world", ids], params, use_tqdm=False)
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_ids.prompt is None and by_ids.prompt_token_ids == ids


def test_vllm_prompt_dicts_are_text_and_token_id_prompts(llm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ids = llm.get_tokenizer()("Hello world")["input_ids"]
    (plain,) = llm.generate("Hello world", params, use_tqdm=False)
    (one,) = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    by_text, by_ids = llm.generate([{"prompt": "Hello world"}, {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert one.prompt_token_ids == by_ids.prompt_token_ids == ids and by_text.prompt == "Hello world"
    assert plain.outputs[0].token_ids == one.outputs[0].token_ids == by_text.outputs[0].token_ids \
        == by_ids.outputs[0].token_ids


def test_a_prompt_dict_without_a_prompt_is_refused(llm):
    with pytest.raises(ValueError, match="'prompt' or a 'prompt_token_ids' key"):
        llm.generate({"text": "Hello"}, use_tqdm=False)


def test_max_tokens_past_the_context_window_stop_at_its_end_offline(tiny_llama):
    """As in vLLM's offline engine: the request runs to the end of the context window (its server refuses it)."""
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", max_model_len=32)
    prompt = list(range(10, 30))
    (output,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 32 - len(prompt)
    assert output.outputs[0].finish_reason == "length"


def test_end_of_sequence_ids_from_generation_config_stop_the_text(tiny_llama, tmp_path):
    """Chat models often list their end-of-turn token in generation_config.json only; vLLM stops at it too."""
    import json
    import shutil

    params = SamplingParams(temperature=0, max_tokens=8)
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    (free,) = LLM(str(model), dtype="float32", device="cpu").generate("Hello", params, use_tqdm=False)
    end_of_turn = free.outputs[0].token_ids[2]
    config = json.loads((model / "config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [config["eos_token_id"], end_of_turn]}))
    (stopped,) = LLM(str(model), dtype="float32", device="cpu").generate("Hello", params, use_tqdm=False)
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].token_ids == free.outputs[0].token_ids[:free.outputs[0].token_ids.index(end_of_turn) + 1]


def test_a_list_of_sampling_params_applies_per_prompt(llm):
    outputs = llm.generate(["a", "b"], [SamplingParams(max_tokens=2, ignore_eos=True),
                                        SamplingParams(max_tokens=4, ignore_eos=True)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 4]


def test_sampling_params_list_of_wrong_length_is_refused(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_lora_request_list_of_wrong_length_is_refused(lora_llm, tmp_path):
    lora = LoRARequest("x", 1, str(tmp_path))
    with pytest.raises(ValueError, match="lora_request"):
        lora_llm.generate(["a", "b", "c"], SamplingParams(), lora_request=[lora, None], use_tqdm=False)
    assert not lora_llm.engine.has_unfinished_requests()


def test_one_int_id_for_two_adapters_is_refused(lora_llm, tmp_path):
    first, second = LoRARequest("a", 1, str(tmp_path / "a")), LoRARequest("b", 1, str(tmp_path / "b"))
    with pytest.raises(ValueError, match="lora_int_id 1"):
        lora_llm.generate(["x", "y"], SamplingParams(), lora_request=[first, second], use_tqdm=False)


def test_lora_request_without_enable_lora_is_refused(llm, tmp_path):
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate("x", SamplingParams(), lora_request=LoRARequest("a", 1, str(tmp_path)), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_chat_applies_the_chat_template(llm):
    messages = [{"role": "user", "content": "Hello"}]
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (chat,) = llm.chat(messages, params, use_tqdm=False)
    assert chat.prompt_token_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_chat_outputs_carry_the_rendered_prompt(llm):
    messages = [{"role": "user", "content": "Hello"}]
    rendered = llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    (chat,) = llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)
    assert chat.prompt == rendered


def test_a_prompt_dict_with_text_and_token_ids_runs_the_ids_and_reports_the_text(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = llm.get_tokenizer()("Hello world")["input_ids"]
    (both,) = llm.generate({"prompt": "shown", "prompt_token_ids": ids}, params, use_tqdm=False)
    (by_ids,) = llm.generate(ids, params, use_tqdm=False)
    assert both.prompt == "shown" and both.prompt_token_ids == ids
    assert both.outputs[0].token_ids == by_ids.outputs[0].token_ids


def test_max_cpu_loras_below_max_loras_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(str(tiny_llama), device="cpu", enable_lora=True, max_loras=4, max_cpu_loras=2)


def test_logprobs_are_vllm_logprob_objects_with_rank_and_decoded_token(llm):
    """vLLM's outputs hold `{token_id: Logprob(logprob, rank, decoded_token)}` per position, sampled or prompt."""
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    (output,) = llm.generate("Hello world, how", params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    completion = output.outputs[0]
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        assert token_id in position and len(position) in (2, 3)
        ranked = sorted(position.items(), key=lambda item: -item[1].logprob)
        assert [logprob.rank for _, logprob in ranked[:2]] == [1, 2]
        if len(position) == 3:  # the sampled token, outside the top two
            assert ranked[2][0] == token_id and ranked[2][1].rank > 2
        for other, logprob in position.items():
            assert logprob.decoded_token == tokenizer.decode([other])
    assert completion.cumulative_logprob == pytest.approx(
        sum(position[t].logprob for t, position in zip(completion.token_ids, completion.logprobs)), abs=1e-5)
    assert output.prompt_logprobs[0] is None
    for token_id, position in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
        assert position[token_id].decoded_token == tokenizer.decode([token_id])
        assert position[token_id].rank >= 1
