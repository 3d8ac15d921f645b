"""`benchmarks/decode_step.py --switch`: each case runs once per value, on an engine built under that value."""
from __future__ import annotations

import os

import pytest
import torch

from benchmarks import decode_step
from kernels import lora_tuning

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA (decode_step times captured graphs)", allow_module_level=True)


def test_each_value_gets_its_own_engine_and_rows_in_the_order_given(tmp_path, monkeypatch):
    monkeypatch.setenv("LORASERVE_LORA_SIDE_CARVEOUT", "3")
    seen: list[str] = []
    carveout = lora_tuning.side_stream_carveout
    monkeypatch.setattr(lora_tuning, "side_stream_carveout",
                        lambda tokens: seen.append(os.environ["LORASERVE_LORA_SIDE_CARVEOUT"]) or carveout(tokens))
    results = decode_step.main(["--shape", "small", "--batches", "4", "--cases", "base", "lora", "--adapters", "2",
                                "--prompt-len", "16", "--cudagraph-mode", "full_decode_only",
                                "--switch", "LORASERVE_LORA_SIDE_CARVEOUT", "--values", "0", "8",
                                "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")])
    assert [row["case"] for row in results["rows"]] == [
        "base LORASERVE_LORA_SIDE_CARVEOUT=0", "2 adapters LORASERVE_LORA_SIDE_CARVEOUT=0",
        "base LORASERVE_LORA_SIDE_CARVEOUT=8", "2 adapters LORASERVE_LORA_SIDE_CARVEOUT=8"]
    assert "0" in seen and "8" in seen and seen.index("0") < seen.index("8")
    assert os.environ["LORASERVE_LORA_SIDE_CARVEOUT"] == "3"


def test_sgmv_min_tokens_sends_buckets_of_that_size_to_the_segment_path(tmp_path, monkeypatch):
    monkeypatch.setattr(lora_tuning, "SGMV_MIN_TOKENS", lora_tuning.SGMV_MIN_TOKENS)  # restored after the test
    results = decode_step.main(["--shape", "small", "--batches", "4", "--cases", "lora", "--adapters", "2",
                                "--prompt-len", "16", "--cudagraph-mode", "full_decode_only", "--sgmv-min-tokens", "4",
                                "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")])
    assert results["sgmv_min_tokens"] == 4
    assert [row["segments"] for row in results["rows"]] == [True]
