"""Cases the tiled (segment) LoRA variants of the fused ops are tested on: slot patterns of tiles, tile heights,
ranks and launch shapes, and SiLU·up inputs (`test_fused_lora_tiles`, `test_silu_shrink`)."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERMEDIATE = 80  # the SiLU·up cases' width


def shuffled(slots: list[int]) -> list[int]:
    """The slots in a fixed random order (in place)."""
    random.Random(0).shuffle(slots)
    return slots


# name -> per-token slots; tiles are 16 or 32 tokens
PATTERNS: dict[str, list[int]] = {
    # slot 2 spans three 16-token tiles, slots 1 and 3 have no tokens, base rows between
    "unsorted_mixed": shuffled([2] * 37 + [0] * 5 + [4] + [-1] * 9),
    "all_base": [-1] * 20,
    "one_slot": [3] * 33,
}


@dataclass(frozen=True)
class Launch:
    """Tile height of the metadata, the rank, and the launch config (None: the module's default)."""

    block_m: int
    rank: int
    config: object = None


def tile_launches() -> list:
    from kernels.fused_lora_tiles_triton import LoRATileConfig

    small = LoRATileConfig(chunk=16, block_r=16, num_warps=2, rows=16)
    return [pytest.param(Launch(16, 12), id="tile16-default"),
            pytest.param(Launch(32, 20, small), id="tile32-in-parts-rank20")]


def walk_launches() -> list:
    """The ops' launches, and 32-row tiles taken whole, so a program walks two 16-row steps (silu_and_mul,
    rotary_and_write_kv): on B loaded once (rank 12, one rank block), on B read each step (rank 20 in blocks of
    16), and with the default launch at rank 20 (the ops' rank block of 64 then covers it, so B is loaded once with
    its last 12 rank columns masked)."""
    from kernels.fused_lora_tiles_triton import LoRATileConfig

    whole = LoRATileConfig(chunk=16, block_r=16, num_warps=2, rows=0)
    return tile_launches() + [pytest.param(Launch(32, 12, whole), id="tile32-whole-rank12"),
                              pytest.param(Launch(32, 20, whole), id="tile32-whole-rank20"),
                              pytest.param(Launch(32, 20), id="tile32-default-rank20")]


def launch_config(launch: Launch) -> dict:
    """The launch's config as the ops' keyword (none for the module's default)."""
    return {} if launch.config is None else {"config": launch.config}


def gate_up_input(slots: list[int], dtype: torch.dtype) -> torch.Tensor:
    """SiLU·up's input [tokens, 2 x INTERMEDIATE]."""
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(len(slots), 2 * INTERMEDIATE, generator=gen) * 3).to(DEVICE, dtype)
