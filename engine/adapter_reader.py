"""Adapter weights read into host-pool rows by child processes instead of threads.

Each read makes about 1500 torch calls, and each call releases and retakes the GIL. On reader
threads that slows the engine thread's own Python, which is mostly kernel launches, while reads are
in flight (`benchmarks/reader_contention.py`). The children do the same work (`load_adapter`, then
`SlotLayout.write`) into the host pool, which lives in shared memory, so the engine's GIL is never
contended; several of them read several adapters at once, as the threads did. `submit` has the
thread pool's signature: the `LoRAManager` uses either. A child that dies (killed, out of memory) fails
the reads in flight, whose requests then fail with that error, and the children are started afresh.
"""
from __future__ import annotations

import contextlib
import itertools
import pickle
import queue
import signal
import sys
import threading
import time
import types
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.multiprocessing as mp

from adapters_registry import ModelInfo, check_adapter, load_adapter

from .lora_layout import SlotLayout


class ProcessReader:
    CLOSE_TIMEOUT_S = 5.0  # for all children together to finish their reads and exit, before they are killed
    MAX_RESTARTS = 3  # children that die again before any read completes: reading in processes is given up

    def __init__(self, pool: torch.Tensor, layout: SlotLayout, model_info: ModelInfo, allow_pickle: bool,
                 processes: int = 1):
        """pool: the host rows [rows, layout.numel], in shared memory (`Tensor.share_memory_`); its
        dtype is the one adapters are loaded in. processes: children reading at once, from one queue."""
        if not pool.is_shared():
            raise ValueError("the host pool must be in shared memory for a reader process to fill it")
        if processes < 1:
            raise ValueError(f"an adapter reader needs at least one process, got {processes}")
        self._args = (pool, layout, model_info, allow_pickle)
        self._count = processes
        self._futures: dict[int, Future] = {}
        self._lock = threading.Lock()  # the futures, the state below, and the queues and children a restart replaces
        self._ids = itertools.count()
        self._closing = False
        self._broken: BaseException | None = None  # why reads can no longer be served, once they cannot
        self._restarts = 0  # since the last read that completed
        self._ready = threading.Event()  # every child of the latest start has said "ready"
        self._start_children()  # their imports take seconds: the engine goes on starting meanwhile
        self._listener = threading.Thread(target=self._listen, name="lora-reader-results", daemon=True)
        self._listener.start()

    def _start_children(self) -> None:
        self._ready.clear()
        self._ready_count = 0
        context = mp.get_context("spawn")
        self._jobs = context.SimpleQueue()
        self._results = context.Queue()
        self._processes = [context.Process(target=_serve, name=f"lora-reader-{i}", daemon=True,
                                           args=(*self._args, self._jobs, self._results))
                           for i in range(self._count)]
        with _main_module_hidden():
            for process in self._processes:
                process.start()

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Block until every child has imported what it needs, which they started doing at construction;
        raise if they cannot start (they keep exiting) or, with a timeout, are not ready by then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if self._broken is not None:
                raise RuntimeError(f"the adapter reader could not start: {self._broken}")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"adapter reader processes were not ready after {timeout} s")

    def submit(self, path: str | Path, row: int) -> Future:
        """Read the adapter at `path` into pool row `row`; the future completes, with the row's rank, once the row
        is written."""
        return self._put(str(path), row)

    def check(self, path: str | Path) -> Future:
        """`check_adapter` on the adapter at `path` in a child: the future completes (with None) once it passes,
        or fails with why not. Several checks run at once, one a child (the check is Python-bound: 1-2 ms an
        adapter of Llama-3-8B's shapes, most of it parsing the weight file's header)."""
        return self._put(str(path), None)

    def _put(self, path: str, row: int | None) -> Future:
        future: Future = Future()
        with self._lock:
            if self._broken is not None:
                future.set_exception(self._broken)
                return future
            job = next(self._ids)
            self._futures[job] = future
            self._jobs.put((job, path, row))
        return future

    def close(self) -> None:
        """Stop the children (reads in flight get CLOSE_TIMEOUT_S to finish); futures still pending fail."""
        with self._lock:
            self._closing = True
            processes, jobs, results = self._processes, self._jobs, self._results
        self._stop_children(processes, jobs)
        results.put(None)  # after every child's answers: each flushed them before it exited
        self._listener.join(timeout=10)

    def _stop_children(self, processes: list, jobs) -> None:
        """Ask each child to exit after its read; kill those still there at the deadline, or at once if one
        died (it may have held the job queue's lock, so the others would never get their request)."""
        if all(process.is_alive() for process in processes):
            for _ in processes:
                jobs.put(None)
            deadline = time.monotonic() + self.CLOSE_TIMEOUT_S
            for process in processes:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=self.CLOSE_TIMEOUT_S)

    def _listen(self) -> None:
        """Resolve the futures from the children's answers, and restart the children when one dies. Any
        failure here fails every pending read and every later one, rather than leaving them to hang."""
        try:
            while True:
                dead = next((p for p in self._processes if not p.is_alive()), None)
                if dead is not None and not self._restart(dead):
                    break
                try:
                    message = self._results.get(timeout=0.5)
                except queue.Empty:
                    continue
                if message is None:
                    break
                if message == "ready":  # a child has imported what it needs
                    with self._lock:
                        self._ready_count += 1
                        if self._ready_count == self._count:
                            self._ready.set()
                    continue
                job, rank, error = message
                with self._lock:
                    future = self._futures.pop(job, None)
                    self._restarts = 0
                if future is not None:
                    future.set_result(rank) if error is None else future.set_exception(error)
        except BaseException as exc:  # the listener must not die silently: see the docstring
            self._give_up(RuntimeError(f"the adapter reader failed: {type(exc).__name__}: {exc}"))
            return
        self._give_up(RuntimeError("the adapter reader process stopped"))

    def _restart(self, dead: mp.Process) -> bool:
        """A child died (killed, out of memory). It may have died holding the job queue's lock, so every
        child and both queues are replaced; the reads in flight fail (those already answered keep their answer),
        and later reads go to the new children.
        All under the lock, so no read is put on a queue nobody reads. False when the reader is closing, or
        its children died MAX_RESTARTS times in a row without a read completing."""
        with self._lock:
            if self._closing:
                return False
            pending, self._futures = self._futures, {}
            self._restarts += 1
            too_many = self._restarts > self.MAX_RESTARTS
            self._stop_children(self._processes, self._jobs)  # one is dead: the rest are killed at once
            answered = _drain(self._results)  # reads the others finished before they were killed
            if not too_many:
                self._start_children()
        error = RuntimeError(f"adapter reader process {dead.name} exited (code {dead.exitcode}) with reads in flight")
        for job, future in pending.items():
            rank, failure = answered.get(job, (None, error))
            if failure is None:
                future.set_result(rank)
            else:
                future.set_exception(failure)
        if too_many:
            self._give_up(RuntimeError(f"adapter reader processes keep exiting (last: {dead.name}, code "
                                       f"{dead.exitcode}); no more adapters can be read"))
        return not too_many

    def _take_pending(self) -> list[Future]:
        pending, self._futures = list(self._futures.values()), {}
        return pending

    def _give_up(self, error: BaseException) -> None:
        """Fail every pending read and every later one with `error`."""
        with self._lock:
            if self._broken is None:
                self._broken = error
            pending = self._take_pending()
        for future in pending:
            future.set_exception(error)


