"""The OpenAI surface as the `openai` SDK sees it: completions and chat, whole and streamed."""
from __future__ import annotations

import asyncio

import openai
import pytest
import transformers

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Hello world! How are you today?"}]
GREEDY = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


@pytest.fixture
async def aclient(server):
    async with openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:
        yield client


def test_completion_has_openai_shape_and_usage(client):
    response = client.completions.create(model="alpha", prompt=PROMPT, **GREEDY)
    assert response.object == "text_completion"
    assert response.model == "alpha"
    [choice] = response.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12


def test_streamed_completion_text_equals_whole_completion(client):
    whole = client.completions.create(model="beta", prompt=PROMPT, **GREEDY).choices[0].text
    chunks = list(client.completions.create(model="beta", prompt=PROMPT, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1


def test_chat_completion_has_openai_shape(client):
    response = client.chat.completions.create(model="gamma", messages=MESSAGES, **GREEDY)
    assert response.object == "chat.completion"
    [choice] = response.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 12


def test_chat_stream_starts_with_role_and_matches_whole_text(client):
    whole = client.chat.completions.create(model="alpha", messages=MESSAGES, **GREEDY).choices[0].message.content
    chunks = list(client.chat.completions.create(model="alpha", messages=MESSAGES, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


def test_n2_stream_interleaves_choices_by_index(client):
    stream = client.chat.completions.create(
        model="beta", messages=MESSAGES, n=2, temperature=1.0, seed=3, max_tokens=8, stream=True,
        extra_body={"ignore_eos": True},
    )
    indices = [c.choices[0].index for c in stream]
    assert set(indices) == {0, 1}
    first_one, last_zero = indices.index(1), len(indices) - 1 - indices[::-1].index(0)
    assert first_one < last_zero  # choice 1 starts before choice 0 ends: interleaved, not sequential


def test_include_usage_adds_one_final_usage_chunk(client):
    chunks = list(client.completions.create(
        model="alpha", prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **GREEDY
    ))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, kind):
    """vLLM's `stream_options.continuous_usage_stats`, with include_usage."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    if kind == "chat":
        chunks = list(client.chat.completions.create(model="alpha", messages=MESSAGES, stream=True,
                                                     stream_options=options, **GREEDY))
    else:
        chunks = list(client.completions.create(model="alpha", prompt=PROMPT, stream=True, stream_options=options,
                                                **GREEDY))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None and c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 12
    assert counts[0] == 0 if kind == "chat" else counts[0] > 0  # chat's role chunk has no tokens yet
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_continuous_usage_with_n_choices_counts_each_chunks_own_choice(client, kind):
    """As vLLM: each chunk reports its own choice's tokens so far; the final usage chunk has the total."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    if kind == "chat":
        chunks = list(client.chat.completions.create(model="alpha", messages=MESSAGES, stream=True, n=2,
                                                     stream_options=options, **GREEDY))
    else:
        chunks = list(client.completions.create(model="alpha", prompt=PROMPT, stream=True, n=2,
                                                stream_options=options, **GREEDY))
    content = [c for c in chunks if c.choices]
    assert max(c.usage.completion_tokens for c in content) == 12
    assert chunks[-1].usage.completion_tokens == 24


def test_completion_logprobs_have_completion_shape(client):
    response = client.completions.create(model="alpha", prompt=PROMPT, logprobs=3, **GREEDY)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 12
    # the top 3 plus the chosen token (distinct ids may decode to the same text, so at most 4 keys)
    assert all(len(top) <= 4 and token in top for token, top in zip(logprobs.tokens, logprobs.top_logprobs))
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert all(lp <= 0 for lp in logprobs.token_logprobs)


def test_echo_with_logprobs_prefixes_prompt_and_its_logprobs(client):
    response = client.completions.create(model="beta", prompt=PROMPT, echo=True, logprobs=1, **GREEDY)
    choice = response.choices[0]
    assert choice.text.startswith(PROMPT)
    assert choice.logprobs.token_logprobs[0] is None  # the first prompt token has no logprob
    assert len(choice.logprobs.tokens) == response.usage.prompt_tokens + 12


def test_chat_logprobs_have_chat_shape(client):
    response = client.chat.completions.create(model="gamma", messages=MESSAGES, logprobs=True, top_logprobs=2, **GREEDY)
    content = response.choices[0].logprobs.content
    assert len(content) == 12
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6
        assert isinstance(entry.bytes, list)
    raw = b"".join(bytes(entry.bytes) for entry in content)
    assert raw.decode("utf-8", errors="replace") == response.choices[0].message.content


def test_stop_string_ends_text_before_it(client):
    text = client.completions.create(model="alpha", prompt=PROMPT, **GREEDY).choices[0].text
    stop = text[4:7]
    choice = client.completions.create(model="alpha", prompt=PROMPT, stop=[stop], **GREEDY).choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == text[: text.index(stop)]


def test_same_seed_gives_same_text(client):
    sampled = {"temperature": 1.0, "max_tokens": 12, "seed": 1234}
    first = client.completions.create(model="beta", prompt=PROMPT, **sampled).choices[0].text
    second = client.completions.create(model="beta", prompt=PROMPT, **sampled).choices[0].text
    third = client.completions.create(model="beta", prompt=PROMPT, **{**sampled, "seed": 99}).choices[0].text
    assert first == second
    assert third != first


def test_several_prompts_give_one_choice_each_in_order(client):
    prompts = [PROMPT, "SELECT name FROM"]
    response = client.completions.create(model="gamma", prompt=prompts, n=2, **GREEDY)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.choices[0].text == response.choices[1].text  # greedy: the two samples agree
    single = client.completions.create(model="gamma", prompt=prompts[1], **GREEDY).choices[0].text
    assert response.choices[2].text == single


@pytest.mark.anyio
async def test_async_client_streams_chat(aclient):
    stream = await aclient.chat.completions.create(model="beta", messages=MESSAGES, stream=True, **GREEDY)
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    whole = await aclient.chat.completions.create(model="beta", messages=MESSAGES, **GREEDY)
    assert text == whole.choices[0].message.content


@pytest.mark.anyio
async def test_async_client_completions_concurrently(aclient):
    responses = await asyncio.gather(*(
        aclient.completions.create(model=name, prompt=PROMPT, **GREEDY) for name in ("alpha", "beta", "gamma")
    ))
    assert [r.model for r in responses] == ["alpha", "beta", "gamma"]
    assert len({r.choices[0].text for r in responses}) == 3  # different adapters, different text


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-adapter", prompt=PROMPT)
    assert caught.value.body["message"] == "The model `no-such-adapter` does not exist."
    assert caught.value.body["param"] == "model"


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": -1.0},
        {"top_p": 1.5},
        {"n": 0},
        {"logprobs": 21},
        {"suffix": "tail"},
        {"stream_options": {"include_usage": True}},
        {"max_tokens": 400, "prompt": "x" * 200},
    ],
    ids=["temperature", "top_p", "n", "logprobs", "suffix", "stream_options_without_stream", "context_window"],
)
def test_bad_parameters_are_bad_requests(client, fields):
    body = {"model": "alpha", "prompt": PROMPT, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**body)
    assert caught.value.status_code == 400
    assert caught.value.body["type"] == "invalid_request_error"


def test_context_window_error_names_the_limit(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="alpha", prompt="x" * 200, max_tokens=400)
    assert "512" in caught.value.body["message"]


def test_truncate_prompt_tokens_keeps_the_last_tokens_of_the_prompt(client, http):
    prompt_ids = http.post("/v1/completions", json={"model": "alpha", "prompt": PROMPT, "max_tokens": 1,
                                                    "echo": True, "logprobs": 0}).json()
    tokens = prompt_ids["usage"]["prompt_tokens"]
    truncated = client.completions.create(model="alpha", prompt=PROMPT, **_with_extra(truncate_prompt_tokens=2))
    assert truncated.usage.prompt_tokens == 2 < tokens


def test_truncate_prompt_tokens_fits_a_long_prompt_into_the_context_window(client):
    response = client.completions.create(model="alpha", prompt="x" * 600, **_with_extra(truncate_prompt_tokens=100))
    assert response.usage.prompt_tokens == 100


def test_echo_with_truncate_prompt_tokens_echoes_the_tokens_kept(client):
    """The echoed prompt is what the engine ran, so every logprob's text offset points at its token in the text."""
    choice = client.completions.create(model="alpha", prompt=PROMPT, echo=True, logprobs=0,
                                       **_with_extra(truncate_prompt_tokens=2)).choices[0]
    logprobs = choice.logprobs
    assert logprobs.token_logprobs[0] is None and len(logprobs.tokens) == 2 + GREEDY["max_tokens"]
    prompt = list(zip(logprobs.tokens, logprobs.text_offset))[:2]
    assert all(choice.text[offset:offset + len(token)] == token for token, offset in prompt)


def test_allowed_token_ids_bound_the_completion(client):
    whole = client.completions.create(model="alpha", prompt=PROMPT, logprobs=0, **GREEDY)
    allowed = client.completions.create(model="alpha", prompt=PROMPT, logprobs=0,
                                        **_with_extra(allowed_token_ids=[40, 41]))
    assert set(allowed.choices[0].logprobs.tokens) <= {_token_text(client, 40), _token_text(client, 41)}
    assert allowed.choices[0].text != whole.choices[0].text


def test_bad_words_are_left_out_of_the_completion(client, model_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    # two tokens that are whole words, each encoded as itself: with only these allowed, banning one leaves the other
    words = [(i, tokenizer.decode([i])) for i in range(tokenizer.vocab_size)]
    (banned, word), (kept, _) = [(i, w) for i, w in words
                                 if w.isalpha() and len(w) > 2 and tokenizer.encode(w, add_special_tokens=False) == [i]][:2]
    response = client.completions.create(model="alpha", prompt=PROMPT,
                                         **_with_extra(allowed_token_ids=[banned, kept], bad_words=[word]))
    assert response.choices[0].text == _token_text(client, kept) * GREEDY["max_tokens"]


def test_chat_without_max_tokens_past_the_context_window_is_bad_request(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "x" * 600}])
    assert "512" in caught.value.body["message"]


