"""Body parsing, SSE responses and client-disconnect handling shared by the handlers."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import APIError, bad_request, error_body, from_validation_error

logger = logging.getLogger("loraserve.server")
Body = TypeVar("Body", bound=BaseModel)


async def parse_body(request: Request, model: type[Body]) -> Body:
    """The JSON body validated against `model`; anything wrong is a 400 naming the field."""
    raw = await request.body()
    try:
        data = json.loads(raw or b"null")
        if b"\\u" in raw:  # an escape may be a lone surrogate, which JSON allows and UTF-8 (the tokenizer's) does not
            json.dumps(data, ensure_ascii=False).encode("utf-8")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("The request body is not valid JSON: it is nested too deeply.") from None
    except UnicodeEncodeError:
        raise bad_request("The request body holds a lone UTF-16 surrogate escape (\\ud800 to \\udfff), "
                          "which is not text.") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def dumps(payload: object) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def sse_data(payload: object) -> bytes:
    """One SSE frame, `data: <JSON>\n\n`, framed here: handed bytes, sse-starlette builds no event object per
    token (JSON text holds no line breaks, so one `data:` line carries it)."""
    return b"data: " + dumps(payload).encode() + b"\n\n"


_DONE = b"data: [DONE]\n\n"


async def with_openai_framing(events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """JSON events, an in-band error if one happens after the stream began, then `[DONE]`."""
    try:
        async for event in events:
            yield sse_data(event)
    except APIError as exc:
        yield sse_data(exc.body())
    except Exception:
        logger.exception("Error while streaming a response")
        yield sse_data(error_body("Internal server error while generating.", 500))
    yield _DONE


def sse_response(events: AsyncIterator[bytes], on_disconnect: Callable[[], Awaitable[None]]) -> Response:
    """Streams `events`, SSE frames (`sse_data`); a client that goes away triggers `on_disconnect` (aborting its
    requests)."""

    async def closed(_message) -> None:
        await on_disconnect()

    return EventSourceResponse(events, sep="\n", client_close_handler_callable=closed)


T = TypeVar("T")


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`, cancelling it if the client disconnects first (then None: nobody is listening)."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return task.result() if not task.cancelled() else None


def client_gone() -> Response:
    """The answer to a request whose client disconnected first (nginx's 499): nobody reads it."""
    return Response(status_code=499)


async def json_unless_disconnected(request: Request, work: Awaitable[dict]) -> Response:
    """`work`'s answer as JSON, or `client_gone()` when the client disconnects first (`work` is cancelled)."""
    body = await unless_disconnected(request, work)
    return JSONResponse(body) if body is not None else client_gone()
