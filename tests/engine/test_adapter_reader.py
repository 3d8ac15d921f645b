"""Adapter reads in a child process (`adapter_reader="process"`): same weights, same tokens, same errors."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from adapters_registry import AdapterError, load_adapter
from engine import LLM, EngineConfig, LoRARequest, SamplingParams
from engine.adapter_reader import ProcessReader
from engine.lora_layout import SlotLayout
from tests.engine.conftest import make_engine
from tests.tiny_models import make_peft_adapter

PARAMS = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = ["Hello world", "The capital of France is", "def add(a, b):", "SELECT name FROM"]


@pytest.fixture(scope="module")
def loras(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("reader-adapters")
    specs = [dict(r=8, seed=31), dict(r=4, target_modules=["q_proj", "v_proj"], seed=32), dict(r=16, seed=33)]
    return [LoRARequest(f"a{i}", i + 1, str(make_peft_adapter(tiny_llama, root / f"a{i}", **spec)))
            for i, spec in enumerate(specs)]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return make_engine(tiny_llama, enable_lora=True, max_loras=1, max_lora_rank=16)


def _row_the_engine_thread_would_write(engine, layout, path, dtype=torch.float32) -> torch.Tensor:
    row = torch.empty(layout.numel, dtype=dtype)
    layout.write(load_adapter(path, engine.model_info), row)
    return row


def test_the_child_process_writes_the_row_the_engine_thread_would(engine, loras):
    layout = SlotLayout(engine.model.lora_layers(), 16)
    pool = torch.full((2, layout.numel), float("nan")).share_memory_()
    reader = ProcessReader(pool, layout, engine.model_info, allow_pickle=False)
    try:
        reader.submit(loras[1].lora_path, 1).result(timeout=60)
    finally:
        reader.close()
    assert torch.equal(pool[1], _row_the_engine_thread_would_write(engine, layout, loras[1].lora_path))
    assert pool[0].isnan().all()


def test_a_childs_read_answers_with_the_rows_rank(engine, loras):
    layout = SlotLayout(engine.model.lora_layers(), 16)
    pool = torch.zeros((3, layout.numel)).share_memory_()
    reader = ProcessReader(pool, layout, engine.model_info, allow_pickle=False)
    try:
        ranks = [reader.submit(lora.lora_path, row).result(timeout=60) for row, lora in enumerate(loras)]
    finally:
        reader.close()
    assert ranks == [8, 4, 16]


def test_several_children_fill_their_rows_in_the_pools_dtype(engine, loras):
    layout = SlotLayout(engine.model.lora_layers(), 16)
    pool = torch.full((4, layout.numel), float("nan"), dtype=torch.bfloat16).share_memory_()
    reader = ProcessReader(pool, layout, engine.model_info, allow_pickle=False, processes=3)
    try:
        reads = [reader.submit(lora.lora_path, row) for row, lora in enumerate(loras)]
        for read in reads:
            read.result(timeout=60)
    finally:
        reader.close()
    for row, lora in enumerate(loras):
        expected = _row_the_engine_thread_would_write(engine, layout, lora.lora_path, torch.bfloat16)
        assert torch.equal(pool[row], expected)
    assert pool[3].isnan().all()


def test_a_failed_read_in_the_child_is_the_futures_error(engine, loras, tmp_path):
    layout = SlotLayout(engine.model.lora_layers(), 16)
    reader = ProcessReader(torch.zeros(1, layout.numel).share_memory_(), layout, engine.model_info, allow_pickle=False)
    try:
        with pytest.raises(AdapterError, match="adapter_config.json"):
            reader.submit(tmp_path, 0).result(timeout=60)
    finally:
        reader.close()


def test_a_childs_check_passes_a_good_adapter_and_fails_a_bad_one_with_its_error(engine, loras, tmp_path):
    layout = SlotLayout(engine.model.lora_layers(), 16)
    pool = torch.full((1, layout.numel), float("nan")).share_memory_()
    reader = ProcessReader(pool, layout, engine.model_info, allow_pickle=False)
    try:
        assert reader.check(loras[0].lora_path).result(timeout=60) is None
        with pytest.raises(AdapterError, match="adapter_config.json"):
            reader.check(tmp_path).result(timeout=60)
    finally:
        reader.close()
    assert pool.isnan().all()  # a check writes no row


@pytest.fixture
def checks_on_the_engine_thread(monkeypatch):
    """The adapters `check_adapter` checked in this process (the reader's children are processes of their own)."""
    import engine.lora_manager as lora_manager

    checked, original = [], lora_manager.check_adapter

    def check(path, model, **kwargs):
        checked.append(Path(path).name)
        return original(path, model, **kwargs)

    monkeypatch.setattr(lora_manager, "check_adapter", check)
    return checked


def process_reading_llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=1, max_lora_rank=16,
               adapter_reader="process")


