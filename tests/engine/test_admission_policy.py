"""The scheduler's admission orders: fcfs (the engine's and the server's default) and balanced (adapters picked to
fill slots and batch; the offline `LLM`'s default); and when admission is blocked on adapter slots, so that a decode
step needs no admission pass."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.kv_cache import BlockAllocator
from engine.scheduler import Scheduler
from tests.engine.conftest import make_engine, run_to_completion

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(rank4_adapters):
    return rank4_adapters


def balanced_engine(tiny_llama, adapters, **overrides):
    """An engine admitting in the balanced order, every adapter already in its host cache (read now, so
    admission never waits for a background read)."""
    engine = make_engine(tiny_llama, enable_lora=True, max_lora_rank=4, max_cpu_loras=len(adapters),
                         admission_order="balanced", **overrides)
    for lora in adapters:
        engine.lora_manager.add(lora)
    return engine


def running_adapters(engine) -> list[str]:
    return sorted(seq.request.lora_request.lora_name for seq in engine.scheduler.running)


def test_fcfs_is_the_default_order():
    assert Scheduler(BlockAllocator(4), 16, 4, 64).admission_order == "fcfs"


def test_an_unknown_order_is_refused():
    with pytest.raises(ValueError, match="admission_order"):
        Scheduler(BlockAllocator(4), 16, 4, 64, admission_order="random")


def test_balanced_gives_the_slots_to_the_adapters_that_fill_the_batch(tiny_llama, adapters):
    """Two slots, four sequences: A, C, then three for B. Arrival order would pin A and C and run two
    sequences; balanced pins A and B and runs four."""
    a, b, c = adapters
    engine = balanced_engine(tiny_llama, adapters, max_loras=2, max_num_seqs=4)
    for lora in (a, c, b, b, b):
        engine.add_request("Hello", PARAMS, lora)
    engine.step()
    assert running_adapters(engine) == [a.lora_name, b.lora_name, b.lora_name, b.lora_name]
    run_to_completion(engine)


def test_balanced_admits_a_resident_adapters_sequence_before_a_new_adapter(tiny_llama, adapters):
    """A runs in one of two slots with room for one more sequence; B arrived before A's second
    sequence, but A's needs no new slot."""
    a, b, _ = adapters
    engine = balanced_engine(tiny_llama, adapters, max_loras=2, max_num_seqs=2)
    engine.add_request("Hello", PARAMS, a)
    engine.step()
    engine.add_request("Hello", PARAMS, b)
    engine.add_request("Hello", PARAMS, a)
    engine.step()
    assert running_adapters(engine) == [a.lora_name, a.lora_name]
    run_to_completion(engine)


def test_balanced_reads_ahead_the_waiting_adapter_with_the_most_sequences_first(tiny_llama, adapters):
    """A holds the only slot; C's one sequence arrived before B's two, neither adapter read yet, and one read may
    be in flight. B is the one the slot goes to once free, so B's read goes first."""
    a, b, c = adapters
    engine = make_engine(tiny_llama, enable_lora=True, max_lora_rank=4, max_cpu_loras=len(adapters), max_loras=1,
                         admission_order="balanced")
    engine.lora_manager.MAX_READS_IN_FLIGHT = 1
    engine.add_request("Hello", PARAMS, a)
    while not engine.scheduler.running:  # A's own read, then its slot
        engine.step()
    for lora in (c, b, b):
        engine.add_request("Hello", PARAMS, lora)
    engine.step()
    manager = engine.lora_manager
    manager.wait_for_reads(timeout=None)
    manager.collect_reads()
    status = manager.status()
    assert (status[b.lora_int_id].in_cpu, status[c.lora_int_id].in_cpu) == (True, False)
    run_to_completion(engine)


def test_balanced_still_serves_a_starving_adapter(tiny_llama, adapters):
    """One slot, a stream of requests for A (resident, so always first in the balanced order), one request
    for B: the starvation guard still drains A's slot for B."""
    a, b, _ = adapters
    engine = balanced_engine(tiny_llama, adapters, max_loras=1)
    engine.add_request("Hello", PARAMS, a)
    starving = engine.add_request("Hello", PARAMS, b)
    finished = set()
    for step in range(400):
        if step % 2 == 0:
            engine.add_request("Hello", PARAMS, a)
        finished.update(output.request_id for output in engine.step() if output.finished)
        if starving in finished:
            break
    assert starving in finished
    run_to_completion(engine)


