"""Chat rendering: the tokenizer's template, an operator's override (file or text), and clean refusals."""
from __future__ import annotations

import pytest

from openai_server.chat_template import load_chat_template, render_chat
from openai_server.errors import APIError
from tests.tiny_models import make_tokenizer

OVERRIDE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
MESSAGES = [{"role": "user", "content": "Hello world"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def _render(tokenizer, template=None, **kwargs) -> str:
    options = {"add_generation_prompt": True, "continue_final_message": False, "template_kwargs": None, **kwargs}
    return tokenizer.decode(render_chat(tokenizer, MESSAGES, chat_template=template, **options))


def test_the_tokenizer_template_adds_the_generation_prompt(tokenizer):
    assert _render(tokenizer) == "<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n"


def test_an_override_template_replaces_the_tokenizers(tokenizer):
    assert _render(tokenizer, OVERRIDE) == "[user] Hello world\n"


def test_override_is_read_from_a_file_relative_to_a_base_dir(tmp_path):
    (tmp_path / "chat.jinja").write_text(OVERRIDE)
    assert load_chat_template("chat.jinja", tmp_path) == OVERRIDE
    assert load_chat_template(OVERRIDE) == OVERRIDE


def test_a_missing_template_file_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="neither a readable file nor a Jinja template"):
        load_chat_template("missing.jinja", tmp_path)


def test_a_template_that_raises_is_a_bad_request(tokenizer):
    with pytest.raises(APIError) as caught:
        _render(tokenizer, "{{ raise_exception('roles must alternate') }}")
    assert caught.value.status == 400 and "roles must alternate" in caught.value.message


def test_a_model_without_template_asks_for_one(tmp_path):
    bare = make_tokenizer(tmp_path)
    bare.chat_template = None
    with pytest.raises(APIError, match="--chat-template"):
        _render(bare)
