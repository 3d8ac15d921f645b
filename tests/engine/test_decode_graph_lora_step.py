"""The adapters' part of the step a decode graph captures (checked on the CPU: host logic over the bucket's empty
metadata buffers, as at capture): the path of its key or of its bucket's size, the folds of that path, and the
side-stream shrinks only on the per-token path."""
from __future__ import annotations

import pytest

import kernels
from engine.cuda_graphs import GraphKey, graph_lora_step
from kernels import lora_tuning

SIDE_STREAM = object()  # stands for the graphs' CUDA side stream


def captured_step(key: GraphKey):
    meta = kernels.LoRAMetadata.empty(key.bucket, 4, "cpu", block_m=lora_tuning.DECODE_BLOCK_M)
    return graph_lora_step(key, meta, SIDE_STREAM)


@pytest.fixture(autouse=True)
def _default_switches(monkeypatch):
    monkeypatch.delenv(lora_tuning.FOLD_EXPAND_ENV, raising=False)


@pytest.mark.parametrize("bucket", [lora_tuning.SGMV_MIN_TOKENS, 144, 256])
def test_a_bucket_of_the_segment_path_size_captures_segments_without_the_side_stream(bucket):
    step = captured_step(GraphKey(bucket, True))
    assert step.side_stream is None
    assert step.fold_into == lora_tuning.folded_ops("sgmv")


@pytest.mark.parametrize("bucket", [64, lora_tuning.SGMV_MIN_TOKENS - 1])
def test_a_per_token_bucket_runs_its_shrinks_on_the_side_stream_with_the_per_token_folds(bucket):
    step = captured_step(GraphKey(bucket, True))
    assert step.side_stream is SIDE_STREAM
    assert step.fold_into == lora_tuning.folded_ops("bgmv")
    assert not step.meta.segments


def test_a_bucket_whose_key_chose_segments_reads_its_buffers_in_segments_without_the_side_stream():
    step = captured_step(GraphKey(96, True, segments=True))
    assert step.meta.segments and step.meta.path == "sgmv"
    assert step.side_stream is None
    assert step.fold_into == lora_tuning.folded_ops("sgmv")


def test_the_key_s_tiled_folds_and_rank_width_reach_the_step():
    step = captured_step(GraphKey(64, True, frozenset({"silu_and_mul"}), 16))
    assert step.tiled_folds == frozenset({"silu_and_mul"})
    assert step.rank_width == 16


def test_the_folds_follow_the_fold_switch(monkeypatch):
    monkeypatch.setenv(lora_tuning.FOLD_EXPAND_ENV, "0")
    assert captured_step(GraphKey(64, True)).fold_into == frozenset()
