"""TGI's surface: /generate and /generate_stream with adapter_id, and adapters from LORA_ADAPTERS."""
from __future__ import annotations

import json

import httpx
import pytest

from openai_server import tgi
from openai_server.config import serve_config_from_args
from openai_server.launch import build_server

from .conftest import start_server, stop_server

INPUTS = "Hello world! How are"


def _events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[len("data:"):]) for line in response.iter_lines() if line.startswith("data:")]


def test_generate_with_adapter_id_matches_greedy_completion(http):
    generated = http.post("/generate", json={"inputs": INPUTS, "parameters": {"adapter_id": "beta", "max_new_tokens": 10}})
    completion = http.post(
        "/v1/completions", json={"model": "beta", "prompt": INPUTS, "max_tokens": 10, "temperature": 0.0}
    )
    assert generated.status_code == 200
    assert generated.json() == {"generated_text": completion.json()["choices"][0]["text"]}


def test_generate_without_adapter_id_uses_the_base_model(http):
    base = http.post("/generate", json={"inputs": INPUTS, "parameters": {"max_new_tokens": 10}}).json()
    adapter = http.post("/generate", json={"inputs": INPUTS, "parameters": {"adapter_id": "alpha", "max_new_tokens": 10}}).json()
    completion = http.post("/v1/completions", json={"prompt": INPUTS, "max_tokens": 10, "temperature": 0.0}).json()
    assert base["generated_text"] == completion["choices"][0]["text"] != adapter["generated_text"]


def test_generate_details_count_tokens_and_name_the_finish(http):
    body = http.post(
        "/generate", json={"inputs": INPUTS, "parameters": {"max_new_tokens": 5, "details": True}}
    ).json()
    assert body["details"]["finish_reason"] in {"length", "eos_token"}
    assert body["details"]["generated_tokens"] == len(body["details"]["tokens"]) <= 5


def test_generate_details_give_each_token_its_own_text(http):
    body = http.post("/generate", json={"inputs": INPUTS, "parameters": {"max_new_tokens": 8, "details": True}}).json()
    tokens = body["details"]["tokens"]
    assert "".join(token["text"] for token in tokens) == body["generated_text"]
    assert sum(bool(token["text"]) for token in tokens) > 1


def test_generate_details_give_a_character_split_over_tokens_to_the_token_that_completes_it(http, server):
    body = {"inputs": "The capital of", "parameters": {"max_new_tokens": 2, "details": True}}
    first, second = http.post("/generate", json=body).json()["details"]["tokens"]
    character = server.engine.tokenizer.decode([first["id"], second["id"]])
    assert len(character) == 1 and not character.isascii()  # the tiny model's reply: one character in two tokens
    assert (first["text"], second["text"]) == ("", character)


def test_generate_details_give_each_token_the_text_the_stream_gives_it(http):
    """The greedy reply to INPUTS holds bytes of characters, some completed by the next token and some never."""
    parameters = {"max_new_tokens": 12}
    whole = http.post("/generate", json={"inputs": INPUTS, "parameters": {**parameters, "details": True}}).json()
    with http.stream("POST", "/generate_stream", json={"inputs": INPUTS, "parameters": parameters}) as response:
        streamed = [event["token"] for event in _events(response)]
    assert [(t["id"], t["text"]) for t in whole["details"]["tokens"]] == [(t["id"], t["text"]) for t in streamed]


def _details_and_stream(http, inputs: str, parameters: dict) -> tuple[dict, list[tuple[int, str]]]:
    whole = http.post("/generate", json={"inputs": inputs, "parameters": {**parameters, "details": True}}).json()
    with http.stream("POST", "/generate_stream", json={"inputs": inputs, "parameters": parameters}) as response:
        return whole, [(event["token"]["id"], event["token"]["text"]) for event in _events(response)]


