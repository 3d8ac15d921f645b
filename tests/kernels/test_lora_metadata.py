"""prepare_lora_metadata groups one step's tokens by slot for every LoRA layer of that step."""

import pytest
import torch

from kernels import LoRAMetadata, prepare_lora_metadata
from kernels.lora_metadata import UNKNOWN_RANK
from tests.kernels.lora_cases import NUM_SLOTS, PATTERNS, slots_tensor


def tiles(meta: LoRAMetadata) -> list[tuple[int, list[int]]]:
    """(slot, token indices) of every non-empty tile."""
    order = meta.token_order.tolist()
    found = []
    for j in range(meta.num_tiles):
        start, length = meta.tile_start[j].item(), meta.tile_len[j].item()
        if length:
            found.append((meta.tile_slot[j].item(), order[start : start + length]))
    return found


@pytest.mark.parametrize("pattern", PATTERNS.values(), ids=PATTERNS.keys())
def test_token_order_sorts_by_slot_with_base_tokens_last(pattern):
    meta = prepare_lora_metadata(slots_tensor(pattern), NUM_SLOTS)
    keys = [NUM_SLOTS if s < 0 else s for s in pattern]
    order = meta.token_order[: len(pattern)].tolist()
    assert sorted(order) == list(range(len(pattern)))
    assert [keys[t] for t in order] == sorted(keys)


@pytest.mark.parametrize("pattern", PATTERNS.values(), ids=PATTERNS.keys())
def test_group_counts_count_tokens_per_slot_and_base(pattern):
    meta = prepare_lora_metadata(slots_tensor(pattern), NUM_SLOTS)
    expected = [pattern.count(s) for s in range(NUM_SLOTS)] + [pattern.count(-1)]
    assert meta.group_counts.tolist() == expected


@pytest.mark.parametrize("block_m", [1, 2, 16])
@pytest.mark.parametrize("pattern", PATTERNS.values(), ids=PATTERNS.keys())
def test_tiles_cover_every_token_once_within_its_slot(pattern, block_m):
    meta = prepare_lora_metadata(
        slots_tensor(pattern), NUM_SLOTS, out=LoRAMetadata.empty(len(pattern), NUM_SLOTS, "cpu", block_m=block_m)
    )
    covered = []
    for slot, tokens in tiles(meta):
        assert len(tokens) <= block_m
        assert all(pattern[t] == slot for t in tokens)
        covered += tokens
    assert sorted(covered) == list(range(len(pattern)))


def test_filling_static_buffers_in_place_matches_a_fresh_preparation():
    out = LoRAMetadata.empty(32, NUM_SLOTS, "cpu", block_m=4)
    pointers = [t.data_ptr() for t in (out.slots, out.token_order, out.tile_slot, out.tile_start, out.tile_len)]
    prepare_lora_metadata(slots_tensor([1] * 30), NUM_SLOTS, out=out)
    pattern = PATTERNS["unsorted_with_empty_groups"]
    filled = prepare_lora_metadata(slots_tensor(pattern), NUM_SLOTS, out=out)
    fresh = prepare_lora_metadata(
        slots_tensor(pattern), NUM_SLOTS, out=LoRAMetadata.empty(len(pattern), NUM_SLOTS, "cpu", block_m=4)
    )
    assert filled is out and filled.num_tokens == len(pattern)
    assert [t.data_ptr() for t in (out.slots, out.token_order, out.tile_slot, out.tile_start, out.tile_len)] == pointers
    assert tiles(filled) == tiles(fresh)


def test_static_buffers_too_small_are_refused():
    with pytest.raises(ValueError, match="cannot hold"):
        prepare_lora_metadata(slots_tensor([0] * 9), NUM_SLOTS, out=LoRAMetadata.empty(8, NUM_SLOTS, "cpu"))


def test_no_tokens_gives_no_tiles():
    meta = prepare_lora_metadata(torch.empty(0, dtype=torch.int32), NUM_SLOTS)
    assert meta.num_tiles == 0 and meta.group_counts.sum().item() == 0


def test_each_token_and_tile_carries_its_slot_rank_and_base_tokens_rank_zero():
    pattern = PATTERNS["unsorted_with_empty_groups"]
    ranks = torch.arange(3, 3 + NUM_SLOTS, dtype=torch.int32)
    meta = prepare_lora_metadata(slots_tensor(pattern), NUM_SLOTS, slot_ranks=ranks,
                                 out=LoRAMetadata.empty(len(pattern), NUM_SLOTS, "cpu", block_m=2))
    assert meta.token_rank[: len(pattern)].tolist() == [0 if s < 0 else 3 + s for s in pattern]
    for j in range(meta.num_tiles):
        slot, length = meta.tile_slot[j].item(), meta.tile_len[j].item()
        assert meta.tile_rank[j].item() == (3 + slot if length and slot >= 0 else 0)


def test_slots_without_given_ranks_count_as_unknown_rank():
    meta = prepare_lora_metadata(slots_tensor([1, -1, 0]), NUM_SLOTS)
    assert meta.token_rank[:3].tolist() == [UNKNOWN_RANK, 0, UNKNOWN_RANK]


def test_slot_ranks_of_the_wrong_length_are_refused_before_any_buffer_changes():
    out = LoRAMetadata.empty(4, NUM_SLOTS, "cpu")
    with pytest.raises(ValueError, match="one rank per slot"):
        prepare_lora_metadata(slots_tensor([0, 1]), NUM_SLOTS, slot_ranks=torch.ones(NUM_SLOTS + 1, dtype=torch.int32),
                              out=out)
    assert out.num_tokens == 0 and not out.slots.any()


def test_the_path_follows_the_token_count_unless_the_step_chose_segments():
    small = prepare_lora_metadata(slots_tensor([0] * 64), NUM_SLOTS)
    large = prepare_lora_metadata(slots_tensor([0] * 200), NUM_SLOTS)
    assert (small.path, large.path) == ("bgmv", "sgmv")
    assert small.in_segments().path == "sgmv"


def test_metadata_in_segments_reads_the_buffers_a_preparation_fills():
    """A decode graph's segment variant shares its bucket's buffers: preparing into either fills both."""
    meta = LoRAMetadata.empty(32, NUM_SLOTS, "cpu")
    segments = meta.in_segments()
    prepare_lora_metadata(slots_tensor([1] * 32), NUM_SLOTS, out=segments)
    assert segments.num_tokens == 32 and segments.slots.data_ptr() == meta.slots.data_ptr()
    assert meta.slots[:32].tolist() == [1] * 32 and not meta.segments
