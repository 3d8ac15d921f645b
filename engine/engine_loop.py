"""The engine's own thread: commands run between steps, and each step's outputs go to one sink.

Every change to engine state (add, abort, adapter load/unload) is queued as a command and run on this thread
between steps, so the engine itself needs no locks. The in-process AsyncEngine runs one, and so does the
engine-core process behind EngineCoreClient.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from .llm_engine import LLMEngine
from .outputs import RequestOutput

logger = logging.getLogger("loraserve.engine")

# each item: a request's newest output, or the error that ended it
Delivery = list[tuple[str, RequestOutput | BaseException]]


class EngineStopped(RuntimeError):
    """The engine was shut down (or its process ended) before the command or request could finish."""


class EngineLoop:
    def __init__(self, engine: LLMEngine, deliver: Callable[[Delivery], None]):
        self.engine = engine
        self._deliver = deliver
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._wakeup = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="loraserve-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def on_engine_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Queue fn to run on the engine thread between steps; its future holds the result or the error."""
        future: Future = Future()
        with self._wakeup:
            if self._stopped:
                future.set_exception(EngineStopped("the engine has been shut down"))
                return future
            self._commands.append((fn, future))
            self._wakeup.notify()
        return future

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread between steps and wait for its result."""
        if self.on_engine_thread():
            return fn()
        return self.submit(fn).result()

    def stop(self) -> None:
        """Stop stepping; commands still queued fail with EngineStopped (their callers would otherwise wait)."""
        with self._wakeup:
            self._stopped = True
            self._wakeup.notify()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while not self._stopped and not self._commands and not self.engine.has_unfinished_requests():
                    self._wakeup.wait()
                commands, self._commands = self._commands, deque()
                if self._stopped:
                    break
            _run_commands(commands)
            if self.engine.has_unfinished_requests():
                self._step()
        stopped = EngineStopped("the engine has been shut down")
        for _, future in commands:
            if future.set_running_or_notify_cancel():
                future.set_exception(stopped)

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
        items: Delivery = [(output.request_id, output) for output in outputs]
        items.extend(self.engine.take_errors().items())
        self._deliver(items)


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
