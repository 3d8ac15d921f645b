"""The grouped per-token (BGMV) launch: a program per metadata tile of `group` same-slot tokens, which needs
metadata made with that tile height. Its results are checked with every other implementation in test_lora_ops."""

from __future__ import annotations

import pytest
import torch

from kernels import LoRAMetadata, lora_triton, prepare_lora_metadata
from kernels.lora_tuning import ExpandConfig, ShrinkConfig
from tests.kernels.lora_cases import (
    NUM_SLOTS,
    PATTERNS,
    random_weights,
    record_calls,
    slots_tensor,
    triton_runs_in_process,
)

pytestmark = pytest.mark.skipif(not triton_runs_in_process(), reason="Triton kernels do not run in this process")

PATTERN = PATTERNS["long_runs"]
K, RANK, WIDTH = 32, 8, 24


def metadata(block_m: int) -> LoRAMetadata:
    return prepare_lora_metadata(
        slots_tensor(PATTERN), NUM_SLOTS, out=LoRAMetadata.empty(len(PATTERN), NUM_SLOTS, "cpu", block_m=block_m)
    )


def shrink(meta: LoRAMetadata, group: int) -> torch.Tensor:
    config = ShrinkConfig(block_r=8, block_k=32, split_k=1, num_warps=4, num_stages=1, group=group)
    return lora_triton.shrink_slices(torch.randn(len(PATTERN), K), random_weights([(RANK, K)], torch.float32), meta,
                                     path="bgmv", config=config)


def expand(meta: LoRAMetadata, group: int) -> None:
    config = ExpandConfig(block_n=16, block_r=8, num_warps=4, num_stages=1, group=group)
    lora_triton.expand_slices(torch.zeros(len(PATTERN), WIDTH), torch.randn(1, len(PATTERN), RANK),
                              random_weights([(WIDTH, RANK)], torch.float32), meta, path="bgmv", config=config)


@pytest.mark.parametrize("op", [shrink, expand], ids=["shrink", "expand"])
def test_a_group_needs_metadata_tiles_of_its_height(op):
    with pytest.raises(ValueError, match="group 4 needs metadata tiles of 4 rows, these have 2"):
        op(metadata(block_m=2), group=4)


@pytest.mark.parametrize("op", [shrink, expand], ids=["shrink", "expand"])
def test_a_grouped_launch_runs_a_program_per_tile(monkeypatch, op):
    calls = record_calls(monkeypatch, lora_triton, "_shrink_bgmv_kernel", "_expand_bgmv_kernel")
    meta = metadata(block_m=4)
    op(meta, group=4)
    assert calls[0].grid[0] == meta.num_tiles and calls[0].kwargs["GROUP"] == 4


@pytest.mark.parametrize("op", [shrink, expand], ids=["shrink", "expand"])
def test_group_one_runs_a_program_per_token_on_any_tiles(monkeypatch, op):
    calls = record_calls(monkeypatch, lora_triton, "_shrink_bgmv_kernel", "_expand_bgmv_kernel")
    op(metadata(block_m=4), group=1)
    assert calls[0].grid[0] == len(PATTERN) and calls[0].kwargs["GROUP"] == 1
