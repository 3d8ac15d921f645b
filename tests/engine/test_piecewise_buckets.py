"""Which token counts mixed steps' piecewise CUDA graphs are captured for (the capture itself needs CUDA:
tests/engine/test_piecewise_graphs.py)."""
from __future__ import annotations

import pytest

from engine import EngineConfig
from engine.piecewise_graphs import PIECEWISE_MAX_TOKENS, piecewise_buckets


def test_buckets_reach_the_token_budget_exactly():
    assert piecewise_buckets(300) == [16, 32, 64, 128, 192, 256, 300]


def test_buckets_stop_at_the_piecewise_limit_for_larger_budgets():
    assert piecewise_buckets(8192)[-1] == PIECEWISE_MAX_TOKENS == piecewise_buckets(PIECEWISE_MAX_TOKENS)[-1]


def test_a_step_of_more_than_256_tokens_pads_to_less_than_a_quarter_more_and_fewer_than_128_tokens():
    buckets = piecewise_buckets(PIECEWISE_MAX_TOKENS)
    for tokens in range(257, PIECEWISE_MAX_TOKENS + 1):
        padded = next(b for b in buckets if b >= tokens)
        assert padded < tokens * 1.25 and padded - tokens < 128


def test_an_unknown_cudagraph_mode_is_refused():
    with pytest.raises(ValueError, match="cudagraph_mode must be one of full_and_piecewise, full_decode_only"):
        EngineConfig(cudagraph_mode="piecewise_only")
