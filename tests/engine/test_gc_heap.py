"""The garbage collector around CUDA graph capture: nothing it frees may be a graph while one is captured."""
from __future__ import annotations

import gc

from engine.gc_heap import collector_paused


class _Cycle:
    """A reference cycle that records when the collector frees it (as an old engine's graphs would be)."""

    freed: list[str] = []

    def __init__(self, name: str):
        self.name, self.me = name, self

    def __del__(self):
        _Cycle.freed.append(self.name)


def test_garbage_from_before_is_collected_on_entry():
    _Cycle.freed.clear()
    _Cycle("old engine")
    with collector_paused():
        assert _Cycle.freed == ["old engine"]


def test_no_collection_runs_inside_even_past_the_thresholds():
    _Cycle.freed.clear()
    with collector_paused():
        for i in range(3 * gc.get_threshold()[0]):
            _Cycle(str(i))
        assert _Cycle.freed == []
    gc.collect()
    assert len(_Cycle.freed) == 3 * gc.get_threshold()[0]


def test_the_collector_is_enabled_again_after_and_left_off_if_it_was():
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
