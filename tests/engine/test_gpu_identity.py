"""`benchmarks/gpu_identity.py`: each GPU result records the board it ran on, read from nvidia-smi."""
from __future__ import annotations

import subprocess

import pytest

from benchmarks import gpu_identity as identity

ROW = "NVIDIA H200, GPU-1a2b, 00000000:19:00.0, 570.86.15, 96.00.AF.00.01, 1980, 3201, 700.00, Enabled, 31"


def test_a_row_of_nvidia_smi_is_read_field_by_field():
    read = identity.parse(ROW)
    assert read["name"] == "NVIDIA H200" and read["uuid"] == "GPU-1a2b"
    assert read["clocks.max.sm"] == "1980" and read["clocks.max.memory"] == "3201" and read["power.limit"] == "700.00"
    assert list(read) == list(identity.FIELDS)


def test_a_row_with_other_fields_is_refused_with_the_fields_expected():
    with pytest.raises(ValueError, match="expected 10 comma-separated values"):
        identity.parse("NVIDIA H200, 345 MHz")


def test_a_machine_without_nvidia_smi_records_no_gpu(monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", missing)
    assert identity.gpu_identity() == {}


def test_the_query_asks_nvidia_smi_for_every_field_of_one_gpu(monkeypatch):
    calls = []

    def fake_run(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 0, stdout=ROW + "\n", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert identity.gpu_identity(index=1)["vbios_version"] == "96.00.AF.00.01"
    assert calls == [["nvidia-smi", f"--query-gpu={','.join(identity.FIELDS)}", "--format=csv,noheader,nounits",
                      "-i", "1"]]


def test_a_row_that_does_not_parse_is_kept_as_it_came(monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda command, **kwargs: subprocess.CompletedProcess(
        command, 0, stdout="NVIDIA H200, 345\n", stderr=""))
    assert identity.gpu_identity() == {"nvidia-smi": "NVIDIA H200, 345"}
