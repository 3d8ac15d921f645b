"""A registered adapter's weights live in the engine's host cache (at most max_cpu_loras of them), not in the
server's adapter table: a server given many adapters must not hold every one's weights."""
from __future__ import annotations

import gc
import weakref

from adapters_registry import AdapterRegistry, AdapterSpec
from adapters_registry import registry as registry_module
from openai_server.adapters import register_adapter
from tests.server.conftest import make_engine


def test_registering_adapters_keeps_no_copy_of_their_weights_outside_the_engine(model_dir, adapter_dirs,
                                                                              monkeypatch):
    loaded: list[weakref.ref] = []
    real_load = registry_module.load_adapter

    def recording_load(*args, **kwargs):
        weights = real_load(*args, **kwargs)
        loaded.append(weakref.ref(weights))
        return weights

    monkeypatch.setattr(registry_module, "load_adapter", recording_load)
    engine = make_engine(model_dir, max_loras=1, max_cpu_loras=1)
    try:
        registry = AdapterRegistry(engine.model_info)
        for name, path in adapter_dirs.items():
            register_adapter(engine, registry, AdapterSpec(name, str(path)))
        gc.collect()
        assert len(loaded) == len(adapter_dirs) > 1
        assert [ref() for ref in loaded] == [None] * len(loaded)
        assert len(registry) == len(adapter_dirs)
    finally:
        engine.shutdown()
