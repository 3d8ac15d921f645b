"""Every LoRA implementation (torch reference, Triton BGMV and SGMV, with and without split-K) against a
float64 per-token oracle, on fresh random inputs, with poisoned outputs.

Shapes are small and deliberately awkward: rank 20 and K 70 are not powers of two or multiples of
the blocks, the three slices have unequal widths (as q/k/v under GQA), SGMV tiles of 4 rows split
groups, and the Triton blocks are small so every loop runs several partial iterations.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import pytest
import torch

from kernels import LoRAMetadata, lora_torch, lora_triton, prepare_lora_metadata
from kernels.lora_tuning import ExpandConfig, ShrinkConfig
from tests.fresh_interpreter import run_pytest_interpreted
from tests.kernels.lora_cases import (
    NUM_SLOTS,
    PATTERNS,
    expand_reference,
    packed_weights,
    random_weights,
    relative_error,
    shrink_reference,
    skip_without_triton,
    slots_tensor,
    triton_runs_in_process,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_HERE = triton_runs_in_process()
needs_triton = skip_without_triton()  # the subprocess test runs them then
K, RANK = 70, 20
WIDTHS = (40, 24, 13)
POISON = -7777.0


@dataclass(frozen=True)
class Impl:
    shrink: Callable
    expand: Callable


def _triton(path: str, block_r: int, split_k: int) -> Impl:
    return Impl(
        partial(lora_triton.shrink_slices, path=path,
                config=ShrinkConfig(block_r=block_r, block_k=16, split_k=split_k, num_warps=4, num_stages=1)),
        partial(lora_triton.expand_slices, path=path,
                config=ExpandConfig(block_n=16, block_r=block_r, num_warps=4, num_stages=1, n_blocks=split_k)),
    )


IMPLS = [
    pytest.param(Impl(lora_torch.shrink_slices, lora_torch.expand_slices), id="torch"),
    pytest.param(_triton("bgmv", block_r=8, split_k=1), id="bgmv", marks=needs_triton),
    pytest.param(_triton("bgmv", block_r=8, split_k=2), id="bgmv_split_k_n_blocks", marks=needs_triton),
    pytest.param(_triton("sgmv", block_r=16, split_k=1), id="sgmv", marks=needs_triton),
    pytest.param(_triton("sgmv", block_r=16, split_k=3), id="sgmv_split_k_n_blocks", marks=needs_triton),
]
# float32 dots run as tf32 on the GPU's tensor cores; elsewhere they are exact float32.
TOLERANCE = {torch.float32: 5e-3 if DEVICE == "cuda" else 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture(params=IMPLS)
def impl(request) -> Impl:
    return request.param


def metadata(pattern: list[int]) -> LoRAMetadata:
    return prepare_lora_metadata(
        slots_tensor(pattern, DEVICE), NUM_SLOTS, out=LoRAMetadata.empty(len(pattern), NUM_SLOTS, DEVICE, block_m=4)
    )


def check_shrink(impl: Impl, pattern: list[int], dtype: torch.dtype, num_slices: int = 3, weights=random_weights) -> None:
    slots = slots_tensor(pattern, DEVICE)
    x = torch.randn(len(pattern), K, device=DEVICE).to(dtype)
    a_slices = weights([(RANK, K)] * num_slices, dtype, DEVICE)
    out = torch.full((num_slices, len(pattern), RANK), POISON, device=DEVICE)
    h = impl.shrink(x, a_slices, metadata(pattern), out)
    ref = shrink_reference(x, a_slices, slots)
    base = slots < 0
    assert h is out
    assert torch.equal(h[:, base], torch.zeros_like(h[:, base]))
    assert relative_error(h[:, ~base], ref[:, ~base]) <= TOLERANCE[torch.float32]


def check_expand(impl: Impl, pattern: list[int], dtype: torch.dtype, widths: tuple[int, ...] = WIDTHS,
                 weights=random_weights) -> None:
    slots = slots_tensor(pattern, DEVICE)
    base = slots < 0
    h = torch.randn(len(widths), len(pattern), RANK, device=DEVICE)
    h[:, base] = float("nan")  # read for a base token, it would spread
    b_slices = weights([(w, RANK) for w in widths], dtype, DEVICE)
    wide = torch.full((len(pattern), sum(widths) + 5), POISON, dtype=dtype, device=DEVICE)
    wide[:, 2 : 2 + sum(widths)] = torch.randn(len(pattern), sum(widths), device=DEVICE).to(dtype)
    before = wide.clone()
    y = wide[:, 2 : 2 + sum(widths)]  # a strided view: the kernels must stay inside it
    ref = expand_reference(y, h, b_slices, slots)
    impl.expand(y, h, b_slices, metadata(pattern))
    assert torch.equal(wide[:, :2], before[:, :2]) and torch.equal(wide[:, -3:], before[:, -3:])
    assert torch.equal(y[base], before[base, 2 : 2 + sum(widths)])
    if (~base).any():
        assert relative_error(y[~base], ref[~base]) <= TOLERANCE[dtype]


@pytest.mark.parametrize("pattern", PATTERNS.values(), ids=PATTERNS.keys())
def test_shrink_matches_float64_and_zeroes_base_rows(impl, pattern):
    check_shrink(impl, pattern, torch.float32)


@pytest.mark.parametrize("pattern", PATTERNS.values(), ids=PATTERNS.keys())
def test_expand_matches_float64_and_leaves_base_rows_and_neighbours_untouched(impl, pattern):
    check_expand(impl, pattern, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_shrink_accumulates_half_precision_inputs_in_float32(impl, dtype):
    check_shrink(impl, PATTERNS["unsorted_with_empty_groups"], dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_expand_adds_into_half_precision_outputs(impl, dtype):
    check_expand(impl, PATTERNS["unsorted_with_empty_groups"], dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_expand_takes_h_rounded_to_the_weights_dtype_as_peft_does(impl, dtype):
    """peft's lora_B receives lora_A's output in the adapter's dtype. h = 1 + eps/4 rounds to 1 there, so
    y = -rank plus rank products of 1 is exactly 0; an unrounded h would leave 5 eps in y."""
    pattern = PATTERNS["unsorted_with_empty_groups"]
    base = slots_tensor(pattern, DEVICE) < 0
    h = torch.full((len(WIDTHS), len(pattern), RANK), 1 + torch.finfo(dtype).eps / 4, device=DEVICE)
    b_slices = [torch.ones(NUM_SLOTS, width, RANK, dtype=dtype, device=DEVICE) for width in WIDTHS]
    y = torch.full((len(pattern), sum(WIDTHS)), -float(RANK), dtype=dtype, device=DEVICE)
    impl.expand(y, h, b_slices, metadata(pattern))
    assert torch.equal(y[~base], torch.zeros_like(y[~base]))


@pytest.mark.parametrize("num_slices", [1, 2])
def test_shrink_with_fewer_slices(impl, num_slices):
    check_shrink(impl, PATTERNS["unsorted_with_empty_groups"], torch.float32, num_slices)


@pytest.mark.parametrize("widths", [(37,), (24, 40)], ids=["one", "two"])
def test_expand_with_fewer_slices(impl, widths):
    check_expand(impl, PATTERNS["unsorted_with_empty_groups"], torch.float32, widths)


def test_shrink_reads_slots_packed_in_one_buffer(impl):
    check_shrink(impl, PATTERNS["unsorted_with_empty_groups"], torch.bfloat16, weights=packed_weights)


def test_expand_reads_slots_packed_in_one_buffer(impl):
    check_expand(impl, PATTERNS["unsorted_with_empty_groups"], torch.bfloat16, weights=packed_weights)


@pytest.mark.skipif(TRITON_HERE, reason="the Triton kernels ran in this process")
def test_triton_kernels_in_a_fresh_interpreter():
    run_pytest_interpreted(Path(__file__).parent)


@needs_triton
@pytest.mark.parametrize("num_tokens", [1, 5, 16, 33])
def test_shrink_spaces_its_slices_a_multiple_of_16_rows_apart(num_tokens):
    """h's slice stride, an argument of every kernel that reads h, then divides by 16 whatever a step's token
    count: Triton specializes on that, so it compiles one variant of those kernels, not another mid-run."""
    pattern = [t % (NUM_SLOTS + 1) - 1 for t in range(num_tokens)]
    x = torch.randn(num_tokens, K, device=DEVICE)
    a_slices = random_weights([(RANK, K)] * 3, torch.float32, DEVICE)
    h = lora_triton.shrink_slices(x, a_slices, metadata(pattern))
    ref = shrink_reference(x, a_slices, slots_tensor(pattern, DEVICE))
    assert h.shape == (3, num_tokens, RANK) and h.stride(0) % 16 == 0
    assert relative_error(h, ref) <= TOLERANCE[torch.float32]
