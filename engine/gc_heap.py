"""Keeping the garbage collector out of the way: the start-up heap is frozen once it is built, and no
collection runs while CUDA graphs are captured."""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_startup_heap() -> None:
    """Take what start-up made (the model's modules, CUDA graphs, imported libraries: about 300k tracked
    objects with the embedded model) out of the cyclic garbage collector's reach. Otherwise, each time
    the collector scans the oldest generation while serving, it walks all of them and every request
    stalls; that takes 150 ms on a 2-core CPU machine with the embedded model
    (`benchmarks/gc_pause.py`). For a process that keeps its engine for its whole life, as the server
    does, nothing is lost; a process that drops an engine afterwards calls `gc.unfreeze()` first, or the
    engine's reference cycles are never collected. vLLM's engine core does the same."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection inside: one that frees an earlier engine's CUDA graphs while this one captures
    resets a graph mid-capture, which CUDA refuses, and the capture fails. Collected once before, as
    vLLM does around its captures."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