def test_an_offline_batch_has_its_adapters_checked_in_the_reader_processes(tiny_llama, loras,
                                                                           checks_on_the_engine_thread):
    llm = process_reading_llm(tiny_llama)
    outputs = llm.generate(PROMPTS[:3], PARAMS, lora_request=loras, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8, 8]
    assert checks_on_the_engine_thread == []


def test_an_offline_batch_checked_in_processes_fails_with_its_first_bad_adapters_error(tiny_llama, loras, tmp_path,
                                                                                        checks_on_the_engine_thread):
    llm = process_reading_llm(tiny_llama)
    (tmp_path / "empty").mkdir()
    bad = [LoRARequest("empty", 11, str(tmp_path / "empty")), LoRARequest("missing", 12, str(tmp_path / "missing"))]
    with pytest.raises(AdapterError, match="empty"):
        llm.generate(PROMPTS[:4], PARAMS, lora_request=[loras[0], *bad, loras[1]], use_tqdm=False)
    assert checks_on_the_engine_thread == ["empty"]  # a failure is checked again here, and raised from here
    assert not llm.engine.has_unfinished_requests()
    known = llm.engine.lora_manager.known
    assert loras[0].lora_int_id in known and bad[0].lora_int_id not in known and loras[1].lora_int_id not in known


def test_one_adapter_id_naming_two_adapters_in_one_checked_batch_is_refused(tiny_llama, loras):
    """As if checked one by one: the adapters before the clash are known afterwards."""
    manager = process_reading_llm(tiny_llama).engine.lora_manager
    clash = LoRARequest("other", loras[0].lora_int_id, loras[1].lora_path)
    with pytest.raises(ValueError, match="already names adapter 'a0'"):
        manager.ensure_loaded([loras[0], loras[2], clash, loras[1]])
    assert {loras[0].lora_int_id, loras[2].lora_int_id} <= set(manager.known)
    assert loras[1].lora_int_id not in manager.known


@pytest.mark.parametrize("reader", ["threads", "process"])
def test_a_bad_adapter_before_an_unloaded_one_in_a_batch_fails_with_its_own_error(tiny_llama, loras, tmp_path, reader):
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=1, max_lora_rank=16,
              adapter_reader=reader)
    llm.engine.add_lora(loras[1])
    llm.engine.remove_lora(loras[1].lora_int_id)
    (tmp_path / "empty").mkdir()
    bad = LoRARequest("empty", 50, str(tmp_path / "empty"))
    with pytest.raises(AdapterError, match="adapter_config.json"):
        llm.engine.lora_manager.ensure_loaded([loras[0], bad, loras[1]])


def _kill_readers() -> None:
    import multiprocessing

    for child in multiprocessing.active_children():
        if child.name.startswith("lora-reader"):
            child.kill()


def test_the_children_start_without_holding_up_the_constructor_and_report_ready(engine):
    layout = SlotLayout(engine.model.lora_layers(), 16)
    started = time.monotonic()
    reader = ProcessReader(torch.zeros(1, layout.numel).share_memory_(), layout, engine.model_info,
                           allow_pickle=False, processes=2)
    try:
        constructed = time.monotonic() - started
        reader.wait_until_ready(timeout=120)
        ready = time.monotonic() - started
        assert constructed < ready / 2, "the constructor waited for the children's imports"
    finally:
        reader.close()


