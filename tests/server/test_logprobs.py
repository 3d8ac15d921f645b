"""Engine logprobs in OpenAI's two shapes, and exact token bytes for byte-level tokenizers."""
from __future__ import annotations

import math

import pytest

from engine import Logprob
from openai_server.logprobs import MIN_LOGPROB, LogprobFormatter
from tests.tiny_models import make_tokenizer


@pytest.fixture(scope="module")
def formatter(tmp_path_factory):
    return LogprobFormatter(make_tokenizer(tmp_path_factory.mktemp("tok")))


def test_token_bytes_rebuild_multibyte_text(formatter):
    text = "Zürich, 東京 and 🙂"
    ids = formatter.tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(bytes(formatter.bytes(i)) for i in ids) == text.encode("utf-8")


def test_completion_shape_with_a_prompt_position_without_logprobs(formatter):
    a, b, c = formatter.tokenizer.encode("Hello world", add_special_tokens=False)[:3]
    shaped = formatter.completion([a, b], [None, {c: Logprob(-0.1, 1), b: Logprob(-3.0, 9)}], top_k=1, offset=5)
    assert shaped["token_logprobs"] == [None, -3.0]
    assert shaped["top_logprobs"][0] is None
    assert shaped["top_logprobs"][1] == {formatter.text(c): -0.1, formatter.text(b): -3.0}  # top 1 plus chosen
    assert shaped["text_offset"] == [5, 5 + len(formatter.text(a))]


def test_chat_shape_sorts_top_and_clamps_minus_infinity(formatter):
    a, b, c = formatter.tokenizer.encode("Hello world", add_special_tokens=False)[:3]
    [entry] = formatter.chat([a], [{a: Logprob(-math.inf), b: Logprob(-0.5), c: Logprob(-0.2)}], top_k=2)
    assert entry["logprob"] == MIN_LOGPROB
    assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.2, -0.5]
    assert entry["bytes"] == list(formatter.text(a).encode("utf-8"))
