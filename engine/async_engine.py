"""An asyncio front for the engine: one background thread steps the batch; callers stream outputs.

Every change to engine state (add, abort, adapter load/unload) is queued as a command and run on
the engine thread between steps, so the engine itself needs no locks.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from .config import EngineConfig
from .llm_engine import EngineStats, LLMEngine
from .lora_request import LoRARequest
from .outputs import RequestOutput
from .sampling_params import SamplingParams, bad_words_token_ids

logger = logging.getLogger("loraserve.engine")
T = TypeVar("T")


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, *, engine: LLMEngine | None = None, **config_kwargs):
        self.engine = engine or LLMEngine(config or EngineConfig(**config_kwargs))
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._wakeup = threading.Condition()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraserve-tokenizer")
        self._thread = threading.Thread(target=self._loop, name="loraserve-engine", daemon=True)
        self._thread.start()

    # ---- what the server reads ------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_info(self):
        return self.engine.model_info

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def stats(self) -> EngineStats:
        return self.call(self.engine.stats)

    def lora_status(self) -> dict:
        return self.call(self.engine.lora_status)

    def add_lora(self, lora_request: LoRARequest, adapter=None) -> None:
        self.call(lambda: self.engine.add_lora(lora_request, adapter))

    def remove_lora(self, lora_int_id: int) -> None:
        self.call(lambda: self.engine.remove_lora(lora_int_id))

    # ---- requests -------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                       lora_request: LoRARequest | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        request_id = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        text = prompt if isinstance(prompt, str) else None
        bad_words = sampling_params.bad_words if sampling_params is not None else []
        bad_word_ids = None
        if text is not None or bad_words:
            prompt, bad_word_ids = await self.run_tokenizer(lambda: (
                self.engine.tokenize(text) if text is not None else prompt,
                bad_words_token_ids(bad_words, self.engine.tokenizer)))

        def add() -> None:
            self.engine.add_request(prompt, sampling_params, lora_request, request_id, prompt_text=text,
                                    bad_word_ids=bad_word_ids)
            self._streams[request_id] = (loop, queue)

        finished = False
        try:
            await asyncio.wrap_future(self._submit(add))  # inside: a caller cancelled once the add ran aborts it
            while not finished:
                item = await queue.get()
                while not queue.empty() and not isinstance(item, BaseException):
                    item = queue.get_nowait()  # outputs are cumulative: the later one holds the earlier one's tokens
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._submit(lambda: self._abort(request_id))

    async def run_tokenizer(self, fn: Callable[[], T]) -> T:
        """Run tokenizer work (a prompt's encoding, a chat template) on the tokenizer thread, as vLLM tokenizes in a
        thread of its own: a long prompt then holds up neither the event loop nor the steps of running requests."""
        return await asyncio.wrap_future(self._tokenizer_thread.submit(fn))

    async def abort(self, request_id: str) -> None:
        await asyncio.wrap_future(self._submit(lambda: self._abort(request_id)))

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread between steps and wait for its result."""
        if threading.current_thread() is self._thread:
            return fn()
        return self._submit(fn).result()

    def shutdown(self) -> None:
        with self._wakeup:
            self._stopped = True
            self._wakeup.notify()
        self._thread.join(timeout=30)
        self._tokenizer_thread.shutdown(wait=False)
        self.engine.close()

    # ---- the engine thread ----------------------------------------------------------------
    def _submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        with self._wakeup:
            if self._stopped:
                future.set_exception(RuntimeError("the engine has been shut down"))
                return future
            self._commands.append((fn, future))
            self._wakeup.notify()
        return future

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort(request_id)

    def _loop(self) -> None:
        while True:
            with self._wakeup:
                while not self._stopped and not self._commands and not self.engine.has_unfinished_requests():
                    self._wakeup.wait()
                commands, self._commands = self._commands, deque()
                if self._stopped:
                    break
            self._run_commands(commands)
            if self.engine.has_unfinished_requests():
                self._step()
        shut_down = RuntimeError("the engine has been shut down")
        for _, future in commands:  # queued when it stopped: their callers get the error rather than wait forever
            if future.set_running_or_notify_cancel():
                future.set_exception(shut_down)
        self._deliver([(request_id, shut_down) for request_id in list(self._streams)])

    @staticmethod
    def _run_commands(commands: deque[tuple[Callable[[], Any], Future]]) -> None:
        """Run each command and let go of it, so nothing one captured (an adapter's weights) outlives its run."""
        while commands:
            fn, future = commands.popleft()
            if not future.set_running_or_notify_cancel():
                continue  # its caller gave up before it ran (a cancelled generate(): nothing was added)
            try:
                future.set_result(fn())
            except BaseException as exc:  # the caller gets it
                future.set_exception(exc)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; aborting the running requests")
            failed = list(self.engine.requests)
            for request_id in failed:
                self.engine.abort(request_id)
            self._deliver([(request_id, RuntimeError(f"engine step failed: {exc}")) for request_id in failed])
            return
        items: list[tuple[str, RequestOutput | BaseException]] = [(output.request_id, output) for output in outputs]
        items.extend(self.engine.take_errors().items())
        self._deliver(items)

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand each item to its stream, one wake-up per event loop for the lot: a step's outputs for a full batch
        cost the engine thread one call into each loop, not one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | BaseException]]] = {}
        for request_id, item in items:
            finished = isinstance(item, BaseException) or item.finished
            target = self._streams.pop(request_id, None) if finished else self._streams.get(request_id)
            if target is not None:
                loop, queue = target
                by_loop.setdefault(loop, []).append((queue, item))
        for loop, deliveries in by_loop.items():
            loop.call_soon_threadsafe(_put_all, deliveries)


def _put_all(deliveries: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in deliveries:
        queue.put_nowait(item)