def test_children_that_die_at_start_fail_the_wait_for_them(engine, monkeypatch):
    monkeypatch.setattr(ProcessReader, "MAX_RESTARTS", 0)
    layout = SlotLayout(engine.model.lora_layers(), 16)
    reader = ProcessReader(torch.zeros(1, layout.numel).share_memory_(), layout, engine.model_info,
                           allow_pickle=False)
    try:
        _kill_readers()  # long before a child has imported torch
        with pytest.raises(RuntimeError, match="could not start"):
            reader.wait_until_ready(timeout=60)
    finally:
        reader.close()


def test_a_read_around_a_childs_death_never_hangs_and_the_reader_reads_on(engine, loras):
    """Killed while idle, the child may hold the job queue's lock; whether the read submitted right after is
    failed (it was in flight when the death was seen) or served by the new children, it ends, and so does
    the next one."""
    layout = SlotLayout(engine.model.lora_layers(), 16)
    pool = torch.zeros(2, layout.numel).share_memory_()
    reader = ProcessReader(pool, layout, engine.model_info, allow_pickle=False)
    try:
        _kill_readers()
        around = reader.submit(loras[1].lora_path, 0)
        try:
            around.result(timeout=60)
        except RuntimeError as exc:
            assert "exited" in str(exc) and "with reads in flight" in str(exc)
        reader.submit(loras[0].lora_path, 1).result(timeout=60)
    finally:
        reader.close()
    assert torch.equal(pool[1], _row_the_engine_thread_would_write(engine, layout, loras[0].lora_path))


def test_children_that_keep_dying_fail_every_later_read_at_once(engine, loras, monkeypatch):
    monkeypatch.setattr(ProcessReader, "MAX_RESTARTS", 0)
    layout = SlotLayout(engine.model.lora_layers(), 16)
    reader = ProcessReader(torch.zeros(1, layout.numel).share_memory_(), layout, engine.model_info,
                           allow_pickle=False)
    try:
        _kill_readers()
        deadline = time.monotonic() + 30
        while (read := reader.submit(loras[0].lora_path, 0)).exception(timeout=30) is None:
            assert time.monotonic() < deadline, "the reader never gave up"
        assert "keep exiting" in str(read.exception()) or "exited" in str(read.exception())
        assert "keep exiting" in str(reader.submit(loras[0].lora_path, 0).exception(timeout=0))
    finally:
        reader.close()


def test_an_error_that_does_not_unpickle_is_sent_as_a_runtime_error():
    from engine.adapter_reader import _sendable

    class TwoArguments(Exception):
        def __init__(self, what, why):
            super().__init__(f"{what}: {why}")

    sent = _sendable(TwoArguments("read", "broken"))
    assert type(sent) is RuntimeError and "TwoArguments: read: broken" in str(sent)


def test_a_script_without_a_main_guard_runs_once_with_reader_processes(tiny_llama, loras, tmp_path):
    """Spawned children would re-import the user's main script; the reader hides it from them."""
    import subprocess
    import sys

    script = tmp_path / "offline.py"
    script.write_text(
        "import sys\n"
        "from engine import LLM, LoRARequest, SamplingParams\n"
        "print('top level ran', flush=True)\n"
        "llm = LLM(sys.argv[1], dtype='float32', device='cpu', enable_lora=True, max_loras=1, max_lora_rank=16,\n"
        "          adapter_reader='process')\n"
        "outputs = llm.generate(['Hello'], SamplingParams(temperature=0, max_tokens=2),\n"
        "                       lora_request=[LoRARequest('a', 1, sys.argv[2])], use_tqdm=False)\n"
        "print('generated', len(outputs[0].outputs[0].token_ids), flush=True)\n")
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(script), str(tiny_llama), loras[0].lora_path], cwd=repo,
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("top level ran") == 1
    assert "generated 2" in done.stdout


def test_the_reader_needs_a_shared_pool(engine):
    layout = SlotLayout(engine.model.lora_layers(), 16)
    with pytest.raises(ValueError, match="shared memory"):
        ProcessReader(torch.zeros(1, layout.numel), layout, engine.model_info, allow_pickle=False)