def test_generate_stream_gives_each_of_the_last_two_tokens_its_own_text(http):
    """The engine sends a request's last two tokens in one output; the text they bring is not all the last one's."""
    whole, streamed = _details_and_stream(http, "Hello caf\u00e9 \u4e16\u754c",
                                          {"max_new_tokens": 12, "do_sample": True, "seed": 1, "temperature": 1.5})
    assert all(text for _, text in streamed[-2:])  # the sampled reply ends in two tokens of whole characters
    assert [(t["id"], t["text"]) for t in whole["details"]["tokens"]] == streamed


def test_generate_details_cut_the_token_texts_where_a_stop_sequence_ends_inside_a_token(http):
    whole, streamed = _details_and_stream(http, "Hello caf\u00e9 \u4e16\u754c", {
        "max_new_tokens": 12, "do_sample": True, "seed": 0, "temperature": 1.5, "stop": ["e"]})
    assert whole["details"]["finish_reason"] == "stop_sequence"
    details = [(t["id"], t["text"]) for t in whole["details"]["tokens"]]
    assert "".join(text for _, text in details) == whole["generated_text"]
    assert details == streamed


def test_generate_details_take_the_token_texts_the_engine_decoded(http, monkeypatch):
    """The engine decoded each token for its logprobs: tokens of whole characters are not decoded a second time."""
    decoded_again = []
    monkeypatch.setattr(tgi, "IncrementalDetokenizer", lambda *args: decoded_again.append(args))
    body = http.post("/generate", json={"inputs": "C", "parameters": {"max_new_tokens": 10, "details": True}}).json()
    tokens = [(token["text"], token["special"]) for token in body["details"]["tokens"]]
    assert tokens == [("Ho", False), ("", True)]  # the tiny model's reply: whole characters, then its eos
    assert decoded_again == []


