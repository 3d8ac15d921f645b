"""`benchmarks/zipf_schedule.py`, workload (d)'s schedule without a model, drives the real scheduler and LoRA manager:
it must keep running as they change, and it shows what each admission order costs in steps."""
from __future__ import annotations

import math

import pytest

from benchmarks.zipf_schedule import Workload, simulate

# every adapter holds a slot for one sequence's lifetime (its prefill, then a decode per output token but the
# first): without suspension, the adapters fill the slots that many times over, at the least; with it, the
# slots hold that many steps of adapter work between them
WORKLOAD = Workload()
DISTINCT_ADAPTERS = 173  # of the 512 Zipf picks (serving.py's seed)
LIFETIME = WORKLOAD.output_len + 1
SLOT_BOUND = math.ceil(DISTINCT_ADAPTERS / WORKLOAD.max_loras) * LIFETIME
SUSPENDING_SLOT_BOUND = math.ceil(DISTINCT_ADAPTERS * LIFETIME / WORKLOAD.max_loras)


@pytest.fixture(scope="module")
def results():
    return {"fcfs": simulate("fcfs"), "balanced": simulate("balanced", workload=Workload(suspend_margin=None)),
            "balanced with suspension": simulate("balanced")}


@pytest.mark.parametrize("order", ["fcfs", "balanced"])
def test_every_request_runs_within_the_slot_bound(results, order):
    result = results[order]
    assert result.distinct_adapters == DISTINCT_ADAPTERS
    assert result.steps >= SLOT_BOUND and result.suspensions == 0


def test_suspension_runs_within_the_slot_work_bound(results):
    assert results["balanced with suspension"].steps >= SUSPENDING_SLOT_BOUND


def test_suspension_ends_the_adapters_together_in_fewer_steps(results):
    """The last wave held 13 of the 173 adapters on 32 slots: suspending adapters near their end for those with
    most work left fills it. The simulation took 733 steps against 794 without."""
    assert results["balanced with suspension"].suspensions > 0
    assert results["balanced with suspension"].steps <= 0.95 * results["balanced"].steps


def test_balanced_admission_takes_fewer_steps_than_arrival_order(results):
    assert results["balanced"].steps < results["fcfs"].steps


def test_balanced_admission_reads_each_adapter_once_with_reads_that_take_ten_steps(results):
    assert results["balanced"].disk_reads == DISTINCT_ADAPTERS


@pytest.mark.parametrize("seed", [1, 3])
def test_balanced_admission_saves_a_tenth_of_the_steps_on_other_zipf_picks(seed):
    """With other picks, balanced once took as many steps as arrival order: its reads ahead went by first arrival,
    not to the adapters the next free slots take, so the slots went to whichever adapter had been read."""
    workload = Workload(seed=seed, suspend_margin=None)
    assert simulate("balanced", workload=workload).steps <= 0.9 * simulate("fcfs", workload=workload).steps
