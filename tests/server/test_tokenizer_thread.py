"""Prompts are tokenized, and chat templates rendered, on the engine's tokenizer thread: a multi-megabyte prompt then
holds up neither the event loop (every client's responses) nor the engine thread (every running stream)."""
from __future__ import annotations

import threading

import pytest

import engine.async_engine as engine_async
import openai_server.chat


@pytest.fixture
def tokenizing_threads(server, monkeypatch) -> list[str]:
    """The names of the threads that tokenize prompts and bad words and render chat templates, while the fixture
    lasts."""
    names: list[str] = []
    engine = server.engine.engine

    def recorded(fn):
        def run(*args, **kwargs):
            names.append(threading.current_thread().name)
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(engine, "tokenize", recorded(engine.tokenize))
    monkeypatch.setattr(openai_server.chat, "render_chat", recorded(openai_server.chat.render_chat))
    monkeypatch.setattr(engine_async, "bad_words_token_ids", recorded(engine_async.bad_words_token_ids))
    return names


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "Hello world", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 2}),
    ("/generate", {"inputs": "Hello world", "parameters": {"max_new_tokens": 2}}),
], ids=["completions", "chat", "tgi"])
def test_prompts_are_tokenized_on_the_tokenizer_thread(http, tokenizing_threads, route, body):
    assert http.post(route, json=body).status_code == 200
    assert tokenizing_threads and all(name.startswith("loraserve-tokenizer") for name in tokenizing_threads)


def test_bad_words_are_tokenized_on_the_tokenizer_thread(http, tokenizing_threads):
    """Tens of thousands of bad words took seconds of the engine thread, stalling every stream."""
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "bad_words": ["hello", "world"]}
    assert http.post("/v1/completions", json=body).status_code == 200
    assert tokenizing_threads and all(name.startswith("loraserve-tokenizer") for name in tokenizing_threads)
