"""asyncio fronts for the engine: callers stream outputs while the engine steps elsewhere.

`AsyncEngine` steps the engine on a thread of this process; `EngineCoreClient` (core_client.py) in a process of its
own. Both tokenize on a tokenizer thread and hand each request's outputs to its caller's event loop the same way.
"""
from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .config import EngineConfig
from .engine_loop import Delivery, EngineLoop, EngineStopped
from .llm_engine import EngineStats, LLMEngine
from .lora_request import LoRARequest
from .model_loader import encode_prompt
from .outputs import RequestOutput
from .sampling_params import SamplingParams, bad_words_token_ids

T = TypeVar("T")


@dataclass
class NewRequest:
    """A request as the engine takes it: tokenized, with the text it was tokenized from (if any)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | None
    lora_request: LoRARequest | None
    prompt_text: str | None
    bad_word_ids: list[list[int]] | None

    def add_to(self, engine: LLMEngine) -> None:
        engine.add_request(self.prompt_token_ids, self.params, self.lora_request, self.request_id,
                           prompt_text=self.prompt_text, bad_word_ids=self.bad_word_ids)


class AsyncEngineBase:
    """What the server drives. Subclasses say where the engine runs: `_add` queues a request there, `_send_abort`
    aborts one; `_deliver` is how outputs come back."""

    tokenizer: Any

    def __init__(self) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._streams_lock = threading.Lock()
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraserve-tokenizer")

    def _tokenize(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text)

    def _add(self, request: NewRequest) -> Future:
        raise NotImplementedError

    def _send_abort(self, request_id: str) -> Future:
        raise NotImplementedError

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                       lora_request: LoRARequest | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        request_id = request_id or uuid.uuid4().hex
        text = prompt if isinstance(prompt, str) else None
        bad_words = sampling_params.bad_words if sampling_params is not None else []
        bad_word_ids = None
        if text is not None or bad_words:
            prompt, bad_word_ids = await self.run_tokenizer(lambda: (
                self._tokenize(text) if text is not None else prompt,
                bad_words_token_ids(bad_words, self.tokenizer)))
        queue: asyncio.Queue = asyncio.Queue()
        self._open_stream(request_id, asyncio.get_running_loop(), queue)
        finished = False
        try:
            # a caller cancelled once the add ran aborts it, below
            await asyncio.wrap_future(self._add(NewRequest(request_id, prompt, sampling_params, lora_request, text,
                                                           bad_word_ids)))
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
                self._close_stream(request_id, queue)
                self._send_abort(request_id)

    async def run_tokenizer(self, fn: Callable[[], T]) -> T:
        """Run tokenizer work (a prompt's encoding, a chat template) on the tokenizer thread, as vLLM tokenizes in a
        thread of its own: a long prompt then holds up neither the event loop nor the steps of running requests."""
        return await asyncio.wrap_future(self._tokenizer_thread.submit(fn))

    async def abort(self, request_id: str) -> None:
        await asyncio.wrap_future(self._send_abort(request_id))

    def _open_stream(self, request_id: str, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running")
            self._streams[request_id] = (loop, queue)

    def _close_stream(self, request_id: str, queue: asyncio.Queue) -> None:
        """Forget the stream reading `queue` (not another: its id may have been taken again since it finished)."""
        with self._streams_lock:
            target = self._streams.get(request_id)
            if target is not None and target[1] is queue:
                del self._streams[request_id]

    def _deliver(self, items: Delivery) -> None:
        """Hand each item to its stream, one wake-up per event loop for the lot: a step's outputs for a full batch
        cost one call into each loop, not one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | BaseException]]] = {}
        with self._streams_lock:
            for request_id, item in items:
                finished = isinstance(item, BaseException) or item.finished
                target = self._streams.pop(request_id, None) if finished else self._streams.get(request_id)
                if target is not None:
                    loop, queue = target
                    by_loop.setdefault(loop, []).append((queue, item))
        for loop, deliveries in by_loop.items():
            loop.call_soon_threadsafe(_put_all, deliveries)

    def _fail_all_streams(self, error: BaseException) -> None:
        with self._streams_lock:
            request_ids = list(self._streams)
        self._deliver([(request_id, error) for request_id in request_ids])


class AsyncEngine(AsyncEngineBase):
    """The engine on a thread of this process (commands between steps: see engine_loop.py)."""

    def __init__(self, config: EngineConfig | None = None, *, engine: LLMEngine | None = None, **config_kwargs):
        super().__init__()
        self.engine = engine or LLMEngine(config or EngineConfig(**config_kwargs))
        self._loop = EngineLoop(self.engine, self._deliver)

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

    @property
    def alive(self) -> bool:
        return self._loop.alive

    def stats(self) -> EngineStats:
        return self.call(self.engine.stats)

    def lora_status(self) -> dict:
        return self.call(self.engine.lora_status)

    def add_lora(self, lora_request: LoRARequest, adapter=None) -> None:
        self.call(lambda: self.engine.add_lora(lora_request, adapter))

    def remove_lora(self, lora_int_id: int) -> None:
        self.call(lambda: self.engine.remove_lora(lora_int_id))

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread between steps and wait for its result."""
        return self._loop.call(fn)

    def shutdown(self) -> None:
        self._loop.stop()
        self._fail_all_streams(EngineStopped("the engine has been shut down"))
        self._tokenizer_thread.shutdown(wait=False)
        self.engine.close()

    # ---- requests -------------------------------------------------------------------------
    def _tokenize(self, text: str) -> list[int]:
        return self.engine.tokenize(text)

    def _add(self, request: NewRequest) -> Future:
        return self._loop.submit(lambda: request.add_to(self.engine))

    def _send_abort(self, request_id: str) -> Future:
        return self._loop.submit(lambda: self.engine.abort(request_id))


def _put_all(deliveries: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in deliveries:
        queue.put_nowait(item)
