"""SSE framing of OpenAI streams: JSON events, in-band errors once a stream has begun, `[DONE]` last."""
from __future__ import annotations

import json

import pytest

from openai_server.errors import APIError
from openai_server.httputil import sse_data, with_openai_framing


def _payload(frame: bytes) -> str:
    """The data of one SSE frame, which must be a single `data:` line."""
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    body = frame[len(b"data: "):-2]
    assert b"\n" not in body and b"\r" not in body
    return body.decode()


async def _collect(events) -> list[str]:
    return [_payload(frame) async for frame in with_openai_framing(events)]


async def _events_then(error: Exception):
    yield {"n": 1}
    raise error


@pytest.mark.anyio
async def test_events_end_with_done():
    async def events():
        yield {"n": 1}
        yield {"n": 2}

    assert await _collect(events()) == ['{"n":1}', '{"n":2}', "[DONE]"]


@pytest.mark.anyio
async def test_api_error_after_start_goes_in_band_then_done():
    sent = await _collect(_events_then(APIError("adapter went away", 404, param="model")))
    assert sent[0] == '{"n":1}' and sent[-1] == "[DONE]"
    assert json.loads(sent[1])["error"] == {"message": "adapter went away", "type": "not_found_error", "param": "model", "code": None}


@pytest.mark.anyio
async def test_unexpected_error_is_reported_without_internals():
    sent = await _collect(_events_then(RuntimeError("engine secret state")))
    error = json.loads(sent[1])["error"]
    assert error["type"] == "server_error" and "secret" not in error["message"]
    assert sent[-1] == "[DONE]"


def test_text_with_line_breaks_stays_one_data_line():
    event = {"text": "one\ntwo\r\nthree\u2028four"}
    assert json.loads(_payload(sse_data(event))) == event
