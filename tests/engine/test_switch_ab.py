"""`benchmarks/switch_ab.py`: (a) once, then (c) for each value of a switch, each (c) engine built under its value."""
from __future__ import annotations

import json
import os

from benchmarks import switch_ab
from kernels import lora_tuning

SMALL = ["--shape", "small", "--device", "cpu", "--adapters", "4", "--num-requests", "6", "--prompt-len", "16",
         "--output-len", "3", "--max-num-seqs", "4", "--max-batched-tokens", "64"]


def run(tmp_path, monkeypatch, *values: str, seen: list | None = None) -> dict:
    if seen is not None:
        fold_expand = lora_tuning.fold_expand
        monkeypatch.setattr(lora_tuning, "fold_expand", lambda: seen.append(os.environ["LORASERVE_LORA_FOLD"])
                            or fold_expand())
    return switch_ab.main([*SMALL, "--switch", "LORASERVE_LORA_FOLD", "--values", *values,
                           "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")])


def test_the_base_model_runs_once_then_the_adapters_once_per_value_in_order(tmp_path, monkeypatch):
    results = run(tmp_path, monkeypatch, "1", "0", "1")
    assert [r["label"] for r in results["runs"]] == ["a"] + [f"c LORASERVE_LORA_FOLD={v}" for v in ("1", "0", "1")]
    assert all(r["output_tokens"] == 6 * 3 for r in results["runs"])
    assert json.loads((tmp_path / "out" / "switch_ab.json").read_text())["runs"][-1]["c_over_a"] > 0


def test_each_adapter_engine_is_built_under_its_value(tmp_path, monkeypatch):
    seen: list[str] = []
    run(tmp_path, monkeypatch, "0", "1", seen=seen)
    assert "0" in seen and "1" in seen and seen.index("0") < seen.index("1")


def test_the_switch_is_restored_after_the_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("LORASERVE_LORA_FOLD", "1")
    run(tmp_path, monkeypatch, "0")
    assert os.environ["LORASERVE_LORA_FOLD"] == "1"
