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

import itertools
import pickle
import queue
import threading
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.multiprocessing as mp

from adapters_registry import ModelInfo, load_adapter

from .lora_layout import SlotLayout


class ProcessReader:
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
        self._lock = threading.Lock()  # the futures, and the queues and children a restart replaces
        self._ids = itertools.count()
        self._closing = False
        self._start_children()
        for _ in self._processes:
            self._wait_until_ready()
        self._listener = threading.Thread(target=self._listen, name="lora-reader-results", daemon=True)
        self._listener.start()

    def _start_children(self) -> None:
        context = mp.get_context("spawn")
        self._jobs = context.SimpleQueue()
        self._results = context.Queue()
        self._processes = [context.Process(target=_serve, name=f"lora-reader-{i}", daemon=True,
                                           args=(*self._args, self._jobs, self._results))
                           for i in range(self._count)]
        for process in self._processes:
            process.start()

    def _wait_until_ready(self) -> None:
        """One child's "ready". Their imports take seconds: pay them while the engine starts, not in its
        first reads."""
        while True:
            try:
                self._results.get(timeout=1.0)
                return
            except queue.Empty:
                for process in self._processes:
                    if not process.is_alive():
                        self._stop_children()
                        raise RuntimeError(f"an adapter reader process exited at start (code {process.exitcode})")

    def submit(self, path: str | Path, row: int) -> Future:
        """Read the adapter at `path` into pool row `row`; the future completes once the row is written."""
        future: Future = Future()
        with self._lock:
            job = next(self._ids)
            self._futures[job] = future
            self._jobs.put((job, str(path), row))
        return future

    def close(self) -> None:
        """Stop the children (reads in flight finish first); futures still pending fail."""
        self._closing = True
        self._stop_children()
        self._results.put(None)  # after every child's answers: each flushed them before it exited
        self._listener.join(timeout=10)

    def _stop_children(self) -> None:
        for process in self._processes:
            if process.is_alive():
                self._jobs.put(None)
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()

    def _listen(self) -> None:
        while True:
            try:
                message = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = next((p for p in self._processes if not p.is_alive()), None)
                if dead is not None and not self._closing:
                    self._restart(dead)
                continue
            if message is None:
                break
            if message == "ready":  # a child started by a restart
                continue
            job, error = message
            with self._lock:
                future = self._futures.pop(job)
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
        self._fail_pending(RuntimeError("the adapter reader process stopped"))

    def _restart(self, dead: mp.Process) -> None:
        """A child died (killed, out of memory). It may have died holding the job queue's lock, so every
        child and both queues are replaced; the reads in flight fail, and later reads go to the new children."""
        with self._lock:  # reads submitted from here on go to the new children
            old, lost = self._processes, self._take_pending()
            self._start_children()
        for process in old:
            process.kill()
            process.join()
        error = RuntimeError(f"adapter reader process {dead.name} exited (code {dead.exitcode}) with reads in flight")
        for future in lost:
            future.set_exception(error)

    def _take_pending(self) -> list[Future]:
        pending, self._futures = list(self._futures.values()), {}
        return pending

    def _fail_pending(self, error: Exception) -> None:
        with self._lock:
            pending = self._take_pending()
        for future in pending:
            future.set_exception(error)


def _serve(pool: torch.Tensor, layout: SlotLayout, model_info: ModelInfo, allow_pickle: bool,
           jobs, results) -> None:
    """A child's loop: one read at a time, each answered with (job, None) or (job, the error)."""
    torch.set_num_threads(1)
    results.put("ready")
    while (job := jobs.get()) is not None:
        job_id, path, row = job
        try:
            layout.write(load_adapter(path, model_info, allow_pickle=allow_pickle, dtype=pool.dtype), pool[row])
            results.put((job_id, None))
        except Exception as exc:  # any failure of one read is that read's answer
            results.put((job_id, _sendable(exc)))


def _sendable(exc: Exception) -> Exception:
    """The error itself when it pickles (AdapterError does), else a RuntimeError that says what it was."""
    try:
        pickle.dumps(exc)
        return exc
    except Exception:  # unpicklable exceptions come in many kinds
        return RuntimeError(f"{type(exc).__name__}: {exc}")
