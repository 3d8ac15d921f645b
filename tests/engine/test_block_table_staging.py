"""The CUDA graphs' staged block tables: rewritten row by row only where they changed, yet always
equal to the tables padded afresh (checked on the CPU: the staging is numpy)."""
from __future__ import annotations

import numpy as np

from engine.cuda_graphs import StagedBlockTables

FILL, ROWS, WIDTH = 99, 4, 6


def padded(tables: list[list[int]], size: int) -> np.ndarray:
    return np.array([t + [FILL] * (WIDTH - len(t)) for t in tables] + [[FILL] * WIDTH] * (size - len(tables)))


def test_staged_rows_equal_the_freshly_padded_tables_as_the_batch_changes():
    staging = StagedBlockTables(np.full((ROWS, WIDTH), FILL), FILL)
    steps = [
        ([[1], [2, 3]], 4),
        ([[1, 4], [2, 3]], 4),  # a table grew a block
        ([[2, 3], [1, 4], [5]], 4),  # rows moved: one sequence finished ahead of others
        ([[6, 7, 8]], 1),  # a smaller batch
        ([[6, 7, 8], [9]], 2),
        ([[1], [9, 10, 11, 12, 13, 14]], 4),  # a row shorter than what it held before
    ]
    for tables, size in steps:
        staging.stage(tables, size)
        assert (staging.array[:size] == padded(tables, size)).all()


def test_a_table_cleared_and_regrown_in_place_is_restaged():
    staging = StagedBlockTables(np.full((ROWS, WIDTH), FILL), FILL)
    table = [1, 2]
    staging.stage([table], 1)
    table.clear()  # the scheduler frees a preempted sequence's blocks in place, then grows it again
    table.extend([3, 4])
    staging.stage([table], 1)
    assert staging.array[0].tolist() == [3, 4] + [FILL] * (WIDTH - 2)
