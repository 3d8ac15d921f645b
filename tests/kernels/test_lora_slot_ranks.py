"""Slots padded to the max rank: given the slots' ranks, every Triton LoRA kernel reads a slot's A rows below its
adapter's rank only, and its B columns up to that rank rounded up to whole 16-byte vectors (`b_columns_read`).

Past those the padding holds NaN, which any read would spread (B's few columns between the rank and the vector's end
are zero, as the engine writes them); the results must equal those of the zero padding: the float64 products for the
shrink and the expand, and for the fused ops' folds the same kernel reading zero padding in full (no ranks given), to
the bit (`same_op`). One batch mixes slots of ranks 16, 5, 8, 1 and 11 (max rank 16), or 20, 5, 13, 1 and 17 (max
rank 20, not a power of two), with base-model rows; small rank blocks make some blocks lie partly, some wholly, in a
slot's padding.
"""
from __future__ import annotations

import random

import pytest
import torch

from tests.kernels.lora_cases import (
    RotaryCase,
    b_columns_read,
    expand_reference,
    fill_past_ranks_,
    kernel_paths,
    random_weights,
    ranked_deltas,
    ranked_metadata,
    relative_error,
    same_op,
    shrink_reference,
    skip_without_triton,
    slots_tensor,
)

pytestmark = skip_without_triton()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAN = float("nan")
SLOT_RANKS = {16: (16, 5, 8, 1, 11), 20: (20, 5, 13, 1, 17)}
MAX_RANKS = [pytest.param(r, id=f"max_rank{r}") for r in SLOT_RANKS]
# slot 1 spans several 4-row tiles; base rows between
SLOTS = [3, 1, 0, -1, 2, 1, 4, 1, -1, 0, 3, 2, 1, 1]
K = 70
WIDTHS = (40, 24, 13)
# float32 dots run as tf32 on the GPU's tensor cores; elsewhere they are exact float32
TOLERANCE = 5e-3 if DEVICE == "cuda" else 1e-5


@pytest.fixture(params=kernel_paths("bgmv", "bgmv_split_k", "sgmv", "sgmv_split_k"))
def impl(request):
    return request.param


def _a_slices(max_rank: int, slot_ranks) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A stacks for three slices, (zero-padded, NaN-padded) past each slot's rank."""
    zero = [fill_past_ranks_(a, slot_ranks, 1, 0.0) for a in random_weights([(max_rank, K)] * 3, torch.float32,
                                                                            DEVICE)]
    return zero, [fill_past_ranks_(a.clone(), slot_ranks, 1, NAN) for a in zero]


def _b_slices(max_rank: int, slot_ranks) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """B stacks of WIDTHS, zero-padded past each slot's rank, and the same NaN past the columns the kernels read."""
    zero = [fill_past_ranks_(b, slot_ranks, 2, 0.0) for b in random_weights([(w, max_rank) for w in WIDTHS],
                                                                            torch.float32, DEVICE)]
    read = b_columns_read(slot_ranks, max_rank)
    return zero, [fill_past_ranks_(b.clone(), read, 2, NAN) for b in zero]


