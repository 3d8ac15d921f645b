"""The adapter table: eager, all-or-nothing registration, fresh int ids, thread safety."""
import logging
import shutil
import threading

import pytest
import torch

from adapters_registry import AdapterError, AdapterNotFoundError, AdapterRegistry, AdapterSpec
from tests.tiny_models import make_peft_adapter


@pytest.fixture
def registry(model_info):
    return AdapterRegistry(model_info)


def test_register_loads_eagerly_and_describes_the_adapter(registry, good_adapter):
    entry, weights = registry.register(AdapterSpec("pirate", str(good_adapter), base_model_name="tiny"))
    assert (entry.name, entry.int_id, entry.source) == ("pirate", 1, str(good_adapter))
    assert entry.path == str(good_adapter.resolve())
    assert (entry.rank, entry.base_model_name, entry.revision) == (8, "tiny", None)
    assert entry.target_modules == weights.target_modules
    assert len(weights.modules) == 14
    assert entry.load_seconds > 0 and entry.loaded_at > 0


def test_register_loads_the_weights_in_the_registrys_dtype(model_info, good_adapter):
    registry = AdapterRegistry(model_info, dtype=torch.bfloat16)
    _, weights = registry.register(AdapterSpec("pirate", str(good_adapter)))
    dtypes = {side.dtype for module in weights.modules.values() for side in (module.lora_a, module.lora_b)}
    assert dtypes == {torch.bfloat16}


def test_register_logs_tgi_loading_line(registry, good_adapter, caplog):
    with caplog.at_level(logging.INFO, logger="loraserve.adapters"):
        registry.register(AdapterSpec("pirate", str(good_adapter)))
    assert "Loading adapter weights into model: pirate" in caplog.text


def test_lookup_contains_and_len(registry, good_adapter):
    entry, _ = registry.register(AdapterSpec("pirate", str(good_adapter)))
    assert registry.lookup("pirate") is entry
    assert registry.lookup("sql") is None
    assert "pirate" in registry and "sql" not in registry
    assert len(registry) == 1


def test_list_is_in_registration_order(registry, good_adapter):
    for name in ["c", "a", "b"]:
        registry.register(AdapterSpec(name, str(good_adapter)))
    assert [e.name for e in registry.list()] == ["c", "a", "b"]


def test_duplicate_name_without_replace_is_refused(registry, good_adapter):
    registry.register(AdapterSpec("pirate", str(good_adapter)))
    with pytest.raises(ValueError, match="The lora adapter 'pirate' has already been loaded."):
        registry.register(AdapterSpec("pirate", str(good_adapter)))
    assert len(registry) == 1


def test_replace_gives_new_int_id_and_new_weights_in_the_same_place(registry, good_adapter, base_dir, tmp_path):
    registry.register(AdapterSpec("first", str(good_adapter)))
    old, _ = registry.register(AdapterSpec("pirate", str(good_adapter)))
    other = make_peft_adapter(base_dir, tmp_path / "other", r=4, seed=7)
    new, _ = registry.register(AdapterSpec("pirate", str(other)), replace=True)
    assert new.int_id == 3 and old.int_id == 2
    assert registry.lookup("pirate") is new and new.rank == 4
    assert [e.name for e in registry.list()] == ["first", "pirate"]


def test_replace_of_unknown_name_registers_it(registry, good_adapter):
    assert registry.register(AdapterSpec("pirate", str(good_adapter)), replace=True)[0].int_id == 1


def test_unregister_removes_and_returns_the_entry(registry, good_adapter):
    entry, _ = registry.register(AdapterSpec("pirate", str(good_adapter)))
    assert registry.unregister("pirate") is entry
    assert "pirate" not in registry


def test_unregister_unknown_name_is_key_error(registry):
    with pytest.raises(KeyError, match="pirate"):
        registry.unregister("pirate")


def test_int_ids_are_never_reused(registry, good_adapter):
    registry.register(AdapterSpec("a", str(good_adapter)))
    registry.unregister("a")
    assert registry.register(AdapterSpec("a", str(good_adapter)))[0].int_id == 2


def test_missing_path_is_not_found_and_leaves_table_unchanged(registry, good_adapter):
    registry.register(AdapterSpec("pirate", str(good_adapter)))
    with pytest.raises(AdapterNotFoundError):
        registry.register(AdapterSpec("ghost", "/no/such/adapter"))
    assert [e.name for e in registry.list()] == ["pirate"]


def test_invalid_adapter_leaves_table_unchanged_even_when_replacing(registry, good_adapter, tmp_path):
    entry, _ = registry.register(AdapterSpec("pirate", str(good_adapter)))
    broken = tmp_path / "broken"
    shutil.copytree(good_adapter, broken)
    (broken / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(AdapterError, match="corrupt or truncated"):
        registry.register(AdapterSpec("pirate", str(broken)), replace=True)
    assert registry.lookup("pirate") is entry and len(registry) == 1


def test_pickle_opt_in_is_passed_to_the_loader(model_info, good_adapter, tmp_path):
    from safetensors.torch import load_file

    adapter = tmp_path / "bin"
    adapter.mkdir()
    shutil.copy(good_adapter / "adapter_config.json", adapter)
    torch.save(load_file(str(good_adapter / "adapter_model.safetensors")), str(adapter / "adapter_model.bin"))
    with pytest.raises(AdapterError, match="pickle"):
        AdapterRegistry(model_info).register(AdapterSpec("bin", str(adapter)))
    assert AdapterRegistry(model_info, allow_pickle=True).register(AdapterSpec("bin", str(adapter)))[0].rank == 8


def test_concurrent_registration_gives_unique_ids_and_keeps_every_entry(registry, good_adapter):
    errors = []

    def work(i):
        try:
            registry.register(AdapterSpec(f"a{i}", str(good_adapter)))
            registry.lookup(f"a{i}")
            registry.list()
            if i % 2:
                registry.unregister(f"a{i}")
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(e.name for e in registry.list()) == sorted(f"a{i}" for i in range(0, 16, 2))
    assert len({e.int_id for e in registry.list()}) == 8


def test_concurrent_duplicate_registration_admits_exactly_one(registry, good_adapter):
    outcomes = []
    barrier = threading.Barrier(8)

    def work():
        barrier.wait()
        try:
            outcomes.append(registry.register(AdapterSpec("same", str(good_adapter)))[0].int_id)
        except ValueError as exc:
            outcomes.append(str(exc))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [o for o in outcomes if isinstance(o, int)]
    assert len(ids) == 1 and registry.lookup("same").int_id == ids[0]
    assert outcomes.count("The lora adapter 'same' has already been loaded.") == 7
