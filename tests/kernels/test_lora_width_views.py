"""Width views: on a step whose adapters' ranks all fit a width W, the engine hands the kernels views of the slot
stacks' first W rank rows and columns (A[:, :W, :], rows K apart; B[:, :, :W], rows R apart, R the slots' max rank),
so that every launch shape follows W.

Each kernel must take such a view as it is (its launch gets the view itself: a copy of the B stacks every layer would
cost more than the width saves) and read it in place: give what it gives on a contiguous W-wide copy, to the bit
(`same_op`), and the float64 result. The stacks, and h where the test hands it in as a view of a wider one, hold NaN
past W, which a read past the view spreads. Views of W = 16 from stacks of R = 32 and of W = 8 from R = 20 (not a
power of two), read in full or with the slots' ranks (at most W) given; the tiled folds at W = 8 from R = 20 (below
their smallest rank block: B's block loaded once for a walk is masked at W) and at W = 24 from R = 40 in rank blocks
of 16, so that their walks read B at each step.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from kernels import LoRADelta, fused_torch, lora_torch
from tests.kernels.lora_cases import (
    RotaryCase,
    exact_delta,
    expand_reference,
    fill_past_ranks_,
    kernel_paths,
    packed_weights,
    random_weights,
    ranked_metadata,
    record_calls,
    relative_error,
    same_op,
    shrink_reference,
    skip_without_triton,
    slots_tensor,
    triton_runs_in_process,
    width_view,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = skip_without_triton()
# slot 1 spans several 4-row tiles; base rows between
SLOTS = [3, 1, 0, -1, 2, 1, 4, 1, -1, 0, 3, 2, 1, 1]
K = 70
WIDTHS = (40, 24, 13)
# float32 dots run as tf32 on the GPU's tensor cores; elsewhere they are exact float32
TOLERANCE = 5e-3 if DEVICE == "cuda" else 1e-5


@dataclass(frozen=True)
class Width:
    """Stacks allocated at `max_rank`, viewed at `width`; the slots' ranks (each at most `width`) when given."""

    max_rank: int
    width: int
    slot_ranks: tuple[int, ...]

    @property
    def id(self) -> str:
        return f"{self.width}_of_{self.max_rank}"


W16_OF_32 = Width(32, 16, (16, 5, 8, 1, 11))
W8_OF_20 = Width(20, 8, (8, 5, 3, 1, 7))
W24_OF_40 = Width(40, 24, (24, 5, 17, 1, 11))
RANKS = [pytest.param(False, id="read_in_full"), pytest.param(True, id="slot_ranks")]


def _meta(slots: list[int], width: Width, ranked: bool, block_m: int | None = 4):
    return ranked_metadata(slots, width.slot_ranks if ranked else None, DEVICE, block_m=block_m)


def _views(shapes: list[tuple[int, int]], dim: int, width: Width, ranked: bool):
    """Stacks of `shapes` (at the max rank) packed in one buffer as the engine lays its slots out, zero past each
    slot's rank when `ranked` (the padding the engine writes), viewed at the width (NaN past it); and contiguous
    copies of the views."""
    stacks = packed_weights(shapes, torch.float32, DEVICE)
    if ranked:
        for stack in stacks:
            fill_past_ranks_(stack, width.slot_ranks, dim, 0.0)
    views = [width_view(stack, width.width, dim) for stack in stacks]
    return views, [view.contiguous() for view in views]


def _zero_past_ranks_(h: torch.Tensor, slots: list[int], width: Width, ranked: bool) -> torch.Tensor:
    """h zero on base rows and, when `ranked`, past each token's rank, as the shrink leaves it."""
    for t, slot in enumerate(slots):
        if slot < 0 or ranked:
            h[:, t, width.slot_ranks[slot] if slot >= 0 else 0:] = 0.0
    return h


def _launched_with(calls, tensors) -> None:
    """The first recorded launch got each of `tensors` itself: no copy."""
    assert all(any(arg is tensor for arg in calls[0].args) for tensor in tensors)


# the slot stacks as the kernels take them


def test_slot_stacks_take_width_views_as_they_are():
    from kernels.lora_triton import slot_stacks

    a, b = packed_weights([(32, K), (40, 32)], torch.bfloat16, DEVICE)
    views = [a[:, :16], b[:, :, :16]]
    assert all(got is view for got, view in zip(slot_stacks(views), views))


