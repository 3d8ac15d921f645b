"""Request bodies: what is accepted, what is refused, and how refusals read."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from openai_server.errors import from_validation_error
from openai_server.protocol import ChatCompletionRequest, CompletionRequest, TGIGenerateRequest


@pytest.mark.parametrize(
    "prompt, expected",
    [("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1, 2], [3]], [[1, 2], [3]])],
    ids=["string", "strings", "token_ids", "token_id_lists"],
)
def test_completion_prompt_forms(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompts() == expected


def test_null_fields_take_their_defaults():
    request = CompletionRequest.model_validate({"prompt": "x", "max_tokens": None, "n": None, "stream": None})
    assert (request.max_tokens, request.n, request.stream) == (16, 1, False)


def test_unknown_fields_are_ignored():
    assert CompletionRequest.model_validate({"prompt": "x", "something_new": 1}).prompt == "x"


@pytest.mark.parametrize(
    "body, message",
    [
        ({"prompt": "x", "suffix": "y"}, "suffix is not supported"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options can only be set"),
        ({"prompt": []}, "prompt must not be empty"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
    ],
    ids=["suffix", "stream_options", "empty_prompt", "best_of"],
)
def test_refused_completion_bodies_explain_why(body, message):
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate(body)
    error = from_validation_error(caught.value)
    assert error.status == 400 and message in error.message and not error.message.startswith("Value error")


def test_field_error_names_the_field():
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate({"prompt": "x", "temperature": -1})
    error = from_validation_error(caught.value)
    assert error.param == "temperature" and error.message.startswith("temperature:")


def test_chat_text_parts_are_joined_for_the_template():
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    )
    assert request.messages[0].as_template_input() == {"role": "user", "content": "a\nb"}


def test_chat_non_text_parts_are_refused_by_name():
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
        )
    error = from_validation_error(caught.value)
    assert error.param == "messages.0.content" and "'image_url' is not supported" in error.message


def test_chat_max_completion_tokens_wins_over_max_tokens():
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 7}
    )
    assert request.requested_max_tokens() == 7


@pytest.mark.parametrize(
    "extra",
    [{"top_logprobs": 2}, {"response_format": {"type": "json_object"}}, {"messages": []}],
    ids=["top_logprobs_without_logprobs", "json_mode", "no_messages"],
)
def test_refused_chat_bodies(extra):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **extra})


def test_tgi_defaults_are_greedy_without_adapter():
    params = TGIGenerateRequest(inputs="x").parameters
    assert (params.adapter_id, params.do_sample, params.max_new_tokens) == (None, False, 100)