def _drain(results) -> dict[int, tuple[int | None, BaseException | None]]:
    """The answers (job -> (rank, None) or (None, error)) already in a results queue, without waiting for more."""
    answered = {}
    while True:
        try:
            message = results.get(timeout=0.1)
        except queue.Empty:
            return answered
        if isinstance(message, tuple):
            job, rank, error = message
            answered[job] = rank, error


@contextlib.contextmanager
def _main_module_hidden():
    """Spawned children re-import the parent's main script unless it was started with -m: one without an
    `if __name__ == "__main__":` guard (an offline script building an `LLM`) would then run again in every
    child. The children run `_serve` from this module and need nothing of __main__, so it is hidden from
    multiprocessing while they start."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _serve(pool: torch.Tensor, layout: SlotLayout, model_info: ModelInfo, allow_pickle: bool,
           jobs, results) -> None:
    """A child's loop: one job at a time, a read into a row or a check (row None), each answered with (job, the
    row's rank or None, None) or (job, None, the error). Ctrl-C is the parent's to handle: the parent closes the
    reader as it shuts down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    results.put("ready")
    while (job := jobs.get()) is not None:
        job_id, path, row = job
        try:
            if row is None:
                check_adapter(path, model_info, allow_pickle=allow_pickle)
                results.put((job_id, None, None))
                continue
            rank = layout.write(load_adapter(path, model_info, allow_pickle=allow_pickle, dtype=pool.dtype), pool[row])
            results.put((job_id, rank, None))
        except Exception as exc:  # any failure of one read is that read's answer
            results.put((job_id, None, _sendable(exc)))


def _sendable(exc: Exception) -> Exception:
    """The error itself when it survives pickling both ways (AdapterError does), else a RuntimeError that
    says what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # unpicklable exceptions come in many kinds
        return RuntimeError(f"{type(exc).__name__}: {exc}")