def test_the_reader_needs_a_process(engine):
    layout = SlotLayout(engine.model.lora_layers(), 16)
    with pytest.raises(ValueError, match="at least one process"):
        ProcessReader(torch.zeros(1, layout.numel).share_memory_(), layout, engine.model_info, allow_pickle=False,
                      processes=0)


def test_an_engine_reading_in_a_process_gives_the_threads_tokens(tiny_llama, loras):
    requests = [loras[i % 3] if i % 4 else None for i in range(8)]
    prompts = [PROMPTS[i % 4] for i in range(8)]
    outputs = {}
    for reader in ("threads", "process"):
        llm = LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=1, max_lora_rank=16,
                  adapter_reader=reader)
        outputs[reader] = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, lora_request=requests,
                                                                        use_tqdm=False)]
        assert llm.engine.stats().lora_disk_reads >= 3
    assert outputs["process"] == outputs["threads"]


def test_a_file_broken_after_the_check_fails_only_its_requests_in_process_mode(tiny_llama, loras, tmp_path):
    import shutil

    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16,
              adapter_reader="process")
    engine = llm.engine
    copy = tmp_path / "broken"
    shutil.copytree(loras[0].lora_path, copy)
    broken = LoRARequest("broken", 50, str(copy))
    good = engine.add_request(PROMPTS[0], PARAMS, loras[1])
    doomed = engine.add_request(PROMPTS[1], PARAMS, broken)
    (Path(copy) / "adapter_model.safetensors").write_bytes(b"gone")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    errors = engine.take_errors()
    assert set(errors) == {doomed}
    assert isinstance(errors[doomed], AdapterError) and "corrupt or truncated" in str(errors[doomed])
    assert good in finished
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_a_cpu_engine_reads_on_threads_by_default(tiny_llama):
    assert not make_engine(tiny_llama, enable_lora=True).lora_manager.reads_in_process


def _manager(engine, read_in_process, **kwargs):
    from engine.lora_manager import LoRAManager

    return LoRAManager(engine.model, engine.model_info, max_loras=1, max_lora_rank=16, max_cpu_loras=2,
                       device=torch.device("cpu"), dtype=torch.float32, read_in_process=read_in_process, **kwargs)


def test_reader_processes_are_refused_without_room_in_shared_memory(engine, monkeypatch):
    monkeypatch.setattr("engine.lora_manager.shared_memory_free", lambda: 1024)
    with pytest.raises(RuntimeError, match=r"does not fit in the free shared memory \(/dev/shm"):
        _manager(engine, read_in_process=True)


def test_adapters_transformed_per_rank_are_read_on_threads_even_with_room_for_processes(engine):
    manager = _manager(engine, read_in_process=None, adapter_transform=lambda adapter: adapter)
    assert not manager.reads_in_process


def test_auto_reads_on_threads_when_shared_memory_has_no_room(engine, monkeypatch, caplog):
    monkeypatch.setattr("engine.lora_manager.shared_memory_free", lambda: 1024)
    manager = _manager(engine, read_in_process=None)
    assert not manager.reads_in_process
    assert "does not fit in the shared memory" in caplog.text


@pytest.mark.parametrize("overrides, message", [
    (dict(adapter_reader="fork"), "adapter_reader must be"),
    (dict(adapter_reader="process", tensor_parallel_size=2), "tensor parallelism"),
])
def test_bad_adapter_reader_settings_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**overrides)


@pytest.mark.parametrize("reader", ["threads", "process"])
def test_each_slot_carries_the_rank_of_the_adapter_loaded_into_it(tiny_llama, loras, reader):
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16,
              adapter_reader=reader)
    manager = llm.engine.lora_manager
    assert manager.slot_ranks.on_device.tolist() == manager.slot_ranks.on_host == [0, 0]
    for lora, rank in zip(loras, [8, 4, 16]):
        llm.generate([PROMPTS[0]], PARAMS, lora_request=lora, use_tqdm=False)
        slot = manager.slot_owner.index(lora.lora_int_id)
        assert manager.slot_ranks.on_device[slot].item() == manager.slot_ranks.on_host[slot] == rank