def test_generate_stream_sends_token_events_then_the_full_text(http):
    with http.stream(
        "POST", "/generate_stream", json={"inputs": INPUTS, "parameters": {"adapter_id": "gamma", "max_new_tokens": 8}}
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
    whole = http.post("/generate", json={"inputs": INPUTS, "parameters": {"adapter_id": "gamma", "max_new_tokens": 8}})
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    assert events[-1]["generated_text"] == whole.json()["generated_text"]
    assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"]
    assert events[-1]["details"]["generated_tokens"] == len(events)


def test_generate_stream_gives_no_text_to_a_special_token(http):
    """A TGI client adds up the text of the tokens that are not special: it must come to the whole text."""
    for inputs in ("a", "e", "C", "Po", "i x"):  # prompts after which the tiny model ends its text (eos)
        with http.stream("POST", "/generate_stream",
                         json={"inputs": inputs, "parameters": {"max_new_tokens": 40}}) as response:
            events = _events(response)
        assert events[-1]["token"]["special"] and events[-1]["details"]["finish_reason"] == "eos_token"
        assert all(e["token"]["text"] == "" for e in events if e["token"]["special"])
        assert "".join(e["token"]["text"] for e in events if not e["token"]["special"]) == events[-1]["generated_text"]


def test_generate_keeps_the_stop_sequence_in_the_text(http):
    text = http.post("/generate", json={"inputs": INPUTS, "parameters": {"max_new_tokens": 10}}).json()["generated_text"]
    stop = text[3:5]
    stopped = http.post("/generate", json={"inputs": INPUTS, "parameters": {"max_new_tokens": 10, "stop": [stop],
                                                                            "details": True}}).json()
    assert stopped["details"]["finish_reason"] == "stop_sequence"
    assert stopped["generated_text"] == text[:text.index(stop) + len(stop)]


def test_generate_with_temperature_one_and_no_do_sample_is_greedy(http):
    greedy = http.post("/generate", json={"inputs": INPUTS, "parameters": {"max_new_tokens": 10}}).json()
    for seed in (1, 2):
        parameters = {"max_new_tokens": 10, "temperature": 1.0, "top_p": 1.0, "seed": seed}
        assert http.post("/generate", json={"inputs": INPUTS, "parameters": parameters}).json() == greedy


def test_generate_decoder_input_details_score_each_input_token(http):
    body = {"inputs": INPUTS, "parameters": {"max_new_tokens": 1, "decoder_input_details": True, "details": True}}
    prefill = http.post("/generate", json=body).json()["details"]["prefill"]
    echo = http.post("/v1/completions", json={"prompt": INPUTS, "max_tokens": 1, "echo": True, "logprobs": 0}).json()
    logprobs = echo["choices"][0]["logprobs"]
    assert len(prefill) == echo["usage"]["prompt_tokens"]
    assert [token["text"] for token in prefill] == logprobs["tokens"][:len(prefill)]
    assert prefill[0]["logprob"] is None
    assert [t["logprob"] for t in prefill[1:]] == pytest.approx(logprobs["token_logprobs"][1:len(prefill)], abs=1e-5)


def test_generate_stream_with_decoder_input_details_is_400_in_tgi_shape(http):
    body = {"inputs": INPUTS, "parameters": {"decoder_input_details": True, "details": True}}
    response = http.post("/generate_stream", json=body)
    assert response.status_code == 400
    assert response.json()["error_type"] == "validation"


def test_generate_truncate_keeps_the_last_input_tokens(http):
    body = {"inputs": INPUTS, "parameters": {"max_new_tokens": 4, "truncate": 2, "decoder_input_details": True,
                                               "details": True}}
    details = http.post("/generate", json=body).json()["details"]
    assert len(details["prefill"]) == 2


def test_info_gives_the_model_and_its_token_limits(http):
    info = http.get("/info").json()
    assert info["model_id"] == http.get("/v1/models").json()["data"][0]["id"]
    assert (info["max_input_tokens"], info["max_total_tokens"]) == (511, 512)
    assert info["model_dtype"] == "float32" and info["model_device_type"] == "cpu"


def test_generate_unknown_adapter_is_404_in_tgi_shape(http):
    response = http.post("/generate", json={"inputs": INPUTS, "parameters": {"adapter_id": "nope"}})
    assert response.status_code == 404
    assert response.json() == {"error": "The model `nope` does not exist.", "error_type": "validation"}


def test_generate_invalid_parameters_are_400_in_tgi_shape(http):
    response = http.post("/generate", json={"inputs": INPUTS, "parameters": {"max_new_tokens": 0}})
    assert response.status_code == 400
    assert response.json()["error_type"] == "validation"


def test_generate_body_nested_too_deeply_is_400_in_tgi_shape(http):
    body = b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = http.post("/generate", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error_type"] == "validation"


@pytest.fixture(scope="module")
def env_server(model_dir, adapter_dirs, tmp_path_factory):
    """A server built by the CLI's own path, its adapter given only through LORA_ADAPTERS."""
    config = serve_config_from_args(
        [str(model_dir), "--dtype", "float32", "--device", "cpu"],
        environ={"LORA_ADAPTERS": f"from-env={adapter_dirs['alpha']}"},
        cwd=tmp_path_factory.mktemp("cwd"),
    )
    built = build_server(config)
    url, running = start_server(built.app)
    yield url
    stop_server(running)
    built.engine.shutdown()


def test_lora_adapters_from_environment_are_served(env_server, http):
    with httpx.Client(base_url=env_server, timeout=60) as client:
        assert [card["id"] for card in client.get("/v1/models").json()["data"]][1:] == ["from-env"]
        params = {"adapter_id": "from-env", "max_new_tokens": 10}
        via_env = client.post("/generate", json={"inputs": INPUTS, "parameters": params}).json()
    same_adapter = http.post("/generate", json={"inputs": INPUTS, "parameters": {**params, "adapter_id": "alpha"}}).json()
    assert via_env == same_adapter
