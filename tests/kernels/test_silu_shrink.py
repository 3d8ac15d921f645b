"""The tiled SiLU·up taking the next projection's shrink (`fused.silu_and_mul_and_shrink`): its output is the op's,
and its h is `lora_shrink_slices` of that output, as the down projection would compute it from the stored activation.

The tiled variant adds each column chunk's part of the shrink to h as it stores the chunk, so h's float32 sum runs
in another order than the segment shrink's: h is held to that shrink within float32 roundings, and to float64. The
cases are the tiled fold's (tokens unsorted across slots, a slot past one tile, base rows, all base rows, parts of
tiles), plus slots below the max rank whose A padding is NaN, and the dispatcher's choice of one launch or two.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels import LoRADelta, fused, lora_tuning
from tests.kernels.lora_cases import (
    exact_delta,
    fill_past_ranks_,
    random_weights,
    ranked_metadata,
    record_calls,
    same_op,
    shrink_reference,
    skip_without_triton,
    slots_tensor,
)
from tests.kernels.tile_cases import (
    DEVICE,
    INTERMEDIATE,
    PATTERNS,
    Launch,
    gate_up_input,
    launch_config,
    walk_launches,
)

pytestmark = skip_without_triton()

# h's float32 sums in another order, relative to the largest (the kernels' float32 dots are ieee, not tf32)
TOLERANCE = 1e-5


@pytest.fixture(params=PATTERNS.values(), ids=PATTERNS.keys())
def slots(request) -> list[int]:
    return request.param


def _a_stack(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """The down projection's A slot stack [S, rank, INTERMEDIATE]."""
    return random_weights([(rank, INTERMEDIATE)], torch.float32, DEVICE)[0].to(dtype)


def _tiled(gate_up: torch.Tensor, lora: LoRADelta, a: torch.Tensor, launch: Launch | None = None):
    from kernels import fused_lora_tiles_triton as tiles
    from kernels.lora_triton import new_h

    h = new_h(1, gate_up.shape[0], lora.rank, gate_up.device, zero=True)
    out = tiles.silu_and_mul(gate_up, lora, shrink_into=(a, h[0]), **(launch_config(launch) if launch else {}))
    return out, h


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 h summed in two orders: within float32 roundings of the largest value."""
    torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE * max(want.abs().max().item(), 1.0))


@pytest.mark.parametrize("launch", walk_launches())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_output_is_the_tiled_ops_and_h_the_segment_shrink_of_it(slots, launch, dtype):
    from kernels import fused_lora_tiles_triton as tiles
    from kernels import lora_triton

    gate_up = gate_up_input(slots, dtype)
    lora = exact_delta(slots, [INTERMEDIATE] * 2, launch.rank, dtype, seed=4, device=DEVICE, block_m=launch.block_m)
    a = _a_stack(launch.rank, dtype)
    out, h = _tiled(gate_up, lora, a, launch)
    same_op(out, tiles.silu_and_mul(gate_up, lora, **launch_config(launch)))
    _close(h, lora_triton.shrink_slices(out, (a,), lora.meta, path="sgmv"))


@pytest.mark.parametrize("launch", walk_launches())
def test_h_matches_the_float64_shrink_of_the_output(launch):
    slots = PATTERNS["unsorted_mixed"]
    gate_up = gate_up_input(slots, torch.float32)
    lora = exact_delta(slots, [INTERMEDIATE] * 2, launch.rank, torch.float32, seed=4, device=DEVICE,
                       block_m=launch.block_m)
    a = _a_stack(launch.rank, torch.float32)
    out, h = _tiled(gate_up, lora, a, launch)
    torch.testing.assert_close(h.double(), shrink_reference(out, (a,), slots_tensor(slots, DEVICE)),
                               rtol=TOLERANCE, atol=TOLERANCE)


def test_base_rows_and_the_columns_past_a_slots_rank_stay_zero_and_a_padding_is_not_read():
    """Slots of ranks 16, 5, 8, 1 and 11 in a stack of max rank 16, A's rows past each rank NaN: h is finite, zero
    past each token's rank and on base rows, and equals the float64 shrink of the zero-padded A."""
    slot_ranks = (16, 5, 8, 1, 11)
    slots = PATTERNS["unsorted_mixed"]
    gate_up = gate_up_input(slots, torch.float32)
    lora = exact_delta(slots, [INTERMEDIATE] * 2, 16, torch.float32, seed=4, device=DEVICE)
    for t, slot in enumerate(slots):
        lora.h[:, t, slot_ranks[slot] if slot >= 0 else 0:] = 0.0
    lora = replace(lora, meta=ranked_metadata(slots, slot_ranks, DEVICE))
    zero = fill_past_ranks_(_a_stack(16, torch.float32), slot_ranks, 1, 0.0)
    out, h = _tiled(gate_up, lora, fill_past_ranks_(zero.clone(), slot_ranks, 1, float("nan")))
    assert torch.isfinite(h).all()
    for t, slot in enumerate(slots):
        assert not h[0, t, slot_ranks[slot] if slot >= 0 else 0:].any()
    torch.testing.assert_close(h.double(), shrink_reference(out, (zero,), slots_tensor(slots, DEVICE)),
                               rtol=TOLERANCE, atol=TOLERANCE)


