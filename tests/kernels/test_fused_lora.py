"""The fused ops with a LoRA delta (`lora=`) against "expand first, then the op".

Each op must compute as if the expand had run on its input, rounded once, and then the op: on mixed
batches (several adapters, base-model rows of slot -1), a rank that is not a power of two, and B
stacks packed in one buffer as the engine lays its slots out. The oracle is the same backend's
unfused expand and plain op (test_lora_ops and test_fused hold those to torch and float64): the
Triton interpreter truncates float32 -> bfloat16 where torch rounds, so only the same backend can
agree to the bit in bfloat16. h and B hold multiples of 1/8 and 1/16, so the delta's float32 sum is
exact in any order and the ops must match their oracle exactly (RMSNorm's normed output within a
rounding: the LoRA variant adds the squares in chunks). The Triton kernels run both in their default
launch shape and in a small one where columns, heads and the rank take several steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels import LoRADelta, fused, fused_torch, lora_torch, prepare_lora_metadata
from tests.kernels.lora_cases import (
    HEAD_SHAPES,
    NUM_SLOTS,
    RotaryCase,
    exact_delta,
    expand_reference,
    packed_weights,
    replays_the_next_step,
    same,
    skip_without_triton,
    slots_tensor,
    triton_runs_in_process,
    within_a_rounding,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SLOTS = [3, -1, 0, 3, 1, -1, 4]  # several adapters, one used twice, base-model rows between
BASE_ROWS = [t for t, slot in enumerate(SLOTS) if slot < 0]
RANK = 12
EPS = 1e-6
needs_triton = skip_without_triton()


@dataclass
class Impl:
    """A fused-op backend, the expand of the same backend, and the launch configs its LoRA variants take."""

    ops: object
    lora: object
    configs: dict

    def config(self, kind: str) -> dict:
        return {"config": self.configs[kind]} if kind in self.configs else {}

    def expanded(self, y: torch.Tensor, delta: LoRADelta) -> torch.Tensor:
        """A copy of y with the delta applied by this backend's expand."""
        y = y.clone()
        self.lora.expand_slices(y, delta.h, delta.b_slices, delta.meta)
        return y


def _impls():
    impls = [pytest.param(Impl(fused_torch, lora_torch, {}), id="torch")]
    if triton_runs_in_process():
        from kernels import fused_triton, lora_triton
        from kernels.fused_triton import LoRAOpConfig

        small = LoRAOpConfig(chunk=32, block_r=4, num_warps=2, chunks_per_program=2)
        heads = LoRAOpConfig(chunk=2, block_r=8, num_warps=2)
        impls += [pytest.param(Impl(fused_triton, lora_triton, {}), id="triton"),
                  pytest.param(Impl(fused_triton, lora_triton, {"small": small, "heads": heads}),
                               id="triton-chunked")]
    return impls


@pytest.fixture(params=_impls())
def impl(request) -> Impl:
    return request.param


def _delta(widths: list[int], dtype: torch.dtype, seed: int) -> LoRADelta:
    return exact_delta(SLOTS, widths, RANK, dtype, seed, DEVICE)


# add_rms_norm

WIDTH = 72


