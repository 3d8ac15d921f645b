"""Which decode graph a step replays (checked on the CPU: the choice is host logic): the smallest bucket
that holds its rows, with the LoRA work only when some row uses an adapter, with the LoRA kernels in segments at ranks
above 16 where `lora_tuning.path_for` says (from 32 or 64 rows when the rows share few adapters, from 80 rows
otherwise), else, from 32 rows when the rows share few adapters, with the SiLU·up fold's tiled variant
(`lora_tuning.tiled_decode_ops`)."""
from __future__ import annotations

import pytest

from engine.cuda_graphs import GraphKey, bucket_keys, captured_lora_keys, default_buckets, graph_key
from kernels import lora_tuning

BUCKETS = default_buckets(128)  # 1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128
TILED = frozenset({"silu_and_mul"})


def key(num_lora_slots: int, batch: int, lora_slots: list[int], max_rank: int = 16,
        rank_width: int | None = None) -> GraphKey:
    """The key of a step on graphs captured now for slots of `max_rank`, with the switches as they are."""
    captured = captured_lora_keys(BUCKETS, num_lora_slots, max_rank)
    return graph_key(BUCKETS, num_lora_slots, batch, lora_slots, captured, rank_width)


@pytest.fixture(autouse=True)
def _default_switches(monkeypatch):
    for env in (lora_tuning.FOLD_EXPAND_ENV, lora_tuning.DECODE_TILES_ENV, lora_tuning.DECODE_SEGMENTS_ENV):
        monkeypatch.delenv(env, raising=False)


def test_a_step_replays_the_smallest_bucket_that_holds_its_rows():
    assert [key(0, batch, [-1] * batch).bucket for batch in (1, 3, 8, 9, 33, 64)] == \
        [1, 4, 8, 16, 48, 64]


def test_a_step_whose_rows_use_no_adapter_replays_the_graph_without_the_lora_work():
    assert key(4, 5, [-1] * 5) == GraphKey(8, False)
    assert key(4, 40, [-1] * 40) == GraphKey(48, False)


def test_one_adapter_row_is_enough_for_the_graph_with_the_lora_work():
    assert key(4, 5, [-1, -1, -1, 0, -1]) == GraphKey(8, True)
    assert key(4, 2, [3, 1]) == GraphKey(2, True)


def test_many_rows_on_few_adapters_replay_the_graph_with_the_tiled_fold():
    assert key(4, 32, [2] * 32) == GraphKey(32, True, TILED)
    assert key(4, 64, [i % 4 for i in range(64)]) == GraphKey(64, True, TILED)


def test_rows_spread_over_many_adapters_replay_the_per_token_fold():
    assert key(16, 64, [i % 16 for i in range(64)]) == GraphKey(64, True)


def test_the_bucket_not_the_batch_decides_whether_a_step_may_tile():
    """25 rows on one adapter fill the 32-row bucket: its size is what the kernels launch over."""
    assert key(4, 25, [1] * 25) == GraphKey(32, True, TILED)
    assert key(4, 16, [1] * 16) == GraphKey(16, True)


def test_the_tiled_fold_is_not_chosen_when_switched_off(monkeypatch):
    monkeypatch.setenv(lora_tuning.DECODE_TILES_ENV, "0")
    assert key(4, 64, [0] * 64) == GraphKey(64, True)


@pytest.mark.parametrize("bucket", BUCKETS)
def test_a_bucket_is_captured_with_the_tiled_fold_only_from_32_rows(bucket):
    keys = [GraphKey(bucket, False), GraphKey(bucket, True)] + [GraphKey(bucket, True, TILED)] * (bucket >= 32)
    assert bucket_keys(bucket, 4, 16) == keys


def test_a_bucket_without_adapter_slots_is_captured_once():
    assert bucket_keys(64, 0, 16) == [GraphKey(64, False)]


@pytest.mark.parametrize("max_rank", [8, 16, 32, 64])
def test_every_key_a_step_can_take_is_captured(max_rank):
    for batch in range(1, 129):
        for spread in (1, 2, 4, 8, 16, 64):
            for width in {None, lora_tuning.narrow_rank_width(max_rank)}:
                step_key = key(64, batch, [i % spread for i in range(batch)], max_rank, width)
                assert step_key in bucket_keys(step_key.bucket, 64, max_rank)


@pytest.mark.parametrize("env", [lora_tuning.DECODE_TILES_ENV, lora_tuning.FOLD_EXPAND_ENV,
                                 lora_tuning.DECODE_SEGMENTS_ENV])
