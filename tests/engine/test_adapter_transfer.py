"""An adapter's weights packed into one shared-memory buffer for the engine-core process come out as they went in."""
from __future__ import annotations

import pickle

import torch
from multiprocessing.reduction import ForkingPickler

from adapters_registry import load_adapter
from engine.adapter_transfer import pack_adapter, unpack_adapter
from tests.tiny_models import make_peft_adapter


def _loaded(tiny_llama, tmp_path, llama_engine, **kwargs):
    path = make_peft_adapter(tiny_llama, tmp_path / "adapter", seed=5, **kwargs)
    return load_adapter(path, llama_engine.model_info, dtype=torch.bfloat16)


def test_unpacked_weights_equal_the_loaded_ones(tiny_llama, tmp_path, llama_engine):
    adapter = _loaded(tiny_llama, tmp_path, llama_engine, r=4, rank_pattern={"q_proj": 8})
    unpacked = unpack_adapter(pickle.loads(ForkingPickler.dumps(pack_adapter(adapter))))
    assert unpacked.modules.keys() == adapter.modules.keys()
    for name, weights in adapter.modules.items():
        got = unpacked.modules[name]
        assert torch.equal(got.lora_a, weights.lora_a) and torch.equal(got.lora_b, weights.lora_b)
        assert got.lora_a.dtype == torch.bfloat16 and (got.rank, got.scaling) == (weights.rank, weights.scaling)
    assert (unpacked.rank, unpacked.target_modules, unpacked.nbytes) == (adapter.rank, adapter.target_modules,
                                                                         adapter.nbytes)


def test_the_weights_travel_as_one_shared_buffer(tiny_llama, tmp_path, llama_engine):
    packed = pack_adapter(_loaded(tiny_llama, tmp_path, llama_engine, r=4))
    assert packed.buffer.is_shared() and packed.adapter.modules == {}
    assert packed.buffer.numel() == sum(w.lora_a.numel() + w.lora_b.numel()
                                        for w in unpack_adapter(packed).modules.values())
