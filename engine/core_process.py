"""The engine core in a process of its own (vLLM v1's EngineCore process), and what crosses its pipe.

The server's event loop frames and sends an SSE event per token per stream. In one process it shares the GIL with
the engine thread, whose host work for the next step then waits for it: at a full batch that cost the server
6-16% of the engine's own throughput on the H200. Here the engine thread has a process, and a GIL, to itself: it
steps the batch, runs the commands the client sends between steps, and sends each step's outputs back as deltas.
"""
from __future__ import annotations

import logging
import pickle
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from .adapter_transfer import PackedAdapter, unpack_adapter
from .config import EngineConfig
from .engine_loop import Delivery, EngineLoop
from .gc_heap import freeze_startup_heap
from .llm_engine import LLMEngine
from .output_delta import DeltaEncoder, OutputDelta

LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"  # the server's, so both processes' lines read alike


@dataclass
class EngineInfo:
    """What the client serves from without asking the engine: fixed once the engine is built."""

    tokenizer: Any
    model_name: str
    max_model_len: int
    model_info: Any
    config: EngineConfig
    dtype: torch.dtype
    device: torch.device


@dataclass
class Ready:
    info: EngineInfo


@dataclass
class StartFailed:
    error: BaseException


@dataclass
class Call:
    call_id: int
    method: str  # one of EngineCore.METHODS
    args: tuple


@dataclass
class Reply:
    call_id: int
    value: Any = None
    error: BaseException | None = None


@dataclass
class Outputs:
    """One step's: the requests that moved, and those that failed (already aborted in the engine)."""

    deltas: list[OutputDelta]
    errors: list[tuple[str, BaseException]]


@dataclass
class Shutdown:
    pass


def incoming(conn: Connection) -> Iterator[Any]:
    """Each message from the other end, until it closes its end of the pipe (or exits)."""
    while True:
        try:
            yield conn.recv()
        except (EOFError, OSError):
            return


def portable(error: BaseException) -> BaseException:
    """The error itself if it survives pickling (ValueError: the client's 400s need its type), else a RuntimeError
    that names it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


class EngineCore:
    """Serves one client over `conn`: its calls run on the engine thread between steps, in the order sent."""

    METHODS = ("add", "abort", "add_lora", "remove_lora", "lora_status", "stats")

    def __init__(self, engine: LLMEngine, conn: Connection):
        self.engine = engine
        self._conn = conn
        self._send_lock = threading.Lock()
        self._encoder = DeltaEncoder()  # used on the engine thread only
        self._loop = EngineLoop(engine, self._send_outputs)

    def serve(self) -> None:
        """Take calls until the client says Shutdown or goes away; then stop the engine."""
        try:
            for message in incoming(self._conn):
                if isinstance(message, Shutdown):
                    break
                self._loop.submit(lambda m=message: self._run(m)).add_done_callback(
                    lambda future, call_id=message.call_id: self._reply(call_id, future))
        finally:
            self._loop.stop()
            self.engine.close()

    def _run(self, call: Call) -> Any:
        if call.method not in self.METHODS:
            raise ValueError(f"the engine core has no method {call.method!r}")
        return getattr(self, "_" + call.method)(*call.args)

    def _add(self, request) -> None:
        request.add_to(self.engine)

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._encoder.forget(request_id)

    def _add_lora(self, lora_request, packed: PackedAdapter | None) -> None:
        self.engine.add_lora(lora_request, unpack_adapter(packed) if packed is not None else None)

    def _remove_lora(self, lora_int_id: int) -> None:
        self.engine.remove_lora(lora_int_id)

    def _lora_status(self) -> dict:
        return self.engine.lora_status()

    def _stats(self):
        return self.engine.stats()

    def _send_outputs(self, items: Delivery) -> None:
        deltas, errors = [], []
        for request_id, item in items:
            if isinstance(item, BaseException):
                self._encoder.forget(request_id)
                errors.append((request_id, portable(item)))
            else:
                deltas.append(self._encoder.encode(item))
        if deltas or errors:
            self._send(Outputs(deltas, errors))

    def _reply(self, call_id: int, future) -> None:
        error = future.exception()
        self._send(Reply(call_id, None, portable(error)) if error is not None else Reply(call_id, future.result()))

    def _send(self, message) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the client is gone: serve() sees its end of the pipe close
                pass


def _exit_cleanly(signum, frame) -> None:
    """SIGTERM: stop stepping, stop the engine's own processes, exit 0 (the client reports a shutdown, not a crash)."""
    raise SystemExit(0)


def run_engine_core(config: EngineConfig, conn: Connection, log_level: int) -> None:
    """The engine-core process's entry point: build the engine, say Ready (or why not), serve until told to stop."""
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole process group: the client stops us
    signal.signal(signal.SIGTERM, _exit_cleanly)  # as does a service manager's stop
    try:
        engine = LLMEngine(config)
    except Exception as exc:
        conn.send(StartFailed(portable(exc)))
        return
    info = EngineInfo(engine.tokenizer, engine.model_name, engine.max_model_len, engine.model_info, engine.config,
                      engine.dtype, engine.device)
    core = EngineCore(engine, conn)
    freeze_startup_heap()
    conn.send(Ready(info))
    core.serve()