def test_a_drained_adapter_runs_again_once_the_starving_request_is_aborted(tiny_llama, adapters):
    """A's slot is drained for B's starving request; B's client goes away before B runs: A's next request runs."""
    a, b, _ = adapters
    engine = make_engine(tiny_llama, enable_lora=True, max_lora_rank=4, max_loras=1, max_cpu_loras=2)
    long_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("Hello", long_params, a)
    engine.step()
    starving = engine.add_request("Hello", PARAMS, b)
    while engine.scheduler.draining is None:
        engine.step()
    engine.abort(starving)
    following = engine.add_request("Hello", PARAMS, a)
    finished = set()
    for _ in range(200):  # bounded: before the fix, A's request waited for ever
        finished.update(output.request_id for output in engine.step() if output.finished)
    assert following in finished
    assert engine.scheduler.draining is None


def test_the_engine_config_refuses_an_unknown_admission_order():
    from engine import EngineConfig

    with pytest.raises(ValueError, match="admission_order must be one of fcfs, balanced"):
        EngineConfig(admission_order="lifo")


def test_the_engine_schedules_in_the_configured_admission_order(tiny_llama):
    engine = make_engine(tiny_llama, admission_order="balanced")
    assert engine.scheduler.admission_order == "balanced"


def test_offline_llm_admits_balanced_by_default_and_takes_another_order(tiny_llama):
    from engine import LLM

    assert LLM(str(tiny_llama), device="cpu").engine.scheduler.admission_order == "balanced"
    assert LLM(str(tiny_llama), device="cpu", admission_order="fcfs").engine.scheduler.admission_order == "fcfs"


def engine_with_full_slots(tiny_llama, adapters):
    """Two slots, both held by running sequences (adapters A and B), and the engine between steps."""
    a, b, _ = adapters
    engine = make_engine(tiny_llama, enable_lora=True, max_lora_rank=4, max_loras=2, max_cpu_loras=len(adapters))
    for lora in adapters:
        engine.lora_manager.add(lora)
    for lora in (a, b):
        engine.add_request("Hello", PARAMS, lora)
    engine.step()
    return engine


def test_admission_is_blocked_while_every_slot_holds_a_running_adapter(tiny_llama, adapters):
    engine = engine_with_full_slots(tiny_llama, adapters)
    engine.add_request("Hello", PARAMS, adapters[2])
    assert engine.scheduler.admission_blocked()
    run_to_completion(engine)


@pytest.mark.parametrize("waiting_on", ["resident adapter", "base model"])
def test_a_sequence_that_needs_no_new_slot_unblocks_admission(tiny_llama, adapters, waiting_on):
    engine = engine_with_full_slots(tiny_llama, adapters)
    engine.add_request("Hello", PARAMS, adapters[0] if waiting_on == "resident adapter" else None)
    assert not engine.scheduler.admission_blocked()
    assert engine.scheduler.schedule_decode() is None
    run_to_completion(engine)


def test_a_decode_step_with_blocked_admission_counts_the_waiting_as_skipped(tiny_llama, adapters):
    """What schedule()'s admission pass does for sequences it cannot admit, so the starvation guard
    sees the same count whichever way the step was scheduled."""
    engine = engine_with_full_slots(tiny_llama, adapters)
    engine.add_request("Hello", PARAMS, adapters[2])
    waiting = engine.scheduler.waiting[0]
    plan = engine.scheduler.schedule_decode()
    assert [item.seq for item in plan.scheduled] == engine.scheduler.running
    assert waiting.skipped_steps == 1
    run_to_completion(engine)


def test_an_adapter_taking_a_slot_from_starving_ones_admits_all_its_waiting_sequences(tiny_llama, adapters):
    """One slot, five requests each for three adapters arriving in turn: the starvation guard hands the slot on,
    but each adapter that gets it runs all its waiting requests, so the slot is loaded once per adapter (it used
    to drain at once for the next starving adapter, and the slot served one request per load)."""
    engine = make_engine(tiny_llama, enable_lora=True, max_lora_rank=4, max_loras=1, max_cpu_loras=3)
    for lora in adapters:
        engine.lora_manager.add(lora)
    for _ in range(5):
        for lora in adapters:
            engine.add_request("Hello", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), lora)
    outputs = run_to_completion(engine)
    assert len(outputs) == 15
    assert engine.lora_manager.slot_loads == 3
