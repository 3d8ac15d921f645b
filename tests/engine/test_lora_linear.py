"""A LoRA projection adds its adapters' delta itself, or hands it to the fused op it names as its consumer when
the step folds into that op."""
from __future__ import annotations

import pytest
import torch

import kernels
from engine.model import LoRALinear
from engine.step_input import LoRAStep

SLOTS = torch.tensor([1, -1, 0, 1], dtype=torch.int32)


def _gate_up(seed: int = 0) -> LoRALinear:
    gen = torch.Generator().manual_seed(seed)
    linear = LoRALinear(8, [6, 6], False, ["gate_proj", "up_proj"], "silu_and_mul")
    linear.weight.copy_(torch.randn(12, 8, generator=gen))
    linear.lora_a = [torch.randn(2, 4, 8, generator=gen) for _ in range(2)]
    linear.lora_b = [torch.randn(2, 6, 4, generator=gen) for _ in range(2)]
    return linear


def _step(fold_into: frozenset[str]) -> LoRAStep:
    return LoRAStep(kernels.prepare_lora_metadata(SLOTS, 2), fold_into=fold_into)


def test_a_projection_adds_its_delta_when_its_consumer_does_not_fold():
    linear, x = _gate_up(), torch.randn(4, 8)
    y, delta = linear(x, _step(frozenset({"rotary_and_write_kv", "add_rms_norm"})))
    assert delta is None
    base, folded = linear(x, _step(frozenset({"silu_and_mul"})))
    folded.apply(base)
    torch.testing.assert_close(y, base)


def test_a_projection_hands_its_delta_to_its_consumer_when_it_folds():
    linear, x = _gate_up(), torch.randn(4, 8)
    y, delta = linear(x, _step(frozenset({"silu_and_mul"})))
    assert delta is not None
    torch.testing.assert_close(y, x @ linear.weight.t())


def test_a_projection_refuses_a_consumer_that_is_not_a_fused_op():
    with pytest.raises(ValueError, match="consumer must be one of"):
        LoRALinear(8, [8], False, ["o_proj"], "rms_norm")


def test_a_projection_hands_the_steps_tiled_choice_to_its_delta():
    linear, x = _gate_up(), torch.randn(4, 8)
    fold = frozenset({"silu_and_mul"})
    _, tiled = linear(x, LoRAStep(kernels.prepare_lora_metadata(SLOTS, 2), fold_into=fold, tiled_folds=fold))
    _, per_token = linear(x, _step(fold))
    assert tiled.tiled and not per_token.tiled


def test_a_step_at_a_narrower_rank_width_reads_views_of_the_slots_first_ranks_only():
    """Slots 4 wide whose adapters use 2 ranks, NaN past them: a step at rank width 2 gives what the full slots give
    with zero padding."""
    linear, x = _gate_up(), torch.randn(4, 8)
    for a, b in zip(linear.lora_a, linear.lora_b):
        a[:, 2:] = 0
        b[:, :, 2:] = 0
    clean, _ = linear(x, _step(frozenset()))
    for a, b in zip(linear.lora_a, linear.lora_b):
        a[:, 2:] = float("nan")
        b[:, :, 2:] = float("nan")
    narrow, _ = linear(x, LoRAStep(kernels.prepare_lora_metadata(SLOTS, 2), rank_width=2))
    torch.testing.assert_close(narrow, clean)


def test_the_narrow_views_are_made_once_per_binding_of_the_slots():
    linear = _gate_up()
    first = linear.slot_stacks(2)
    assert linear.slot_stacks(2)[0] is first[0]
    linear.lora_a = [a.clone() for a in linear.lora_a]
    assert linear.slot_stacks(2)[0] is not first[0]
    assert linear.slot_stacks(None)[0] is linear.lora_a and linear.slot_stacks(4)[0] is linear.lora_a
