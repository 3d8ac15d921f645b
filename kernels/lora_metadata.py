"""Per-step grouping of tokens by adapter slot, shared by every LoRA layer of a step.

Computed once per step, outside the layers, with device ops only (no host sync), so
that the per-layer kernels read nothing but device tensors and fixed shapes. Given
preallocated buffers (`LoRAMetadata.empty`), it fills them in place: a CUDA graph
captured over the layers then stays valid when the next step's slots are written in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kernels import lora_tuning

# the rank of a slot whose rank is not given: larger than any max rank, so every row of it is read
UNKNOWN_RANK = 2**30


def max_tiles(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Upper bound on SGMV tiles: each non-empty group (slots and the base) adds at most one partial tile."""
    return -(-num_tokens // block_m) + min(num_slots + 1, num_tokens)


@dataclass
class LoRAMetadata:
    """Device tensors describing which adapter slot each token uses, grouped for the kernels.

    Buffers are sized for `capacity` tokens; the first `num_tokens` entries are in use.
    Tiles are runs of at most `block_m` tokens of one group in `token_order`: a tile of
    slot -1 holds base-model tokens, a tile of length 0 is unused.

    Ranks: a slot's A rows and B columns past its adapter's rank are zero padding up to the slots' max
    rank, and the kernels do not read them. `token_rank` and `tile_rank` carry each token's and each
    tile's slot rank (0 for base tokens) beside `slots` and `tile_slot`, so a kernel loads it with the slot,
    not after it. A slot whose rank is not given counts as UNKNOWN_RANK: every row is read (kernels take
    the smaller of it and the max rank).

    The kernels take the path `path` names: by the token count, or in segments whatever the count when the step
    chose them (`segments`, `in_segments`; `lora_tuning.step_path`).
    """

    num_tokens: int
    num_slots: int
    block_m: int
    slots: torch.Tensor  # [capacity] int32, slot per token, -1 = base model
    token_order: torch.Tensor  # [capacity] int32, token indices sorted by slot, base tokens last
    group_counts: torch.Tensor  # [num_slots + 1] int32, tokens per slot; the last entry counts base tokens
    tile_slot: torch.Tensor  # [max_tiles(capacity)] int32
    tile_start: torch.Tensor  # [max_tiles(capacity)] int32, offset into token_order
    tile_len: torch.Tensor  # [max_tiles(capacity)] int32
    token_rank: torch.Tensor  # [capacity] int32, the rank of each token's slot, 0 for base tokens
    tile_rank: torch.Tensor  # [max_tiles(capacity)] int32, the rank of each tile's slot, 0 for base or unused tiles
    segments: bool = False

    @classmethod
    def empty(
        cls, max_tokens: int, num_slots: int, device: torch.device | str, *, block_m: int | None = None
    ) -> LoRAMetadata:
        """Static buffers for up to `max_tokens` tokens, to be filled by `prepare_lora_metadata(out=...)`."""
        block_m = block_m or lora_tuning.sgmv_block_m(max_tokens)
        tiles = max_tiles(max_tokens, num_slots, block_m)

        def buf(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        return cls(0, num_slots, block_m, buf(max_tokens), buf(max_tokens), buf(num_slots + 1),
                   buf(tiles), buf(tiles), buf(tiles), buf(max_tokens), buf(tiles))

    @property
    def capacity(self) -> int:
        return self.slots.shape[0]

    @property
    def device(self) -> torch.device:
        return self.slots.device

    @property
    def path(self) -> str:
        """The path the LoRA kernels take: "sgmv" when the step chose segments, else `lora_tuning.choose_path`'s."""
        return "sgmv" if self.segments else lora_tuning.choose_path(self.num_tokens)

    def in_segments(self) -> LoRAMetadata:
        """The same buffers, read by the kernels in segments whatever the token count, for a step that chose them
        (`lora_tuning.step_path`). Preparing either fills both."""
        return replace(self, segments=True)

    @property
    def num_tiles(self) -> int:
        """SGMV grid size for the current token count (a function of shapes only)."""
        return max_tiles(self.num_tokens, self.num_slots, self.block_m)


def prepare_lora_metadata(slots: torch.Tensor, num_slots: int, *, slot_ranks: torch.Tensor | None = None,
                          out: LoRAMetadata | None = None) -> LoRAMetadata:
    """Group the tokens of one step by adapter slot (`slots[t]` in [-1, num_slots); -1 = base model).

    slot_ranks: [num_slots] int32 on the device, each slot's adapter rank (the kernels skip the padding past
    it); read on the device, so a CUDA graph captured over this call sees ranks written after capture.
    Without it every slot counts as UNKNOWN_RANK."""
    num_tokens = slots.shape[0]
    if slot_ranks is not None and slot_ranks.shape != (num_slots,):
        raise ValueError(f"slot_ranks must hold one rank per slot ({num_slots}), got {list(slot_ranks.shape)}")
    if out is None:
        out = LoRAMetadata.empty(num_tokens, num_slots, slots.device)
    elif out.num_slots != num_slots or out.capacity < num_tokens:
        raise ValueError(
            f"metadata buffers for {out.capacity} tokens and {out.num_slots} slots "
            f"cannot hold {num_tokens} tokens and {num_slots} slots"
        )
    device, block_m = out.device, out.block_m
    tiles = max_tiles(num_tokens, num_slots, block_m)

    key = slots.to(device=device, dtype=torch.int64)
    key = torch.where(key < 0, num_slots, key)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    group_start = torch.cumsum(counts, 0) - counts
    tiles_per_group = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles_per_group, 0)
    tile_index = torch.arange(tiles, device=device)
    group = torch.searchsorted(tile_end, tile_index, right=True)
    used = group <= num_slots
    group = group.clamp(max=num_slots)
    row0 = (tile_index - (tile_end - tiles_per_group)[group]) * block_m

    out.num_tokens = num_tokens
    out.slots[:num_tokens].copy_(slots)
    out.token_order[:num_tokens].copy_(order)
    out.group_counts.copy_(counts)
    out.tile_slot[:tiles].copy_(torch.where(used & (group < num_slots), group, -1))
    out.tile_start[:tiles].copy_(torch.where(used, group_start[group] + row0, 0))
    out.tile_len[:tiles].copy_(torch.where(used, (counts[group] - row0).clamp(0, block_m), 0))
    if slot_ranks is None:
        slot_ranks = torch.full((num_slots,), UNKNOWN_RANK, dtype=torch.int32, device=device)
    rank_of = torch.cat([slot_ranks.to(device=device, dtype=torch.int32),
                         torch.zeros(1, dtype=torch.int32, device=device)])  # the base model's group: rank 0
    out.token_rank[:num_tokens].copy_(rank_of[key])
    out.tile_rank[:tiles].copy_(torch.where(used, rank_of[group], 0))
    return out