def _h(max_rank: int, slot_ranks) -> torch.Tensor:
    """Random h for SLOTS, zero past each token's rank (and on base rows), as the shrink leaves it."""
    h = torch.randn(len(WIDTHS), len(SLOTS), max_rank, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for t, slot in enumerate(SLOTS):
        h[:, t, slot_ranks[slot] if slot >= 0 else 0:] = 0.0
    return h


def _meta(slot_ranks):
    return ranked_metadata(SLOTS, slot_ranks, DEVICE, block_m=4)


# shrink and expand


@pytest.mark.parametrize("max_rank", MAX_RANKS)
def test_shrink_reads_no_a_row_past_a_slots_rank_and_leaves_h_zero_there(impl, max_rank):
    shrink, _ = impl
    slot_ranks = SLOT_RANKS[max_rank]
    x = torch.randn(len(SLOTS), K, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    zero, poisoned = _a_slices(max_rank, slot_ranks)
    h = shrink(x, poisoned, _meta(slot_ranks))
    ref = shrink_reference(x, zero, slots_tensor(SLOTS, DEVICE))
    past_rank = ref == 0.0  # past each token's rank, and base rows
    assert not h.isnan().any()
    assert torch.equal(h[past_rank], torch.zeros_like(h[past_rank]))
    assert relative_error(h, ref) <= TOLERANCE


@pytest.mark.parametrize("max_rank", MAX_RANKS)
def test_expand_reads_no_b_column_past_a_slots_rank(impl, max_rank):
    _, expand = impl
    slot_ranks = SLOT_RANKS[max_rank]
    h = _h(max_rank, slot_ranks)
    zero, poisoned = _b_slices(max_rank, slot_ranks)
    y = torch.randn(len(SLOTS), sum(WIDTHS), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    ref = expand_reference(y, h, zero, slots_tensor(SLOTS, DEVICE))
    expand(y, h, poisoned, _meta(slot_ranks))
    assert not y.isnan().any()
    assert relative_error(y, ref) <= TOLERANCE


RANK_ZERO_SLOT = 2
RANKS_WITH_A_ZERO = (16, 5, 0, 1, 11)


def test_a_slot_of_rank_zero_reads_no_a_and_gets_h_zero(impl):
    shrink, _ = impl
    _, poisoned = _a_slices(16, RANKS_WITH_A_ZERO)
    assert poisoned[0][RANK_ZERO_SLOT].isnan().all()
    h = shrink(torch.randn(len(SLOTS), K, device=DEVICE), poisoned, _meta(RANKS_WITH_A_ZERO))
    rows = slots_tensor(SLOTS, DEVICE) == RANK_ZERO_SLOT
    assert torch.equal(h[:, rows], torch.zeros_like(h[:, rows]))


def test_a_slot_of_rank_zero_reads_no_b_and_leaves_y_as_it_was(impl):
    _, expand = impl
    _, poisoned = _b_slices(16, RANKS_WITH_A_ZERO)
    assert poisoned[0][RANK_ZERO_SLOT].isnan().all()
    y = torch.randn(len(SLOTS), sum(WIDTHS), device=DEVICE)
    before = y.clone()
    expand(y, _h(16, RANKS_WITH_A_ZERO), poisoned, _meta(RANKS_WITH_A_ZERO))
    rows = slots_tensor(SLOTS, DEVICE) == RANK_ZERO_SLOT
    assert torch.equal(y[rows], before[rows])


# the per-token folds (`fused_triton`): max rank 16 in the default launch (one rank block), 20 in a small one (rank
# blocks of 4 and 8, several of them wholly past the lower ranks)

FOLD_SLOTS = [3, -1, 0, 2, 1, -1, 4, 1]
WIDTH, INTERMEDIATE, EPS = 72, 80, 1e-6
HEADS = (6, 3, 24)


def _fold_launches():
    from kernels.fused_triton import LoRAOpConfig

    small = {"add_rms_norm": LoRAOpConfig(chunk=32, block_r=4, num_warps=2),
             "silu_and_mul": LoRAOpConfig(chunk=32, block_r=4, num_warps=2, chunks_per_program=2),
             "rotary_and_write_kv": LoRAOpConfig(chunk=2, block_r=8, num_warps=2)}
    return [pytest.param((16, {}), id="max_rank16-default"), pytest.param((20, small), id="max_rank20-small")]


def _tile_launches():
    from kernels.fused_lora_tiles_triton import LoRATileConfig

    small = LoRATileConfig(chunk=16, block_r=16, num_warps=2, rows=16)
    return [pytest.param((16, {}), id="max_rank16-default"),
            pytest.param((20, {op: small for op in ("add_rms_norm", "silu_and_mul", "rotary_and_write_kv")}),
                         id="max_rank20-small")]


def _config(configs: dict, op: str) -> dict:
    return {"config": configs[op]} if op in configs else {}


def _deltas(slots: list[int], widths, max_rank: int, seed: int, block_m: int | None = None):
    return ranked_deltas(slots, widths, max_rank, SLOT_RANKS[max_rank], torch.bfloat16, seed, DEVICE,
                         block_m=block_m)


def _add_rms_norm_skips_the_padding(ops, slots, launch, block_m=None):
    max_rank, configs = launch
    gen = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(len(slots), WIDTH, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2))
    weight = torch.rand(WIDTH, generator=gen).add(0.5).to(DEVICE, torch.bfloat16)
    skipping, reading = _deltas(slots, [WIDTH], max_rank, seed=2, block_m=block_m)
    got = ops.add_rms_norm(x, residual, weight, EPS, skipping, **_config(configs, "add_rms_norm"))
    want = ops.add_rms_norm(x, residual, weight, EPS, reading, **_config(configs, "add_rms_norm"))
    for a, b in zip(got, want):
        assert not b.isnan().any()
        same_op(a, b)


def _silu_and_mul_skips_the_padding(ops, slots, launch, block_m=None):
    max_rank, configs = launch
    gate_up = (torch.randn(len(slots), 2 * INTERMEDIATE, generator=torch.Generator().manual_seed(3)) * 3).to(
        DEVICE, torch.bfloat16)
    skipping, reading = _deltas(slots, [INTERMEDIATE] * 2, max_rank, seed=4, block_m=block_m)
    want = ops.silu_and_mul(gate_up, reading, **_config(configs, "silu_and_mul"))
    assert not want.isnan().any()
    same_op(ops.silu_and_mul(gate_up, skipping, **_config(configs, "silu_and_mul")), want)


def _rotary_and_write_kv_skips_the_padding(ops, slots, launch, block_m=None):
    """Caches start NaN: the rows no token writes stay so in both."""
    max_rank, configs = launch
    got, want = (RotaryCase.random(HEADS, len(slots), torch.bfloat16, DEVICE) for _ in range(2))
    skipping, reading = _deltas(slots, got.widths, max_rank, seed=6, block_m=block_m)
    got.run(ops.rotary_and_write_kv, skipping, **_config(configs, "rotary_and_write_kv"))
    want.run(ops.rotary_and_write_kv, reading, **_config(configs, "rotary_and_write_kv"))
    assert not got.qkv.isnan().any()
    for a, b in zip(got.outputs(), want.outputs()):
        same_op(a, b)


@pytest.mark.parametrize("launch", _fold_launches())
def test_add_rms_norm_fold_reads_no_b_column_past_a_slots_rank(launch):
    from kernels import fused_triton

    _add_rms_norm_skips_the_padding(fused_triton, FOLD_SLOTS, launch)


@pytest.mark.parametrize("launch", _fold_launches())
def test_silu_and_mul_fold_reads_no_b_column_past_a_slots_rank(launch):
    from kernels import fused_triton

    _silu_and_mul_skips_the_padding(fused_triton, FOLD_SLOTS, launch)


@pytest.mark.parametrize("launch", _fold_launches())
def test_rotary_and_write_kv_fold_reads_no_b_column_past_a_slots_rank(launch):
    from kernels import fused_triton

    _rotary_and_write_kv_skips_the_padding(fused_triton, FOLD_SLOTS, launch)


# the tiled folds (`fused_lora_tiles_triton`), 16-row tiles: max rank 16 in the default launch (SiLU·up and rotary
# keep B's one rank block loaded for their walk), 20 in rank blocks of 16 (B read each step, its second block partly
# or wholly past the slots' ranks)

TILE_SLOTS = [1] * 20 + [0] * 6 + [2] * 3 + [3] * 4 + [4] * 2 + [-1] * 5
random.Random(0).shuffle(TILE_SLOTS)


@pytest.mark.parametrize("launch", _tile_launches())
def test_tiled_add_rms_norm_reads_no_b_column_past_a_slots_rank(launch):
    from kernels import fused_lora_tiles_triton

    _add_rms_norm_skips_the_padding(fused_lora_tiles_triton, TILE_SLOTS, launch, block_m=16)


@pytest.mark.parametrize("launch", _tile_launches())
def test_tiled_silu_and_mul_reads_no_b_column_past_a_slots_rank(launch):
    from kernels import fused_lora_tiles_triton

    _silu_and_mul_skips_the_padding(fused_lora_tiles_triton, TILE_SLOTS, launch, block_m=16)


@pytest.mark.parametrize("launch", _tile_launches())
def test_tiled_rotary_and_write_kv_reads_no_b_column_past_a_slots_rank(launch):
    from kernels import fused_lora_tiles_triton

    _rotary_and_write_kv_skips_the_padding(fused_lora_tiles_triton, TILE_SLOTS, launch, block_m=16)
