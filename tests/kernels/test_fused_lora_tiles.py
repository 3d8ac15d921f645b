"""The tiled (segment, "SGMV") LoRA variants of the fused ops against "segment expand first, then the op".

A program takes a tile of same-slot tokens from the step's metadata, so the cases are about tiles: tokens
unsorted across slots, a slot with more tokens than a tile holds, empty slots, base-only steps, base rows
mixed in, a rank that is not a power of two (and one past the rank block, which loops) and widths that are
not. Outputs start as NaN, so a row no program writes fails. As in test_fused_lora, h and B hold multiples of
1/8 and 1/16 (the delta's float32 sum is exact in any order) and the oracle is the same backend's expand and
plain op, which the tiled variants must match exactly (`same_op`: compiled float32 results to their last bits);
one test per op holds them to float64 with random values. The dispatcher test checks which variant a step's
token count gets.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
import torch

from kernels import LoRADelta, lora_tuning
from tests.kernels.lora_cases import (
    HEAD_SHAPES,
    NUM_SLOTS,
    RotaryCase,
    exact_delta,
    expand_reference,
    random_weights,
    record_calls,
    relative_error,
    replays_the_next_step,
    same_op,
    skip_without_triton,
    slots_tensor,
    within_a_rounding,
)

pytestmark = skip_without_triton()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _shuffled(slots: list[int]) -> list[int]:
    random.Random(0).shuffle(slots)
    return slots


# name -> per-token slots; tiles are 16 or 32 tokens
PATTERNS: dict[str, list[int]] = {
    # slot 2 spans three 16-token tiles, slots 1 and 3 have no tokens, base rows between
    "unsorted_mixed": _shuffled([2] * 37 + [0] * 5 + [4] + [-1] * 9),
    "all_base": [-1] * 20,
    "one_slot": [3] * 33,
}


@dataclass(frozen=True)
class Launch:
    """Tile height of the metadata, the rank, and the launch config (None: the module's default)."""

    block_m: int
    rank: int
    config: object = None


def _launches():
    from kernels.fused_lora_tiles_triton import LoRATileConfig

    small = LoRATileConfig(chunk=16, block_r=16, num_warps=2, rows=16)
    return [pytest.param(Launch(16, 12), id="tile16-default"),
            pytest.param(Launch(32, 20, small), id="tile32-in-parts-rank20")]


@pytest.fixture(params=PATTERNS.values(), ids=PATTERNS.keys())
def slots(request) -> list[int]:
    return request.param


@pytest.fixture(params=_launches())
def launch(request) -> Launch:
    return request.param


def _config(launch: Launch) -> dict:
    return {} if launch.config is None else {"config": launch.config}


def _expanded(y: torch.Tensor, delta: LoRADelta) -> torch.Tensor:
    """A copy of y with the delta applied by the Triton segment expand."""
    from kernels import lora_triton

    y = y.clone()
    lora_triton.expand_slices(y, delta.h, delta.b_slices, delta.meta, path="sgmv")
    return y


def _poisoned(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def _float64_expanded(y: torch.Tensor, delta: LoRADelta, slots: list[int]) -> torch.Tensor:
    return expand_reference(y, delta.h, delta.b_slices, slots_tensor(slots, DEVICE))


def _random_delta(slots: list[int], widths: list[int], rank: int, block_m: int) -> LoRADelta:
    """Random h (zero on base rows) and B in float32, on metadata of `block_m`-token tiles."""
    delta = exact_delta(slots, widths, rank, torch.float32, seed=9, device=DEVICE, block_m=block_m)
    h = torch.randn(delta.h.shape, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    h[:, slots_tensor(slots, DEVICE) < 0] = 0.0
    return LoRADelta(h, tuple(random_weights([(w, rank) for w in widths], torch.float32, DEVICE)), delta.meta)


# silu_and_mul

INTERMEDIATE = 80


def _gate_up(slots: list[int], dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(len(slots), 2 * INTERMEDIATE, generator=gen) * 3).to(DEVICE, dtype)


def _walk_launches():
    """The ops' launches, and 32-row tiles taken whole, so a program walks two 16-row steps (silu_and_mul,
    rotary_and_write_kv): on B loaded once (rank 12, one rank block), on B read each step (rank 20 in blocks of
    16), and with the default launch at rank 20 (the ops' rank block of 64 then covers it, so B is loaded once with
    its last 12 rank columns masked)."""
    from kernels.fused_lora_tiles_triton import LoRATileConfig

    whole = LoRATileConfig(chunk=16, block_r=16, num_warps=2, rows=0)
    return _launches() + [pytest.param(Launch(32, 12, whole), id="tile32-whole-rank12"),
                          pytest.param(Launch(32, 20, whole), id="tile32-whole-rank20"),
                          pytest.param(Launch(32, 20), id="tile32-default-rank20")]


@pytest.mark.parametrize("launch", _walk_launches())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_silu_and_mul_equals_expand_then_op(slots, launch, dtype):
    from kernels import fused_lora_tiles_triton as tiles
    from kernels import fused_triton

    gate_up = _gate_up(slots, dtype)
    lora = exact_delta(slots, [INTERMEDIATE] * 2, launch.rank, dtype, seed=4, device=DEVICE, block_m=launch.block_m)
    got = tiles.silu_and_mul(gate_up, lora, out=_poisoned(len(slots), INTERMEDIATE, dtype=dtype), **_config(launch))
    same_op(got, fused_triton.silu_and_mul(_expanded(gate_up, lora)))


@pytest.mark.parametrize("launch", _walk_launches())
def test_tiled_silu_and_mul_matches_float64(launch):
    from kernels import fused_lora_tiles_triton as tiles

    slots = PATTERNS["unsorted_mixed"]
    gate_up = _gate_up(slots, torch.float32)
    lora = _random_delta(slots, [INTERMEDIATE] * 2, launch.rank, launch.block_m)
    gate, up = _float64_expanded(gate_up, lora, slots).chunk(2, dim=-1)
    got = tiles.silu_and_mul(gate_up, lora, **_config(launch))
    torch.testing.assert_close(got.double(), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_tiled_silu_and_mul_leaves_gate_up_unchanged():
    from kernels import fused_lora_tiles_triton as tiles

    slots = PATTERNS["unsorted_mixed"]
    gate_up = _gate_up(slots, torch.bfloat16)
    before = gate_up.clone()
    tiles.silu_and_mul(gate_up, exact_delta(slots, [INTERMEDIATE] * 2, 12, torch.bfloat16, seed=4, device=DEVICE))
    assert torch.equal(gate_up, before)


# add_rms_norm

WIDTH, EPS = 72, 1e-6


def _norm_inputs(slots: list[int], dtype: torch.dtype, with_residual: bool):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(slots), WIDTH, generator=gen).to(DEVICE, dtype)
    residual = torch.randn(len(slots), WIDTH, generator=gen).to(DEVICE, dtype) if with_residual else None
    return x, residual, torch.rand(WIDTH, generator=gen).add(0.5).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_tiled_add_rms_norm_equals_expand_then_norm(slots, launch, dtype, with_residual):
    """The residual out exactly; the normed rows within a rounding (the squares add up in chunks)."""
    from kernels import fused_lora_tiles_triton as tiles
    from kernels import fused_triton

    x, residual, weight = _norm_inputs(slots, dtype, with_residual)
    lora = exact_delta(slots, [WIDTH], launch.rank, dtype, seed=2, device=DEVICE, block_m=launch.block_m)
    poisoned = (_poisoned(len(slots), WIDTH, dtype=dtype), _poisoned(len(slots), WIDTH, dtype=dtype))
    out, hidden = tiles.add_rms_norm(x, residual, weight, EPS, lora, out=poisoned, **_config(launch))
    want_out, want_hidden = fused_triton.add_rms_norm(_expanded(x, lora), residual, weight, EPS)
    same_op(hidden, want_hidden)
    within_a_rounding(out, want_out)


@pytest.mark.parametrize("with_residual", [True, False])
def test_tiled_add_rms_norm_matches_float64(launch, with_residual):
    from kernels import fused_lora_tiles_triton as tiles

    slots = PATTERNS["unsorted_mixed"]
    x, residual, weight = _norm_inputs(slots, torch.float32, with_residual)
    lora = _random_delta(slots, [WIDTH], launch.rank, launch.block_m)
    hidden = _float64_expanded(x, lora, slots) + (0 if residual is None else residual.double())
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    got_out, got_hidden = tiles.add_rms_norm(x, residual, weight, EPS, lora, **_config(launch))
    torch.testing.assert_close(got_hidden.double(), hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_out.double(), normed, rtol=1e-5, atol=1e-5)


def test_tiled_add_rms_norm_leaves_x_unchanged():
    from kernels import fused_lora_tiles_triton as tiles

    slots = PATTERNS["unsorted_mixed"]
    x, residual, weight = _norm_inputs(slots, torch.bfloat16, True)
    before = x.clone()
    tiles.add_rms_norm(x, residual, weight, EPS, exact_delta(slots, [WIDTH], 12, torch.bfloat16, seed=2,
                                                              device=DEVICE))
    assert torch.equal(x, before)


# rotary_and_write_kv

@pytest.mark.parametrize("launch", _walk_launches())
@pytest.mark.parametrize("shape", HEAD_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_rotary_and_write_kv_equals_expand_then_op(slots, launch, shape, dtype):
    """q and k end rotated after their delta, v holds its delta, and the caches hold both, for every row."""
    from kernels import fused_lora_tiles_triton as tiles
    from kernels import fused_triton

    got = RotaryCase.random(shape, len(slots), dtype, DEVICE)
    want = RotaryCase.random(shape, len(slots), dtype, DEVICE)
    lora = exact_delta(slots, got.widths, launch.rank, dtype, seed=6, device=DEVICE, block_m=launch.block_m)
    got.run(tiles.rotary_and_write_kv, lora, **_config(launch))
    want.qkv.copy_(_expanded(want.qkv, lora))
    want.run(fused_triton.rotary_and_write_kv)
    for a, b in zip(got.outputs(), want.outputs()):
        same_op(a, b)


@pytest.mark.parametrize("launch", _walk_launches())
def test_tiled_rotary_and_write_kv_matches_float64(launch):
    from kernels import fused_lora_tiles_triton as tiles
    from kernels import fused_torch

    slots = PATTERNS["unsorted_mixed"]
    got = RotaryCase.random((6, 3, 24), len(slots), torch.float32, DEVICE)
    want = got.to(torch.float64)
    lora = _random_delta(slots, got.widths, launch.rank, launch.block_m)
    got.run(tiles.rotary_and_write_kv, lora, **_config(launch))
    want.qkv.copy_(_float64_expanded(want.qkv, lora, slots))
    want.run(fused_torch.rotary_and_write_kv)
    for a, b in zip(got.outputs(), want.outputs()):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, equal_nan=True)


# the dispatcher

@pytest.mark.parametrize("num_tokens", [lora_tuning.SGMV_MIN_TOKENS - 1, lora_tuning.SGMV_MIN_TOKENS])
def test_steps_of_the_segment_path_take_the_tiled_variants(num_tokens, monkeypatch):
    """Up to 128 tokens the per-token variants run, from 129 the tiled ones; both equal expand-then-op."""
    from kernels import fused_lora_tiles_triton as tiles
    from kernels import fused_triton

    kernels = ["_silu_and_mul_tiles_kernel", "_add_rms_norm_tiles_kernel", "_rotary_tiles_kernel"]
    launches = record_calls(monkeypatch, tiles, *kernels)
    slots = [t % (NUM_SLOTS + 1) - 1 for t in range(num_tokens)]
    gate_up = _gate_up(slots, torch.float32)[:, :32]
    lora = exact_delta(slots, [16, 16], 8, torch.float32, seed=4, device=DEVICE)
    got = fused_triton.silu_and_mul(gate_up, lora)
    same_op(got, fused_triton.silu_and_mul(_expanded(gate_up, lora)))
    x, residual, weight = _norm_inputs(slots, torch.float32, True)
    lora = exact_delta(slots, [WIDTH], 8, torch.float32, seed=2, device=DEVICE)
    got = fused_triton.add_rms_norm(x, residual, weight, EPS, lora)[1]
    same_op(got, fused_triton.add_rms_norm(_expanded(x, lora), residual, weight, EPS)[1])
    got, want = (RotaryCase.random((4, 2, 16), num_tokens, torch.float32, DEVICE) for _ in range(2))
    lora = exact_delta(slots, got.widths, 8, torch.float32, seed=6, device=DEVICE)
    got.run(fused_triton.rotary_and_write_kv, lora)
    want.qkv.copy_(_expanded(want.qkv, lora))
    want.run(fused_triton.rotary_and_write_kv)
    for a, b in zip(got.outputs(), want.outputs()):
        same_op(a, b)
    assert [call.name for call in launches] == kernels * (lora_tuning.choose_path(num_tokens) == "sgmv")


def test_a_delta_marked_tiled_takes_the_tiled_variant_on_a_per_token_step(monkeypatch):
    """The step's choice (`LoRADelta.tiled`, `lora_tuning.tiled_decode_ops`) where the token count alone would
    take the per-token variant; the result equals expand-then-op as before."""
    from kernels import fused_lora_tiles_triton as tiles
    from kernels import fused_triton

    launches = record_calls(monkeypatch, tiles, "_silu_and_mul_tiles_kernel")
    slots = PATTERNS["unsorted_mixed"]
    assert lora_tuning.choose_path(len(slots)) == "bgmv"
    gate_up = _gate_up(slots, torch.float32)
    lora = exact_delta(slots, [INTERMEDIATE] * 2, 12, torch.float32, seed=4, device=DEVICE)
    got = fused_triton.silu_and_mul(gate_up, replace(lora, tiled=True))
    assert [call.name for call in launches] == ["_silu_and_mul_tiles_kernel"]
    same_op(got, fused_triton.silu_and_mul(_expanded(gate_up, lora)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_captured_tiled_silu_and_mul_of_a_per_token_step_replays_with_the_next_steps_slots_and_h():
    """A decode graph's tiled SiLU·up: 52 tokens (the per-token path) in 16-row tiles over the metadata's slots."""
    from kernels import fused_triton

    slots = PATTERNS["unsorted_mixed"]
    gate_up = _gate_up(slots, torch.bfloat16)
    lora = replace(exact_delta(slots, [INTERMEDIATE] * 2, 12, torch.bfloat16, seed=4, device=DEVICE), tiled=True)
    replays_the_next_step(lambda: (fused_triton.silu_and_mul(gate_up, lora),), [lora],
                          slots_tensor(list(reversed(slots)), DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_tiled_ops_replay_with_the_next_steps_slots_and_h():
    """The tiled kernels read the tiles and h from device tensors: a graph replays with what the next step wrote."""
    from kernels import fused_triton

    slots = PATTERNS["unsorted_mixed"] * 3  # 156 tokens: the segment path
    x, residual, weight = _norm_inputs(slots, torch.bfloat16, True)
    gate_up = _gate_up(slots, torch.bfloat16)
    norm_lora = exact_delta(slots, [WIDTH], 12, torch.bfloat16, seed=2, device=DEVICE)
    silu_lora = exact_delta(slots, [INTERMEDIATE] * 2, 12, torch.bfloat16, seed=4, device=DEVICE)
    silu_lora = LoRADelta(silu_lora.h, silu_lora.b_slices, norm_lora.meta)  # one metadata per step

    def step():
        return (*fused_triton.add_rms_norm(x, residual, weight, EPS, norm_lora),
                fused_triton.silu_and_mul(gate_up, silu_lora))

    replays_the_next_step(step, [norm_lora, silu_lora], slots_tensor(list(reversed(slots)), DEVICE))


# Llama-3-8B's widths on the GPU: the compiled walks at each rank class

LLAMA3_INTERMEDIATE = 14336
LLAMA3_HEADS = (32, 8, 128)


def _bf16_delta(slots: list[int], widths: list[int], rank: int) -> LoRADelta:
    """`_random_delta` with B in bf16, as the engine's slots hold it, on 64-token tiles."""
    delta = _random_delta(slots, widths, rank, block_m=64)
    return LoRADelta(delta.h, tuple(b.to(torch.bfloat16) for b in delta.b_slices), delta.meta)


def _written_relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """`relative_error` over the elements both hold; both must leave the same elements unwritten (NaN)."""
    written = ~want.isnan()
    assert torch.equal(~got.isnan(), written)
    return relative_error(got[written], want[written].double())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rank", [16, 32, 64])
def test_tiled_folds_at_llama3_widths_equal_expand_then_op_within_a_rounding(rank):
    """300 tokens, shuffled over the slots and base rows, in bf16 with Llama-3-8B's widths, compiled for the GPU: the
    SiLU·up's and the rotary's walks on B loaded once (their rank block of 64 covers every rank here) give the
    segment expand followed by the plain op, up to where the GPU's fused multiply-adds round (1.5e-5 to 5.1e-5 in
    `benchmarks/fused_ops.py` on the H200)."""
    from kernels import fused_lora_tiles_triton as tiles
    from kernels import fused_triton

    slots = _shuffled([t % (NUM_SLOTS + 1) - 1 for t in range(300)])
    gate_up = (torch.randn(len(slots), 2 * LLAMA3_INTERMEDIATE, generator=torch.Generator().manual_seed(3))
               .to(DEVICE, torch.bfloat16))
    lora = _bf16_delta(slots, [LLAMA3_INTERMEDIATE] * 2, rank)
    want = fused_triton.silu_and_mul(_expanded(gate_up, lora))
    assert _written_relative_error(tiles.silu_and_mul(gate_up, lora), want) <= 1e-3

    got = RotaryCase.random(LLAMA3_HEADS, len(slots), torch.bfloat16, DEVICE)
    want = RotaryCase.random(LLAMA3_HEADS, len(slots), torch.bfloat16, DEVICE)
    lora = _bf16_delta(slots, got.widths, rank)
    got.run(tiles.rotary_and_write_kv, lora)
    want.qkv.copy_(_expanded(want.qkv, lora))
    want.run(fused_triton.rotary_and_write_kv)
    for a, b in zip(got.outputs(), want.outputs()):
        assert _written_relative_error(a, b) <= 1e-3
