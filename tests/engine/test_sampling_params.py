import pytest

from engine.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs, p.seed) == (16, 0, None, None, None)
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", 1.5),
        ("temperature", -1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("seed", "7"),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 3),
        ("repetition_penalty", 0.0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("prompt_logprobs", -1),
        ("stop", [""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["a"]),
        ("logit_bias", {"x": 1.0}),
        ("logit_bias", {-3: 1.0}),
        ("logit_bias", {3: "big"}),
    ],
)
def test_invalid_value_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_temperature_message_is_vllm_like():
    with pytest.raises(ValueError, match="temperature must be non-negative, got -1"):
        SamplingParams(temperature=-1)


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_max_tokens_none_is_allowed_with_any_min_tokens():
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None


def test_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_stop_token_ids_become_a_list():
    assert SamplingParams(stop_token_ids=(5, 6)).stop_token_ids == [5, 6]


def test_logit_bias_keys_from_json_become_ints():
    assert SamplingParams(logit_bias={"50": -100, 7: 2.5}).logit_bias == {50: -100.0, 7: 2.5}


def test_top_k_minus_one_and_zero_both_mean_off():
    assert SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(top_k=0).top_k == 0


def test_zero_temperature_is_greedy_and_turns_truncation_off():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert p.is_greedy and p.sampling_type == SamplingType.GREEDY
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)


@pytest.mark.parametrize("temperature", [1e-6, 1e-3])
def test_a_tiny_temperature_is_raised_to_a_hundredth_as_in_vllm(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.temperature == 0.01 and not params.is_greedy


def test_sampling_type_random_and_seeded():
    assert SamplingParams(temperature=0.7).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED



@pytest.mark.parametrize(
    "field, value, message",
    [
        ("allowed_token_ids", [], "allowed_token_ids cannot be empty"),
        ("allowed_token_ids", [3, -1], "allowed_token_ids must be non-negative integers"),
        ("allowed_token_ids", "3", "allowed_token_ids must be a list"),
        ("bad_words", "word", "bad_words must be a list of strings"),
        ("bad_words", ["ok", " "], "bad_words must be non-blank strings"),
        ("truncate_prompt_tokens", 0, "truncate_prompt_tokens must be -1 or at least 1"),
        ("truncate_prompt_tokens", 2.5, "truncate_prompt_tokens must be an integer"),
    ],
)
def test_vllm_extras_are_validated(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty", "presence_penalty", "min_p"])
def test_infinite_values_are_refused(field):
    with pytest.raises(ValueError, match=f"{field} must be a finite number"):
        SamplingParams(**{field: float("inf")})


def test_infinite_logit_bias_bans_or_forces_a_token():
    assert SamplingParams(logit_bias={3: float("-inf"), 4: float("inf")}).logit_bias == {3: float("-inf"), 4: float("inf")}


def test_seed_minus_one_means_no_seed():
    """vLLM's convention: each such request draws afresh."""
    params = SamplingParams(temperature=0.8, seed=-1)
    assert params.seed is None and params.sampling_type == SamplingType.RANDOM
