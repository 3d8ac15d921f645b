"""The PDL switch: programmatic dependent launch on CUDA devices of compute capability 9.0 or more unless
LORASERVE_PDL=0, decided once per device; and the launch options every kernel of the step takes from it.

The device's capability is stood in for (`torch.cuda.get_device_capability`), so the gating runs without a GPU.
"""
from __future__ import annotations

import pytest
import torch

from kernels.device import PDL_ENV, use_pdl

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def fresh_decision(monkeypatch):
    monkeypatch.delenv(PDL_ENV, raising=False)
    use_pdl.cache_clear()
    yield
    use_pdl.cache_clear()


def gpu_capability(monkeypatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.mark.parametrize("value", ["", "1", "0"])
def test_off_cuda_there_is_no_pdl(value, monkeypatch):
    monkeypatch.setenv(PDL_ENV, value)
    assert use_pdl(CPU) is False


@pytest.mark.parametrize("value,want", [("", True), ("1", True), ("0", False)], ids=["unset", "on", "off"])
def test_hopper_uses_pdl_unless_turned_off(value, want, monkeypatch):
    gpu_capability(monkeypatch, (9, 0))
    monkeypatch.setenv(PDL_ENV, value)
    assert use_pdl(GPU) is want


@pytest.mark.parametrize("value", ["", "1"])
def test_gpus_before_hopper_never_use_pdl(value, monkeypatch):
    gpu_capability(monkeypatch, (8, 9))
    monkeypatch.setenv(PDL_ENV, value)
    assert use_pdl(GPU) is False


@pytest.mark.parametrize("value", ["yes", "true", "on", "2"])
def test_other_values_are_refused(value, monkeypatch):
    monkeypatch.setenv(PDL_ENV, value)
    with pytest.raises(ValueError, match=f"{PDL_ENV} must be '1' or '0'"):
        use_pdl(CPU)


def test_the_variable_is_read_once_per_device(monkeypatch):
    gpu_capability(monkeypatch, (9, 0))
    monkeypatch.setenv(PDL_ENV, "0")
    assert use_pdl(GPU) is False
    monkeypatch.setenv(PDL_ENV, "1")
    assert use_pdl(GPU) is False


@pytest.mark.parametrize("capability,interpreted,want", [((9, 0), False, True), ((8, 0), False, False),
                                                        ((9, 0), True, False)],
                         ids=["hopper", "ampere", "hopper-interpreted"])
def test_a_launch_passes_the_decision_to_the_kernel_and_to_triton(capability, interpreted, want, monkeypatch):
    from kernels import pdl_triton

    gpu_capability(monkeypatch, capability)
    monkeypatch.setattr(pdl_triton, "INTERPRETED", interpreted)
    assert pdl_triton.pdl_launch(GPU) == {"USE_PDL": want, "launch_pdl": want}


@pytest.mark.parametrize("path,want", [("bgmv", True), ("sgmv", False)])
def test_only_the_per_token_lora_kernels_launch_with_pdl(path, want, monkeypatch):
    from kernels import lora_triton, pdl_triton

    gpu_capability(monkeypatch, (9, 0))
    monkeypatch.setattr(pdl_triton, "INTERPRETED", False)
    assert lora_triton._pdl_for(path, GPU) == {"USE_PDL": want, "launch_pdl": want}