def test_an_a_of_another_shape_is_refused():
    from kernels import fused_lora_tiles_triton as tiles

    slots = PATTERNS["one_slot"]
    gate_up = gate_up_input(slots, torch.float32)
    lora = exact_delta(slots, [INTERMEDIATE] * 2, 8, torch.float32, seed=4, device=DEVICE)
    h = torch.zeros(len(slots), 8, device=DEVICE)
    with pytest.raises(ValueError, match="the shrink takes A"):
        tiles.silu_and_mul(gate_up, lora, shrink_into=(_a_stack(4, torch.float32), h))


# the dispatcher

@pytest.mark.parametrize("num_tokens", [lora_tuning.SGMV_MIN_TOKENS - 1, lora_tuning.SGMV_MIN_TOKENS])
def test_segment_steps_take_one_launch_and_per_token_steps_the_op_then_the_shrink(num_tokens, monkeypatch):
    from kernels import fused_lora_tiles_triton as tiles
    from kernels import fused_triton, lora_triton

    launches = record_calls(monkeypatch, tiles, "_silu_and_mul_tiles_kernel")
    shrinks = record_calls(monkeypatch, fused_triton, "lora_shrink_slices")
    slots = [t % 6 - 1 for t in range(num_tokens)]
    gate_up = gate_up_input(slots, torch.float32)
    lora = exact_delta(slots, [INTERMEDIATE] * 2, 8, torch.float32, seed=4, device=DEVICE)
    a = _a_stack(8, torch.float32)
    out, h = fused_triton.silu_and_mul_and_shrink(gate_up, lora, a)
    segments = lora_tuning.choose_path(num_tokens) == "sgmv"
    assert [call.name for call in launches] == (["_silu_and_mul_tiles_kernel"] if segments else [])
    assert [call.name for call in shrinks] == ([] if segments else ["lora_shrink_slices"])
    same_op(out, fused_triton.silu_and_mul(gate_up, lora))
    _close(h, lora_triton.shrink_slices(out, (a,), lora.meta))


def test_a_rank_past_the_widest_the_walk_keeps_takes_the_op_then_the_shrink(monkeypatch):
    from kernels import fused_lora_tiles_triton as tiles
    from kernels import fused_triton

    rank = lora_tuning.SILU_SHRINK_MAX_RANK + 16
    shrinks = record_calls(monkeypatch, fused_triton, "lora_shrink_slices")
    slots = PATTERNS["one_slot"]
    gate_up = gate_up_input(slots, torch.float32)
    lora = replace(exact_delta(slots, [INTERMEDIATE] * 2, rank, torch.float32, seed=4, device=DEVICE), tiled=True)
    out, h = fused_triton.silu_and_mul_and_shrink(gate_up, lora, _a_stack(rank, torch.float32))
    assert [call.name for call in shrinks] == ["lora_shrink_slices"]
    assert h.shape == (1, len(slots), rank)


def test_the_torch_path_is_the_op_then_the_shrink():
    from kernels import fused_torch

    slots = PATTERNS["unsorted_mixed"]
    gate_up = gate_up_input(slots, torch.float32).cpu()
    lora = exact_delta(slots, [INTERMEDIATE] * 2, 8, torch.float32, seed=4)
    a = _a_stack(8, torch.float32).cpu()
    out, h = fused_torch.silu_and_mul_and_shrink(gate_up, lora, a)
    torch.testing.assert_close(out, fused_torch.silu_and_mul(gate_up, lora), rtol=0, atol=0)
    torch.testing.assert_close(h.double(), shrink_reference(out, (a,), slots_tensor(slots)), rtol=TOLERANCE,
                               atol=TOLERANCE)


def test_the_public_op_checks_the_delta_against_its_input():
    slots = PATTERNS["one_slot"]
    lora = exact_delta(slots, [INTERMEDIATE] * 2, 8, torch.float32, seed=4, device=DEVICE)
    with pytest.raises(ValueError, match="metadata was prepared for"):
        fused.silu_and_mul_and_shrink(gate_up_input(slots + [0], torch.float32), lora, _a_stack(8, torch.float32))
