"""Which decode graph a step replays (checked on the CPU: the choice is host logic): the smallest bucket
that holds its rows, with the LoRA work only when some row uses an adapter."""
from __future__ import annotations

from engine.cuda_graphs import default_buckets, graph_key

BUCKETS = default_buckets(64)  # 1, 2, 4, 8, 16, 32, 48, 64


def test_a_step_replays_the_smallest_bucket_that_holds_its_rows():
    assert [graph_key(BUCKETS, 0, batch, [-1] * batch)[0] for batch in (1, 3, 8, 9, 33, 64)] == \
        [1, 4, 8, 16, 48, 64]


def test_a_step_whose_rows_use_no_adapter_replays_the_graph_without_the_lora_work():
    assert graph_key(BUCKETS, 4, 5, [-1] * 5) == (8, False)


def test_one_adapter_row_is_enough_for_the_graph_with_the_lora_work():
    assert graph_key(BUCKETS, 4, 5, [-1, -1, -1, 0, -1]) == (8, True)
    assert graph_key(BUCKETS, 4, 2, [3, 1]) == (2, True)

