"""vLLM's /tokenize and /detokenize: the served tokenizer, for a prompt or for chat messages through the template."""
from __future__ import annotations

import transformers

MESSAGES = [{"role": "user", "content": "Hello world! How are you today?"}]


def test_tokenize_a_prompt_gives_its_tokens_count_and_the_context_window(http, model_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    body = http.post("/tokenize", json={"model": "alpha", "prompt": "Hello world"}).json()
    assert body["tokens"] == tokenizer.encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    assert body["token_strs"] is None


def test_tokenize_can_name_each_token(http, model_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    body = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])


def test_tokenize_messages_gives_the_prompt_tokens_of_the_chat_completion(http):
    """The count a client budgets with is the one chat completions bills."""
    tokens = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
    assert len(tokens) == chat["usage"]["prompt_tokens"]


def test_detokenize_inverts_tokenize(http):
    tokens = http.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()["tokens"]
    assert http.post("/detokenize", json={"model": "beta", "tokens": tokens}).json() == {"prompt": "Hello world"}


def test_tokenize_needs_a_prompt_or_messages_but_not_both(http):
    for body in ({}, {"prompt": "Hi", "messages": MESSAGES}):
        response = http.post("/tokenize", json=body)
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_an_unknown_model_is_not_found(http):
    assert http.post("/tokenize", json={"model": "no-such-adapter", "prompt": "Hi"}).status_code == 404


def test_detokenize_refuses_tokens_past_the_vocabulary(http):
    response = http.post("/detokenize", json={"tokens": [5, 10 ** 9]})
    assert response.status_code == 400 and "vocabulary" in response.json()["error"]["message"]