def _with_extra(**extra) -> dict:
    return {**GREEDY, "extra_body": {**GREEDY["extra_body"], **extra}}


def _token_text(client, token_id: int) -> str:
    return client.completions.create(model="alpha", prompt=[token_id], max_tokens=1, echo=True, logprobs=0,
                                     temperature=0.0).choices[0].logprobs.tokens[0]


def test_chat_top_logprobs_without_logprobs_is_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="alpha", messages=MESSAGES, top_logprobs=2)


def test_invalid_json_is_400_not_422(http):
    response = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_wrong_field_type_is_400_naming_the_field(http):
    response = http.post("/v1/chat/completions", json={"model": "alpha", "messages": "hello"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", b'{"model": "alpha", "prompt": "\\ud800"}'),
    ("/v1/completions", b'{"model": "\\udfff", "prompt": "Hello"}'),
    ("/v1/chat/completions", b'{"model": "alpha", "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    ("/v1/unload_lora_adapter", b'{"lora_name": "\\ud800"}'),
])
def test_a_lone_surrogate_escape_is_400_and_the_connection_keeps_serving(http, route, body):
    response = http.post(route, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "surrogate" in response.json()["error"]["message"]
    assert http.get("/v1/models").status_code == 200


def test_a_surrogate_pair_escape_is_text(http):
    body = b'{"model": "alpha", "prompt": "\\ud83d\\ude00", "max_tokens": 2}'
    assert http.post("/v1/completions", content=body, headers={"content-type": "application/json"}).status_code == 200


def test_json_nested_too_deeply_is_400(http):
    body = b'{"model": "alpha", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "nested too deeply" in response.json()["error"]["message"]


def test_chat_template_kwargs_may_override_the_generation_prompt(http):
    """As in vLLM, the request's chat_template_kwargs win over the server's own template arguments."""
    body = {"model": "alpha", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1}
    default = http.post("/v1/chat/completions", json=body).json()
    without = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert without.status_code == 200
    assert without.json()["usage"]["prompt_tokens"] < default["usage"]["prompt_tokens"]