def _columns_strided():
    return random_weights([(16, 40)], torch.float32, DEVICE)[0].transpose(1, 2)


def _rows_overlapping():
    return torch.randn(64, device=DEVICE).as_strided((2, 4, 8), (32, 4, 1))


@pytest.mark.parametrize("make", [pytest.param(_columns_strided, id="columns_strided"),
                                  pytest.param(_rows_overlapping, id="rows_overlapping")])
def test_slot_stacks_copy_a_stack_whose_rows_are_not_dense_and_apart(make):
    from kernels.lora_triton import slot_stacks

    stack = make()
    (got,) = slot_stacks([stack])
    assert got.is_contiguous()
    assert torch.equal(got, stack)


def test_an_expand_over_b_slices_of_unequal_row_strides_raises():
    from kernels import lora_triton

    views, copies = _views([(w, 32) for w in WIDTHS[:2]], 2, W16_OF_32, False)
    y = torch.zeros(len(SLOTS), sum(WIDTHS[:2]), device=DEVICE)
    h = torch.zeros(2, len(SLOTS), 16, device=DEVICE)
    with pytest.raises(ValueError, match="row stride"):
        lora_triton.expand_slices(y, h, [views[0], copies[1]], _meta(SLOTS, W16_OF_32, False))


def test_a_delta_of_width_views_has_the_views_rank_and_fits_h_of_that_width():
    views, _ = _views([(w, 32) for w in WIDTHS], 2, W16_OF_32, False)
    delta = LoRADelta(torch.zeros(3, len(SLOTS), 16, device=DEVICE), tuple(views), _meta(SLOTS, W16_OF_32, False))
    assert delta.rank == 16
    delta.check(len(SLOTS), WIDTHS)


# shrink and expand


@pytest.fixture(params=kernel_paths("bgmv_split_k", "sgmv_split_k") if triton_runs_in_process() else [])
def impl(request):
    return request.param


SHRINK_WIDTHS = [pytest.param(w, id=w.id) for w in (W16_OF_32, W8_OF_20)]


