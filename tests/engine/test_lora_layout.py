"""The slot layout: every projection's A and B in one row per slot, as the kernels and slot loads see it."""
from __future__ import annotations

import pytest
import torch

from adapters_registry import load_adapter
from engine.lora_layout import SlotLayout, SlotRanks
from tests.engine.conftest import make_engine
from tests.tiny_models import make_peft_adapter

MAX_RANK = 8


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return make_engine(tiny_llama, enable_lora=True, max_loras=2, max_lora_rank=MAX_RANK)


@pytest.fixture(scope="module")
def attention_r4(tiny_llama, tmp_path_factory):
    return make_peft_adapter(tiny_llama, tmp_path_factory.mktemp("r4") / "a", r=4, lora_alpha=8,
                             target_modules=["q_proj", "v_proj"], seed=21)


@pytest.fixture(scope="module")
def all_r8(tiny_llama, tmp_path_factory):
    return make_peft_adapter(tiny_llama, tmp_path_factory.mktemp("r8") / "a", r=8, lora_alpha=16, seed=22)


@pytest.fixture
def bound(engine):
    """A fresh 3-slot buffer (NaN until written) bound to the model (this module's engine serves nothing)."""
    layers = engine.model.lora_layers()
    layout = SlotLayout(layers, MAX_RANK)
    slots = torch.full((3, layout.numel), float("nan"))
    layout.bind(slots, layers)
    return layout, slots, layers


def _views(layers, module: str, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [max_rank, in], B [out, max_rank]) that the model reads for `module` in `slot`."""
    parent, name = module.rsplit(".", 1)
    for prefix, linear in layers.items():
        if prefix.rsplit(".", 1)[0] == parent and name in linear.names:
            i = linear.names.index(name)
            return linear.lora_a[i][slot], linear.lora_b[i][slot]
    raise KeyError(module)


def test_the_model_reads_an_adapter_where_write_lays_it_out(engine, bound, attention_r4):
    layout, slots, layers = bound
    adapter = load_adapter(attention_r4, engine.model_info)
    layout.write(adapter, slots[1])
    for module in engine.model_info.module_shapes:
        a, b = _views(layers, module, 1)
        weights = adapter.modules.get(module)
        if weights is None:
            assert not a.any() and not b.any(), module
            continue
        assert torch.equal(a[:4], weights.lora_a) and not a[4:].any()
        assert torch.equal(b[:, :4], weights.lora_b) and not b[:, 4:].any()


def test_writing_a_slot_leaves_the_other_slots_alone(engine, bound, all_r8):
    layout, slots, _ = bound
    layout.write(load_adapter(all_r8, engine.model_info), slots[1])
    assert slots[0].isnan().all() and slots[2].isnan().all()
    assert not slots[1].isnan().any()


def test_a_smaller_adapter_replaces_every_value_of_a_larger_one(engine, bound, all_r8, attention_r4):
    layout, slots, _ = bound
    layout.write(load_adapter(all_r8, engine.model_info), slots[0])
    layout.write(load_adapter(attention_r4, engine.model_info), slots[2])
    layout.write(load_adapter(attention_r4, engine.model_info), slots[0])
    assert torch.equal(slots[0], slots[2])


def test_the_slot_row_is_the_whole_adapter(engine, bound):
    layout, _, _ = bound
    shapes = engine.model_info.module_shapes.values()
    assert layout.numel == sum(MAX_RANK * (out_features + in_features) for out_features, in_features in shapes)


def test_write_returns_the_rows_rank_past_which_every_projection_is_zero(engine, bound, attention_r4, all_r8):
    layout, slots, _ = bound
    assert layout.write(load_adapter(attention_r4, engine.model_info), slots[0]) == 4
    assert layout.write(load_adapter(all_r8, engine.model_info), slots[1]) == 8


def test_a_rank_pattern_rows_rank_is_its_largest_module_rank(engine, bound, tmp_path, tiny_llama):
    layout, slots, _ = bound
    path = make_peft_adapter(tiny_llama, tmp_path / "a", r=2, rank_pattern={"o_proj": 6}, seed=23)
    assert layout.write(load_adapter(path, engine.model_info), slots[2]) == 6


def test_slot_ranks_give_the_largest_rank_of_the_slots_a_step_uses():
    ranks = SlotRanks.zeros(4, 32, torch.device("cpu"))
    ranks.on_host[:] = [8, 32, 0, 16]
    assert ranks.largest([0, -1, 3, 0]) == 16
    assert ranks.largest([-1, -1]) == 0
    assert ranks.largest([1, 0]) == 32