def test_a_switch_turned_on_after_capture_names_no_graph_that_was_not_captured(monkeypatch, env):
    """The graphs were captured with the switch off (no tiled or segment graph for rows on few adapters, at rank 16
    or 64); the keys read the graphs captured (`DecodeGraphs.lora_keys`), not the switch as it is now."""
    monkeypatch.setenv(lora_tuning.DECODE_TILES_ENV, "0")
    monkeypatch.setenv(lora_tuning.DECODE_SEGMENTS_ENV, "0")
    monkeypatch.setenv(env, "0")
    for max_rank in (16, 64):
        captured = bucket_keys(64, 4, max_rank)
        captured_keys = captured_lora_keys(BUCKETS, 4, max_rank)
        monkeypatch.setenv(env, "1")
        step_key = graph_key(BUCKETS, 4, 64, [0] * 64, captured_keys)
        assert step_key in captured and step_key == GraphKey(64, True)
        monkeypatch.setenv(env, "0")


def test_a_switch_turned_off_after_capture_keeps_the_tiled_graph_it_captured(monkeypatch):
    captured_keys = captured_lora_keys(BUCKETS, 4, 16)
    monkeypatch.setenv(lora_tuning.DECODE_TILES_ENV, "0")
    assert graph_key(BUCKETS, 4, 64, [0] * 64, captured_keys) == GraphKey(64, True, TILED)


def test_slots_wider_than_16_capture_every_lora_graph_at_rank_width_16_too():
    keys = bucket_keys(32, 4, 64)
    assert keys == [GraphKey(32, False), GraphKey(32, True), GraphKey(32, True, rank_width=16),
                    GraphKey(32, True, segments=True), GraphKey(32, True, TILED, 16)]


@pytest.mark.parametrize("max_rank", [32, 64])
def test_many_rows_on_few_adapters_of_rank_32_and_more_replay_the_segment_graph(max_rank):
    assert key(4, 64, [i % 4 for i in range(64)], max_rank) == GraphKey(64, True, segments=True)


def test_rank_64_slots_replay_segment_graphs_from_32_rows_and_rank_32_slots_from_64():
    assert key(4, 25, [1] * 25, 64) == GraphKey(32, True, segments=True)
    assert key(4, 25, [1] * 25, 32) == GraphKey(32, True, TILED)
    assert key(4, 40, [1] * 40, 32) == GraphKey(48, True, TILED)


def test_rows_of_rank_64_slots_spread_over_many_adapters_stay_per_token_below_80():
    assert key(16, 64, [i % 16 for i in range(64)], 64) == GraphKey(64, True)


@pytest.mark.parametrize("max_rank", [32, 64])
@pytest.mark.parametrize("bucket", [80, 96, 112, 128])
def test_buckets_from_80_rows_of_rank_32_and_more_run_in_segments_whatever_the_adapters(max_rank, bucket):
    """Their graph for rows spread over many adapters is in segments, so rows on few adapters replay the same one."""
    assert key(64, bucket, [i % 64 for i in range(bucket)], max_rank) == GraphKey(bucket, True, segments=True)
    assert key(64, bucket - 8, [0] * (bucket - 8), max_rank) == GraphKey(bucket, True, segments=True)
    assert bucket_keys(bucket, 64, max_rank) == [GraphKey(bucket, False), GraphKey(bucket, True, segments=True),
                                                 GraphKey(bucket, True, rank_width=16),
                                                 GraphKey(bucket, True, TILED, 16)]


def test_buckets_of_rank_16_spread_over_many_adapters_stay_per_token():
    assert key(64, 128, [i % 64 for i in range(128)], 16) == GraphKey(128, True)
    assert key(64, 128, [i % 8 for i in range(128)], 16) == GraphKey(128, True, TILED)


def test_narrow_adapters_in_wide_slots_replay_the_tiled_graph_of_rank_width_16():
    """Their launches take the rank-16 shapes, where the per-token path with the tiled fold wins."""
    assert key(4, 64, [0] * 64, 64, rank_width=16) == GraphKey(64, True, TILED, 16)


@pytest.mark.parametrize(("largest", "max_rank", "width"),
                         [(16, 64, 16), (4, 64, 16), (0, 32, 16), (17, 64, None), (64, 64, None), (8, 16, None)])
def test_a_step_reads_the_slots_at_width_16_when_its_adapters_fit_and_the_slots_are_wider(largest, max_rank, width):
    assert lora_tuning.rank_width(largest, max_rank) == width


def test_a_step_of_narrow_adapters_replays_the_narrow_graph_that_was_captured():
    step_key = key(4, 40, [1] * 40, 32, rank_width=16)
    assert step_key == GraphKey(48, True, TILED, 16)
    assert step_key in bucket_keys(48, 4, 32)
