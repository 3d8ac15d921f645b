"""Prompts are tokenized, and chat templates rendered, on the engine's tokenizer thread: a multi-megabyte prompt then
holds up neither the event loop (every client's responses) nor the engine thread (every running stream)."""
from __future__ import annotations

import threading

import pytest

import openai_server.chat


@pytest.fixture
def tokenizing_threads(server, monkeypatch) -> list[str]:
    """The names of the threads that tokenize prompts and render chat templates, while the fixture lasts."""
    names: list[str] = []
    engine = server.engine.engine
    tokenize, render = engine.tokenize, openai_server.chat.render_chat

    def recorded(fn):
        def run(*args, **kwargs):
            names.append(threading.current_thread().name)
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(engine, "tokenize", recorded(tokenize))
    monkeypatch.setattr(openai_server.chat, "render_chat", recorded(render))
    return names


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "Hello world", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 2}),
    ("/generate", {"inputs": "Hello world", "parameters": {"max_new_tokens": 2}}),
], ids=["completions", "chat", "tgi"])
def test_prompts_are_tokenized_on_the_tokenizer_thread(http, tokenizing_threads, route, body):
    assert http.post(route, json=body).status_code == 200
    assert tokenizing_threads and all(name.startswith("loraserve-tokenizer") for name in tokenizing_threads)
