"""Engine requests as the handlers use them: started eagerly, tracked, merged, and aborted when abandoned."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import anyio
from starlette.requests import Request

from .errors import bad_request
from .httputil import unless_disconnected
from .metrics import RequestTracker


class Generation:
    """One engine request whose first output has already arrived.

    Starting eagerly means validation errors (a prompt past the context window, a bad parameter) surface
    before any response is sent, so they become a 400 rather than an in-band stream error. Leaving the
    iteration early, for any reason, aborts the engine request so its KV blocks and adapter are freed.
    """

    def __init__(self, engine, request_id: str, stream, first, tracker: RequestTracker) -> None:
        self.engine = engine
        self.request_id = request_id
        self._stream = stream
        self._first = first
        self._tracker = tracker
        self._closed = False
        self.last = first

    @classmethod
    async def start(cls, engine, prompt, params, lora_request, request_id: str, tracker: RequestTracker) -> Generation:
        try:
            stream = engine.generate(prompt, params, lora_request=lora_request, request_id=request_id)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        try:
            first = await stream.__anext__()
        except ValueError as exc:
            await stream.aclose()
            raise bad_request(str(exc)) from None
        except BaseException:
            await stream.aclose()
            await _abort(engine, request_id)
            raise
        tracker.observe(_num_generated(first))
        return cls(engine, request_id, stream, first, tracker)

    async def __aiter__(self) -> AsyncIterator:
        try:
            yield self._first
            while not self.last.finished:
                try:
                    self.last = await self._stream.__anext__()
                except StopAsyncIteration:  # the engine ended it (aborted) without a final output
                    return
                self._tracker.observe(_num_generated(self.last))
                yield self.last
        finally:
            await self.close()

    async def abort(self) -> None:
        """Abort the engine request; safe while another task is iterating (that iteration then ends)."""
        await _abort(self.engine, self.request_id)

    async def close(self) -> None:
        """Record the request's end; abort it in the engine if it had not finished. Call once iteration stopped."""
        if self._closed:
            return
        self._closed = True
        finished = self.last.finished
        if not finished:
            await self._stream.aclose()
            await _abort(self.engine, self.request_id)
        reason = (self.last.outputs[0].finish_reason if finished else None) or "abort"
        longest = max(len(completion.token_ids) for completion in self.last.outputs)
        self._tracker.finish(reason, len(self.last.prompt_token_ids), _num_generated(self.last), longest)


def _num_generated(output) -> int:
    return sum(len(completion.token_ids) for completion in output.outputs)


def usage(finals: list) -> dict:
    """OpenAI's usage object over the final outputs of one HTTP request's engine requests."""
    return usage_of(sum(len(out.prompt_token_ids) for out in finals), sum(_num_generated(out) for out in finals))


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _abort(engine, request_id: str) -> None:
    with anyio.CancelScope(shield=True):
        await engine.abort(request_id)


async def start_all(engine, prompts, params, lora_request, request_ids, trackers) -> list[Generation]:
    """Start several engine requests concurrently; if one fails, or the caller is cancelled (its client went away
    while they were queued), abort them all and re-raise."""
    tasks = [asyncio.ensure_future(Generation.start(engine, p, params, lora_request, rid, t))
             for p, rid, t in zip(prompts, request_ids, trackers)]
    try:
        await asyncio.wait(tasks)
    except BaseException:
        await _close_all(tasks)
        raise
    errors = [task.exception() for task in tasks if task.exception() is not None]
    if errors:
        await _close_all(tasks)
        raise errors[0]
    return [task.result() for task in tasks]


async def start_for_client(request: Request, state, prompts, params, lora_request,
                           request_ids: list[str]) -> list[Generation] | None:
    """start_all, each request counted by the metrics, cancelled (its requests aborted) if the client disconnects
    while they are queued: None then."""
    trackers = [state.metrics.tracker(lora_request) for _ in prompts]
    return await unless_disconnected(request, start_all(state.engine, prompts, params, lora_request, request_ids,
                                                        trackers))


async def _close_all(tasks: list[asyncio.Future]) -> None:
    """Cancel the starts still waiting (each aborts its engine request) and close the generations already started."""
    for task in tasks:
        task.cancel()
    with anyio.CancelScope(shield=True):
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if not task.cancelled() and task.exception() is None:
                await task.result().close()


async def merge(generations: list[Generation]) -> AsyncIterator[tuple[int, object]]:
    """Interleave the outputs of several generations as they arrive, tagged with the generation's index."""
    if len(generations) == 1:  # most requests: no task and queue between the engine's stream and the handler
        outputs = aiter(generations[0])
        try:
            async for output in outputs:
                yield 0, output
        finally:
            with anyio.CancelScope(shield=True):
                await outputs.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for output in generation:
                await queue.put((index, output, None))
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put((index, None, exc))
            return
        await queue.put((index, None, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            index, output, error = await queue.get()
            if error is not None:
                raise error
            if output is None:
                remaining -= 1
                continue
            yield index, output
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


async def abort_all(generations: list[Generation]) -> None:
    for generation in generations:
        await generation.abort()