def _norm_inputs(dtype: torch.dtype, with_residual: bool):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(SLOTS), WIDTH, generator=gen).to(DEVICE, dtype)
    residual = torch.randn(len(SLOTS), WIDTH, generator=gen).to(DEVICE, dtype) if with_residual else None
    weight = torch.rand(WIDTH, generator=gen).add(0.5).to(DEVICE, dtype)
    return x, residual, weight, _delta([WIDTH], dtype, seed=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_with_lora_equals_expand_then_norm(impl, dtype, with_residual):
    x, residual, weight, lora = _norm_inputs(dtype, with_residual)
    out, hidden = impl.ops.add_rms_norm(x, residual, weight, EPS, lora, **impl.config("small"))
    want_out, want_hidden = impl.ops.add_rms_norm(impl.expanded(x, lora), residual, weight, EPS)
    same(hidden, want_hidden)
    within_a_rounding(out, want_out)


@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_with_lora_leaves_x_unchanged(impl, with_residual):
    x, residual, weight, lora = _norm_inputs(torch.bfloat16, with_residual)
    before = x.clone()
    impl.ops.add_rms_norm(x, residual, weight, EPS, lora, **impl.config("small"))
    assert torch.equal(x, before)


@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_rows_without_an_adapter_match_the_plain_norm(impl, with_residual):
    """The residual rows are the plain sum exactly; the normed rows agree up to the order in which the
    squares add up (the LoRA variant sums them in chunks)."""
    x, residual, weight, lora = _norm_inputs(torch.float32, with_residual)
    out, hidden = impl.ops.add_rms_norm(x, residual, weight, EPS, lora, **impl.config("small"))
    plain_out, plain_hidden = impl.ops.add_rms_norm(x, residual, weight, EPS)
    same(hidden[BASE_ROWS], plain_hidden[BASE_ROWS])
    within_a_rounding(out[BASE_ROWS], plain_out[BASE_ROWS])


# silu_and_mul

INTERMEDIATE = 80


def _silu_inputs(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(len(SLOTS), 2 * INTERMEDIATE, generator=gen) * 3).to(DEVICE, dtype)
    return gate_up, _delta([INTERMEDIATE, INTERMEDIATE], dtype, seed=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_with_lora_equals_expand_then_op(impl, dtype):
    gate_up, lora = _silu_inputs(dtype)
    got = impl.ops.silu_and_mul(gate_up, lora, **impl.config("small"))
    same(got, impl.ops.silu_and_mul(impl.expanded(gate_up, lora)))


def test_silu_and_mul_with_lora_leaves_gate_up_unchanged(impl):
    gate_up, lora = _silu_inputs(torch.bfloat16)
    before = gate_up.clone()
    impl.ops.silu_and_mul(gate_up, lora, **impl.config("small"))
    assert torch.equal(gate_up, before)


def test_silu_and_mul_rows_without_an_adapter_equal_the_plain_op(impl):
    gate_up, lora = _silu_inputs(torch.bfloat16)
    got = impl.ops.silu_and_mul(gate_up, lora, **impl.config("small"))
    assert torch.equal(got[BASE_ROWS], impl.ops.silu_and_mul(gate_up)[BASE_ROWS])


# rotary_and_write_kv

def _rotary_case(shape: tuple[int, int, int], dtype: torch.dtype) -> RotaryCase:
    return RotaryCase.random(shape, len(SLOTS), dtype, DEVICE)


@pytest.mark.parametrize("shape", HEAD_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_write_kv_with_lora_equals_expand_then_op(impl, shape, dtype):
    """q and k end rotated after their delta, v holds its delta, and the caches hold both."""
    got, want = _rotary_case(shape, dtype), _rotary_case(shape, dtype)
    lora = _delta(got.widths, dtype, seed=6)
    got.run(impl.ops.rotary_and_write_kv, lora, **impl.config("heads"))
    want.qkv.copy_(impl.expanded(want.qkv, lora))
    want.run(impl.ops.rotary_and_write_kv)
    for a, b in zip(got.outputs(), want.outputs()):
        same(a, b)


def test_rotary_and_write_kv_rows_without_an_adapter_equal_the_plain_op(impl):
    got, plain = _rotary_case((6, 3, 24), torch.bfloat16), _rotary_case((6, 3, 24), torch.bfloat16)
    got.run(impl.ops.rotary_and_write_kv, _delta(got.widths, torch.bfloat16, seed=6), **impl.config("heads"))
    plain.run(impl.ops.rotary_and_write_kv)
    base_slots = got.slot_mapping[BASE_ROWS]
    assert torch.equal(got.qkv[BASE_ROWS], plain.qkv[BASE_ROWS])
    for a, b in [(got.k_cache, plain.k_cache), (got.v_cache, plain.v_cache)]:
        assert torch.equal(a.flatten(0, 1)[base_slots], b.flatten(0, 1)[base_slots])


# the torch backend on a step of the segment path

SEGMENT_SLOTS = [t % (NUM_SLOTS + 1) - 1 for t in range(150)]  # more tokens than the per-token path takes


def _float64_expanded(y: torch.Tensor, delta: LoRADelta) -> torch.Tensor:
    return expand_reference(y, delta.h, delta.b_slices, slots_tensor(SEGMENT_SLOTS, DEVICE))


def test_the_torch_silu_and_mul_takes_a_delta_on_segment_metadata():
    gate_up = torch.randn(len(SEGMENT_SLOTS), 2 * INTERMEDIATE, generator=torch.Generator().manual_seed(3))
    lora = exact_delta(SEGMENT_SLOTS, [INTERMEDIATE] * 2, RANK, torch.float32, seed=4, device=DEVICE, block_m=64)
    got = fused_torch.silu_and_mul(gate_up.to(DEVICE), lora)
    same(got, fused_torch.silu_and_mul(_float64_expanded(gate_up.to(DEVICE), lora).float()))


def test_the_torch_rotary_and_write_kv_takes_a_delta_on_segment_metadata():
    got, want = (RotaryCase.random((4, 2, 16), len(SEGMENT_SLOTS), torch.float32, DEVICE) for _ in range(2))
    lora = exact_delta(SEGMENT_SLOTS, got.widths, RANK, torch.float32, seed=6, device=DEVICE, block_m=64)
    got.run(fused_torch.rotary_and_write_kv, lora)
    want.qkv.copy_(_float64_expanded(want.qkv, lora))
    want.run(fused_torch.rotary_and_write_kv)
    for a, b in zip(got.outputs(), want.outputs()):
        same(a, b)


# the dispatcher

@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_the_dispatcher_hands_the_delta_to_either_backend(backend, monkeypatch):
    monkeypatch.setenv(fused.BACKEND_ENV, backend)
    gate_up, lora = _silu_inputs(torch.float32)
    want = gate_up.clone()
    lora.apply(want)
    torch.testing.assert_close(fused.silu_and_mul(gate_up, lora), fused_torch.silu_and_mul(want), rtol=1e-6,
                               atol=1e-6)


def test_a_delta_prepared_for_another_batch_is_refused():
    x, residual, weight, _ = _norm_inputs(torch.float32, True)
    other = LoRADelta(torch.zeros(1, 3, RANK, device=DEVICE), tuple(packed_weights([(WIDTH, RANK)], torch.float32,
                                                                                   DEVICE)),
                      prepare_lora_metadata(torch.zeros(3, dtype=torch.int32, device=DEVICE), NUM_SLOTS))
    with pytest.raises(ValueError, match="prepared for 3 tokens"):
        fused.add_rms_norm(x, residual, weight, EPS, other)


def test_a_delta_of_other_widths_is_refused():
    gate_up, _ = _silu_inputs(torch.float32)
    with pytest.raises(ValueError, match="widths"):
        fused.silu_and_mul(gate_up, _delta([INTERMEDIATE, INTERMEDIATE + 8], torch.float32, seed=7))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_fused_ops_with_lora_replay_with_the_next_steps_slots_and_h():
    """The kernels read slots and h from device tensors: a graph replays with what the next step wrote."""
    from kernels import fused_triton

    x, residual, weight, lora = _norm_inputs(torch.bfloat16, True)
    gate_up, gate_up_lora = _silu_inputs(torch.bfloat16)
    gate_up_lora = LoRADelta(gate_up_lora.h, gate_up_lora.b_slices, lora.meta)  # one metadata per step

    def step():
        return (*fused_triton.add_rms_norm(x, residual, weight, EPS, lora),
                fused_triton.silu_and_mul(gate_up, gate_up_lora))

    replays_the_next_step(step, [lora, gate_up_lora], slots_tensor(list(reversed(SLOTS)), DEVICE))
