"""`benchmarks/zipf_schedule.py`, workload (d)'s schedule without a model, drives the real scheduler and LoRA manager:
it must keep running as they change, and it shows what each admission order costs in steps."""
from __future__ import annotations

import math

import pytest

from benchmarks.zipf_schedule import Workload, simulate

# every adapter holds its slot for one sequence's lifetime (its prefill, then a decode per output token but the
# first); the adapters fill the slots that many times over, at the least
WORKLOAD = Workload()
DISTINCT_ADAPTERS = 173  # of the 512 Zipf picks (serving.py's seed)
SLOT_BOUND = math.ceil(DISTINCT_ADAPTERS / WORKLOAD.max_loras) * (WORKLOAD.output_len + 1)


@pytest.fixture(scope="module")
def results():
    return {order: simulate(order) for order in ("fcfs", "balanced")}


@pytest.mark.parametrize("order", ["fcfs", "balanced"])
def test_every_request_runs_within_the_slot_bound(results, order):
    result = results[order]
    assert result.distinct_adapters == DISTINCT_ADAPTERS
    assert result.steps >= SLOT_BOUND


def test_balanced_admission_takes_fewer_steps_than_arrival_order(results):
    assert results["balanced"].steps < results["fcfs"].steps


def test_balanced_admission_reads_each_adapter_once_with_reads_that_take_ten_steps(results):
    assert results["balanced"].disk_reads == DISTINCT_ADAPTERS


@pytest.mark.parametrize("seed", [1, 3])
def test_balanced_admission_saves_a_tenth_of_the_steps_on_other_zipf_picks(seed):
    """With other picks, balanced once took as many steps as arrival order: its reads ahead went by first arrival,
    not to the adapters the next free slots take, so the slots went to whichever adapter had been read."""
    workload = Workload(seed=seed)
    assert simulate("balanced", workload=workload).steps <= 0.9 * simulate("fcfs", workload=workload).steps
