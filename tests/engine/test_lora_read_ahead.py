"""Reading adapters ahead of their slots (`LoRAManager.is_ready` with `pinnable=False`): into the host cache's free
room, or into the row of a copy that a slot has loaded since it was cached (the slot holds its own), but never over
a copy read ahead that no slot has loaded yet."""
from __future__ import annotations

import threading

import pytest
import torch

from engine import LoRARequest, SamplingParams
from engine.lora_manager import LoRAManager
from tests.engine.conftest import make_engine
from tests.tiny_models import make_peft_adapter


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("read-ahead-adapters")
    return [LoRARequest(f"r{i}", i + 1, str(make_peft_adapter(tiny_llama, root / f"r{i}", r=4, seed=60 + i)))
            for i in range(3)]


def _manager(tiny_llama) -> LoRAManager:
    """One slot, two host copies."""
    engine = make_engine(tiny_llama, enable_lora=True, max_loras=1, max_lora_rank=4)
    return LoRAManager(engine.model, engine.model_info, max_loras=1, max_lora_rank=4, max_cpu_loras=2,
                       device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture
def manager(tiny_llama, adapters) -> LoRAManager:
    """One slot, two host copies, the adapters known but none read."""
    manager = _manager(tiny_llama)
    manager.ensure_loaded(adapters)
    return manager


def _land_reads(manager: LoRAManager) -> None:
    while manager._reads:
        manager.wait_for_reads(timeout=None)
        manager.collect_reads()


def _read_ahead(manager: LoRAManager, lora: LoRARequest) -> None:
    """Ask for the adapter as a waiting request whose slot is not free would, and let any read it starts land."""
    assert not manager.is_ready(lora, pinnable=False)
    _land_reads(manager)


def test_a_full_host_cache_reads_ahead_into_the_row_of_a_copy_a_slot_has_loaded(manager, adapters):
    first, second, third = adapters
    _read_ahead(manager, first)
    manager.pin(first)  # its slot holds its own copy now
    _read_ahead(manager, second)
    _read_ahead(manager, third)
    status = manager.status()
    assert manager.disk_reads == 3
    assert (status[first.lora_int_id].slot, status[first.lora_int_id].in_cpu) == (0, False)
    assert status[second.lora_int_id].in_cpu and status[third.lora_int_id].in_cpu


def test_a_host_cache_full_of_copies_no_slot_has_loaded_reads_nothing_ahead(manager, adapters):
    first, second, third = adapters
    _read_ahead(manager, first)
    _read_ahead(manager, second)
    assert not manager.is_ready(third, pinnable=False)
    status = manager.status()
    assert manager.disk_reads == 2
    assert status[first.lora_int_id].in_cpu and status[second.lora_int_id].in_cpu
    assert not status[third.lora_int_id].in_cpu


def test_a_free_slot_still_reads_its_adapter_over_a_copy_no_slot_has_loaded(manager, adapters):
    first, second, third = adapters
    _read_ahead(manager, first)
    _read_ahead(manager, second)
    assert not manager.is_ready(third, pinnable=True)
    _land_reads(manager)
    assert manager.is_ready(third, pinnable=True)
    assert manager.disk_reads == 3
    assert not manager.status()[first.lora_int_id].in_cpu  # the least recently cached


def test_an_id_given_to_another_adapter_never_serves_the_old_adapters_late_read(manager, adapters, tiny_llama):
    first, second, _ = adapters
    release = threading.Event()
    read = manager._read
    manager._read = lambda lora, *args: (lora != first or release.wait()) and read(lora, *args)
    assert not manager.is_ready(first, pinnable=True)  # its read waits
    manager.remove(first.lora_int_id)
    other = LoRARequest(second.lora_name, first.lora_int_id, second.lora_path)
    manager.add(other)
    release.set()
    _land_reads(manager)
    fresh = _manager(tiny_llama)
    fresh.add(second)
    assert torch.equal(manager._pool[manager.host[other.lora_int_id]], fresh._pool[fresh.host[second.lora_int_id]])


def test_an_id_removed_while_its_requests_wait_cannot_be_added_again_with_other_weights(tiny_llama, adapters):
    """The waiting request was made for the first adapter: it must not run with the second one's weights."""
    first, second, _ = adapters
    engine = make_engine(tiny_llama, enable_lora=True, max_loras=1, max_lora_rank=4, max_num_seqs=1)
    engine.add_request([5] * 6, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), None)
    engine.step()
    waiting = engine.add_request([9] * 6, SamplingParams(temperature=0, max_tokens=4), first)
    engine.remove_lora(first.lora_int_id)
    other = LoRARequest(second.lora_name, first.lora_int_id, second.lora_path)
    with pytest.raises(ValueError, match="requests still use its old weights"):
        engine.add_lora(other)
    engine.abort(waiting)
    engine.add_lora(other)  # once the last request is gone, the id is free
    assert engine.lora_manager.known[first.lora_int_id] == other


def test_an_unloaded_adapter_read_back_for_a_waiting_request_goes_when_that_request_is_aborted(tiny_llama, adapters):
    first, second, _ = adapters
    engine = make_engine(tiny_llama, enable_lora=True, max_loras=1, max_lora_rank=4, max_cpu_loras=2)
    manager = engine.lora_manager
    engine.add_request([5] * 6, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), second)
    while not engine.scheduler.running:
        engine.step()
    waiting = engine.add_request([9] * 6, SamplingParams(temperature=0, max_tokens=4), first)
    engine.remove_lora(first.lora_int_id)
    engine.step()  # the waiting request reads its adapter ahead
    assert first.lora_int_id in manager._reads or first.lora_int_id in manager.host
    engine.abort(waiting)
    while engine.has_unfinished_requests():
        engine.step()
    manager.wait_for_reads(timeout=None)
    manager.collect_reads()
    assert first.lora_int_id not in manager.host and first.lora_int_id not in manager.status()
