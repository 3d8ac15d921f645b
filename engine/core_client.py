"""The asyncio front for an engine core in its own process (core_process.py): what `loraserve serve` drives on a GPU.

Calls go down one pipe in the order made, and the engine core answers on another thread of ours, which also
rebuilds each step's cumulative outputs from their deltas and hands them to the streams. Should the process die,
every stream and pending call fails with EngineStopped, and `alive` turns false (the server's /health says 503).
"""
from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing
import threading
import weakref
from concurrent.futures import Future
from multiprocessing.connection import Connection

import torch

from adapters_registry import LoadedAdapter

from .adapter_transfer import pack_adapter
from .async_engine import AsyncEngine, AsyncEngineBase, NewRequest
from .config import EngineConfig
from .core_process import (
    Call, EngineInfo, Outputs, Ready, Reply, Shutdown, StartFailed, incoming, run_engine_core,
)
from .engine_loop import EngineStopped
from .llm_engine import EngineStats, resolve_device
from .lora_request import LoRARequest
from .output_delta import DeltaDecoder

logger = logging.getLogger("loraserve.engine")

JOIN_TIMEOUT_S = 30.0
ENGINE_CORES = ("auto", "process", "thread")


def start_async_engine(config: EngineConfig, engine_core: str = "auto") -> AsyncEngineBase:
    """The engine the server drives: in a process of its own, or on a thread of this one. auto: a process on one GPU
    (where the HTTP layer's share of the GIL cost throughput); a thread on the CPU (where the engine's intra-op threads
    in a process of their own competed with the server's for the cores, and were slower) and with tensor parallelism
    (whose workers have not been run from an engine-core process yet)."""
    if engine_core not in ENGINE_CORES:
        raise ValueError(f"engine_core must be one of {', '.join(ENGINE_CORES)}, not {engine_core!r}")
    if engine_core == "auto":
        on_one_gpu = resolve_device(config.device).type == "cuda" and config.tensor_parallel_size == 1
        engine_core = "process" if on_one_gpu else "thread"
    return EngineCoreClient(config) if engine_core == "process" else AsyncEngine(config)


