"""A GPU engine keeps torch's CPU work to one intra-op thread, unless the user chose a count."""
from __future__ import annotations

import pytest
import torch

from engine.llm_engine import limit_host_threads


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_gpu_engine_runs_torch_cpu_ops_on_one_thread(threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    limit_host_threads(torch.device("cuda"))
    assert torch.get_num_threads() == 1


def test_a_cpu_engine_keeps_every_thread(threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    limit_host_threads(torch.device("cpu"))
    assert torch.get_num_threads() == 2


def test_omp_num_threads_set_by_the_user_wins(threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    limit_host_threads(torch.device("cuda"))
    assert torch.get_num_threads() == 2