@needs_triton
@pytest.mark.parametrize("width", SHRINK_WIDTHS)
@pytest.mark.parametrize("ranked", RANKS)
def test_shrink_reads_width_views_of_a_in_place(impl, width, ranked, monkeypatch):
    from kernels import lora_triton

    shrink, _ = impl
    x = torch.randn(len(SLOTS), K, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    views, copies = _views([(width.max_rank, K)] * 3, 1, width, ranked)
    meta = _meta(SLOTS, width, ranked)
    calls = record_calls(monkeypatch, lora_triton, "_shrink_bgmv_kernel", "_shrink_sgmv_kernel")
    h = shrink(x, views, meta)
    _launched_with(calls, views)
    assert h.shape == (3, len(SLOTS), width.width)
    assert not h.isnan().any()
    same_op(h, shrink(x, copies, meta))
    assert relative_error(h, shrink_reference(x, copies, slots_tensor(SLOTS, DEVICE))) <= TOLERANCE


@needs_triton
@pytest.mark.parametrize("width", SHRINK_WIDTHS)
@pytest.mark.parametrize("ranked", RANKS)
def test_expand_reads_width_views_of_b_and_h_in_place(impl, width, ranked, monkeypatch):
    """h too is a view of a wider one here: the expand indexes it by its own strides, whatever B's row stride."""
    from kernels import lora_triton

    _, expand = impl
    views, copies = _views([(w, width.max_rank) for w in WIDTHS], 2, width, ranked)
    wide_h = torch.randn(3, len(SLOTS), width.max_rank, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    h = width_view(_zero_past_ranks_(wide_h, SLOTS, width, ranked), width.width, 2)
    meta = _meta(SLOTS, width, ranked)
    y = torch.randn(len(SLOTS), sum(WIDTHS), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    ref = expand_reference(y, h, copies, slots_tensor(SLOTS, DEVICE))
    want = y.clone()
    calls = record_calls(monkeypatch, lora_triton, "_expand_bgmv_kernel", "_expand_sgmv_kernel")
    expand(y, h, views, meta)
    _launched_with(calls, [h, *views])
    expand(want, h.contiguous(), copies, meta)
    assert not y.isnan().any()
    same_op(y, want)
    assert relative_error(y, ref) <= TOLERANCE


def test_the_torch_path_reads_width_views_as_their_contiguous_copies():
    """Within float32's tolerance, not to the bit: a BLAS matmul's summation order follows its operands' alignment,
    and the packed views lie where the copies do not."""
    x = torch.randn(len(SLOTS), K, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    a_views, a_copies = _views([(32, K)] * 3, 1, W16_OF_32, False)
    b_views, b_copies = _views([(w, 32) for w in WIDTHS], 2, W16_OF_32, False)
    meta = _meta(SLOTS, W16_OF_32, False)
    h = lora_torch.shrink_slices(x, a_views, meta)
    torch.testing.assert_close(h, lora_torch.shrink_slices(x, a_copies, meta))
    y, want = (torch.ones(len(SLOTS), sum(WIDTHS), device=DEVICE) for _ in range(2))
    lora_torch.expand_slices(y, h, b_views, meta)
    lora_torch.expand_slices(want, h, b_copies, meta)
    assert not y.isnan().any()
    torch.testing.assert_close(y, want)


# the folds, per token (`fused_triton`) and tiled (`fused_lora_tiles_triton`)

# slot 1 spans two 16-row tiles; base rows between
TILE_SLOTS = [1] * 20 + [0] * 6 + [2] * 3 + [3] * 4 + [4] * 2 + [-1] * 5
random.Random(0).shuffle(TILE_SLOTS)
HIDDEN, INTERMEDIATE, EPS = 72, 80, 1e-6
HEADS = (6, 3, 24)


@dataclass(frozen=True)
class Fold:
    """The folds' module, the kernel it launches for each op, its steps' slots and tile height, and the launch
    configs it takes (op name -> config; none: the defaults)."""

    ops: object
    kernels: dict[str, str]
    slots: list[int]
    block_m: int | None
    configs: dict

    def config(self, op: str) -> dict:
        return {"config": self.configs[op]} if op in self.configs else {}

    def record(self, op: str, monkeypatch) -> list:
        """The launches of `op`'s kernel from now on (`record_calls`)."""
        return record_calls(monkeypatch, self.ops, self.kernels[op])


def _folds():
    from kernels import fused_lora_tiles_triton, fused_triton
    from kernels.fused_lora_tiles_triton import LoRATileConfig
    from kernels.fused_triton import LoRAOpConfig

    per_token = {"ops": fused_triton, "slots": SLOTS, "block_m": None,
                 "kernels": {"add_rms_norm": "_add_rms_norm_kernel", "silu_and_mul": "_silu_and_mul_kernel",
                             "rotary_and_write_kv": "_rotary_and_write_kv_kernel"}}
    tiled = {"ops": fused_lora_tiles_triton, "slots": TILE_SLOTS, "block_m": 16,
             "kernels": {"add_rms_norm": "_add_rms_norm_tiles_kernel", "silu_and_mul": "_silu_and_mul_tiles_kernel",
                         "rotary_and_write_kv": "_rotary_tiles_kernel"}}
    small = {"add_rms_norm": LoRAOpConfig(chunk=32, block_r=4, num_warps=2),
             "silu_and_mul": LoRAOpConfig(chunk=32, block_r=4, num_warps=2, chunks_per_program=2),
             "rotary_and_write_kv": LoRAOpConfig(chunk=2, block_r=4, num_warps=2)}
    blocks_of_16 = LoRATileConfig(chunk=16, block_r=16, num_warps=2, rows=16)
    return [pytest.param((Fold(configs={}, **per_token), W16_OF_32), id=f"per_token-{W16_OF_32.id}"),
            pytest.param((Fold(configs=small, **per_token), W8_OF_20), id=f"per_token-small-{W8_OF_20.id}"),
            pytest.param((Fold(configs={}, **tiled), W8_OF_20), id=f"tiled-{W8_OF_20.id}"),
            pytest.param((Fold(configs=dict.fromkeys(small, blocks_of_16), **tiled), W24_OF_40),
                         id=f"tiled-rank_blocks_of_16-{W24_OF_40.id}")]


@pytest.fixture(params=_folds() if triton_runs_in_process() else [])
def fold(request):
    return request.param


def _fold_deltas(slots: list[int], widths, width: Width, ranked: bool, seed: int, block_m: int | None):
    """An `exact_delta` (sums exact in any order) at the max rank, its h and B viewed at the width (NaN past it; with
    `ranked` zero past each slot's rank and the ranks in the metadata); and the same on contiguous copies."""
    delta = exact_delta(slots, widths, width.max_rank, torch.float32, seed, DEVICE, block_m=block_m)
    if ranked:
        for b in delta.b_slices:
            fill_past_ranks_(b, width.slot_ranks, 2, 0.0)
    h = width_view(_zero_past_ranks_(delta.h, slots, width, ranked), width.width, 2)
    views = tuple(width_view(b, width.width, 2) for b in delta.b_slices)
    meta = _meta(slots, width, ranked, block_m)
    return LoRADelta(h, views, meta), LoRADelta(h.contiguous(), tuple(b.contiguous() for b in views), meta)


def _float64_expanded(y: torch.Tensor, delta: LoRADelta, slots: list[int]) -> torch.Tensor:
    return expand_reference(y, delta.h, delta.b_slices, slots_tensor(slots, DEVICE))


def _close_to_float64(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, equal_nan=True)


@needs_triton
@pytest.mark.parametrize("ranked", RANKS)
def test_add_rms_norm_fold_reads_width_views_in_place(fold, ranked, monkeypatch):
    fold, width = fold
    gen = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(len(fold.slots), HIDDEN, generator=gen).to(DEVICE) for _ in range(2))
    weight = torch.rand(HIDDEN, generator=gen).add(0.5).to(DEVICE)
    views, copies = _fold_deltas(fold.slots, [HIDDEN], width, ranked, 2, fold.block_m)
    calls = fold.record("add_rms_norm", monkeypatch)
    got = fold.ops.add_rms_norm(x, residual, weight, EPS, views, **fold.config("add_rms_norm"))
    _launched_with(calls, [views.h, *views.b_slices])
    for a, b in zip(got, fold.ops.add_rms_norm(x, residual, weight, EPS, copies, **fold.config("add_rms_norm"))):
        same_op(a, b)
    hidden = _float64_expanded(x, copies, fold.slots) + residual.double()
    _close_to_float64(got[1], hidden)
    _close_to_float64(got[0], hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + EPS) * weight.double())


@needs_triton
@pytest.mark.parametrize("ranked", RANKS)
def test_silu_and_mul_fold_reads_width_views_in_place(fold, ranked, monkeypatch):
    fold, width = fold
    gate_up = torch.randn(len(fold.slots), 2 * INTERMEDIATE, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    views, copies = _fold_deltas(fold.slots, [INTERMEDIATE] * 2, width, ranked, 4, fold.block_m)
    calls = fold.record("silu_and_mul", monkeypatch)
    got = fold.ops.silu_and_mul(gate_up, views, **fold.config("silu_and_mul"))
    _launched_with(calls, [views.h, *views.b_slices])
    same_op(got, fold.ops.silu_and_mul(gate_up, copies, **fold.config("silu_and_mul")))
    gate, up = _float64_expanded(gate_up, copies, fold.slots).chunk(2, dim=-1)
    _close_to_float64(got, torch.nn.functional.silu(gate) * up)


@needs_triton
@pytest.mark.parametrize("ranked", RANKS)
def test_rotary_and_write_kv_fold_reads_width_views_in_place(fold, ranked, monkeypatch):
    """Caches start NaN: the rows no token writes stay so."""
    fold, width = fold
    got, want = (RotaryCase.random(HEADS, len(fold.slots), torch.float32, DEVICE) for _ in range(2))
    reference = got.to(torch.float64)
    views, copies = _fold_deltas(fold.slots, got.widths, width, ranked, 6, fold.block_m)
    calls = fold.record("rotary_and_write_kv", monkeypatch)
    got.run(fold.ops.rotary_and_write_kv, views, **fold.config("rotary_and_write_kv"))
    _launched_with(calls, [views.h, *views.b_slices])
    want.run(fold.ops.rotary_and_write_kv, copies, **fold.config("rotary_and_write_kv"))
    assert not got.qkv.isnan().any()
    for a, b in zip(got.outputs(), want.outputs()):
        same_op(a, b)
    reference.qkv.copy_(_float64_expanded(reference.qkv, copies, fold.slots))
    reference.run(fused_torch.rotary_and_write_kv)
    for a, b in zip(got.outputs(), reference.outputs()):
        _close_to_float64(a, b)