class EngineCoreClient(AsyncEngineBase):
    def __init__(self, config: EngineConfig):
        super().__init__()
        context = multiprocessing.get_context("spawn")
        self._conn, theirs = context.Pipe()
        # not a daemon: the engine starts processes of its own (adapter readers, tensor-parallel workers)
        self._process = context.Process(target=run_engine_core, name="loraserve-engine-core",
                                        args=(config, theirs, logging.getLogger().getEffectiveLevel()))
        self._process.start()
        theirs.close()
        self._stopping = threading.Event()  # set once we ask it to stop: its end is then no crash
        self._finalizer = weakref.finalize(self, _stop, self._process, self._conn, self._stopping)
        # at exit, before multiprocessing's own hook waits for its children, this one among them
        atexit.register(self._finalizer)
        self._stop_lock = threading.Lock()  # whoever stops the process second waits until it is reaped
        try:
            info = self._wait_until_ready()
        except BaseException:  # it failed, or the wait was cut short (Ctrl-C during a long start): nothing to wait for
            self._process.kill()
            self._stop_process()
            raise
        self.tokenizer = info.tokenizer
        self.model_name: str = info.model_name
        self.max_model_len: int = info.max_model_len
        self.model_info = info.model_info
        self.config: EngineConfig = info.config
        self.dtype: torch.dtype = info.dtype
        self.device: torch.device = info.device
        self._decoder = DeltaDecoder()  # used on the reader thread only
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._send_lock = threading.Lock()
        self._stopped: EngineStopped | None = None
        self._reader = threading.Thread(target=self._read, name="loraserve-engine-client", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._stopped is None

    def stats(self) -> EngineStats:
        return self._call("stats").result()

    def lora_status(self) -> dict:
        return self._call("lora_status").result()

    def add_lora(self, lora_request: LoRARequest, adapter: LoadedAdapter | None = None) -> None:
        self._call("add_lora", lora_request, pack_adapter(adapter) if adapter is not None else None).result()

    def remove_lora(self, lora_int_id: int) -> None:
        self._call("remove_lora", lora_int_id).result()

    def shutdown(self) -> None:
        self._stop_process()
        self._reader.join(timeout=JOIN_TIMEOUT_S)
        self._tokenizer_thread.shutdown(wait=False)

    # ---- requests -------------------------------------------------------------------------
    def _add(self, request: NewRequest) -> Future:
        return self._call("add", request)

    def _send_abort(self, request_id: str) -> Future:
        future = self._call("abort", request_id)
        # its reply comes after every output sent before the engine aborted it: the decoder's state can go then
        future.add_done_callback(lambda _: self._decoder.forget(request_id))
        return future

    def _call(self, method: str, *args) -> Future:
        future: Future = Future()
        with self._send_lock:
            if self._stopped is not None:
                future.set_exception(self._stopped)
                return future
            call_id = next(self._call_ids)
            self._calls[call_id] = future
            try:
                self._conn.send(Call(call_id, method, args))
            except (OSError, ValueError) as exc:
                del self._calls[call_id]
                future.set_exception(EngineStopped(f"the engine process is gone: {exc}"))
        return future

    def _stop_process(self) -> None:
        with self._stop_lock:
            self._finalizer()
        atexit.unregister(self._finalizer)

    def _wait_until_ready(self) -> EngineInfo:
        """Block until the engine is built (minutes for a large model on a GPU); its failure is raised here."""
        while not self._conn.poll(0.5):
            if not self._process.is_alive():
                break
        try:
            message = self._conn.recv() if self._conn.poll(1.0) else None
        except EOFError:
            message = None
        if isinstance(message, Ready):
            return message.info
        if isinstance(message, StartFailed):
            raise message.error
        self._process.join(JOIN_TIMEOUT_S)
        raise RuntimeError(f"the engine process exited with code {self._process.exitcode} before it was ready (a "
                           "script that starts one needs an `if __name__ == \"__main__\":` guard)")

    # ---- the reader thread ----------------------------------------------------------------
    def _read(self) -> None:
        try:
            for message in incoming(self._conn):
                if isinstance(message, Outputs):
                    self._take_outputs(message)
                elif isinstance(message, Reply):
                    future = self._calls.pop(message.call_id)
                    if message.error is not None:
                        future.set_exception(message.error)
                    else:
                        future.set_result(message.value)
        except Exception:
            logger.exception("the engine client could not read the engine's answer; stopping the engine")
        self._engine_gone()

    def _take_outputs(self, message: Outputs) -> None:
        items = [(delta.request_id, self._decoder.decode(delta)) for delta in message.deltas]
        for request_id, error in message.errors:
            self._decoder.forget(request_id)
            items.append((request_id, error))
        self._deliver(items)

    def _engine_gone(self) -> None:
        asked = self._stopping.is_set()  # (at interpreter exit the finalizer may be stopping it without our lock)
        self._stop_process()  # a process still running (the client broke, not the engine) is stopped
        self._process.join(JOIN_TIMEOUT_S)
        code = self._process.exitcode
        crashed = not asked and code != 0
        with self._send_lock:
            self._stopped = EngineStopped(f"the engine process exited with code {code}" if crashed else
                                          "the engine has been shut down")
            calls, self._calls = self._calls, {}
        if crashed:
            logger.error("%s: failing %d pending calls and every running request", self._stopped, len(calls))
        for future in calls.values():
            future.set_exception(self._stopped)
        self._fail_all_streams(self._stopped)


def _stop(process: multiprocessing.Process, conn: Connection, stopping: threading.Event) -> None:
    """Ask the engine core to stop, then make sure it has (also at interpreter exit, for a client never shut down)."""
    stopping.set()
    try:
        conn.send(Shutdown())
    except (OSError, ValueError):
        pass
    process.join(JOIN_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join()
