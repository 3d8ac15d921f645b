"""The public entry points: backend choice, single-slice forms, raw slot tensors and out buffers."""

import pytest
import torch

import kernels
from kernels import lora_torch, lora_triton
from tests.kernels.lora_cases import (
    NUM_SLOTS,
    PATTERNS,
    expand_reference,
    random_weights,
    record_calls,
    relative_error,
    shrink_reference,
    slots_tensor,
    triton_runs_in_process,
)

PATTERN = PATTERNS["unsorted_with_empty_groups"]


@pytest.fixture
def calls(monkeypatch):
    """Records which backend module ran each shrink."""
    seen = []
    for module in (lora_torch, lora_triton):
        original = module.shrink_slices

        def spy(*args, _original=original, _name=module.__name__, **kwargs):
            seen.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "shrink_slices", spy)
    return seen


def shrink_once() -> None:
    kernels.lora_shrink(torch.randn(len(PATTERN), 32), random_weights([(8, 32)], torch.float32)[0], slots_tensor(PATTERN))


def test_cpu_tensors_use_the_torch_reference_by_default(monkeypatch, calls):
    monkeypatch.delenv("LORASERVE_LORA_BACKEND", raising=False)
    shrink_once()
    assert calls == ["kernels.lora_torch"]


@pytest.mark.skipif(torch.cuda.is_available() or not triton_runs_in_process(), reason="needs the interpreter")
def test_environment_forces_the_triton_backend(monkeypatch, calls):
    monkeypatch.setenv("LORASERVE_LORA_BACKEND", "triton")
    shrink_once()
    assert calls == ["kernels.lora_triton"]


def test_environment_forces_the_torch_backend(monkeypatch, calls):
    monkeypatch.setenv("LORASERVE_LORA_BACKEND", "torch")
    shrink_once()
    assert calls == ["kernels.lora_torch"]


def test_unknown_backend_is_refused(monkeypatch):
    monkeypatch.setenv("LORASERVE_LORA_BACKEND", "cuda")
    with pytest.raises(ValueError, match="LORASERVE_LORA_BACKEND"):
        shrink_once()


def test_single_slice_shrink_fills_the_given_out_buffer():
    slots = slots_tensor(PATTERN)
    x = torch.randn(len(PATTERN), 32)
    (a,) = random_weights([(8, 32)], torch.float32)
    out = torch.full((len(PATTERN), 8), float("nan"))
    h = kernels.lora_shrink(x, a, slots, out=out)
    assert h.data_ptr() == out.data_ptr()
    assert relative_error(out, shrink_reference(x, [a], slots)[0]) <= 1e-6


def test_single_slice_expand_adds_in_place_from_raw_slots():
    slots = slots_tensor(PATTERN)
    h = torch.randn(len(PATTERN), 8)
    (b,) = random_weights([(24, 8)], torch.float32)
    y = torch.randn(len(PATTERN), 24)
    ref = expand_reference(y, h.unsqueeze(0), [b], slots)
    kernels.lora_expand(y, h, b, slots)
    assert relative_error(y, ref) <= 1e-6


def test_metadata_for_another_token_count_is_refused():
    meta = kernels.prepare_lora_metadata(slots_tensor(PATTERN), NUM_SLOTS)
    (a,) = random_weights([(8, 32)], torch.float32)
    with pytest.raises(ValueError, match="prepared for"):
        lora_triton.shrink_slices(torch.randn(len(PATTERN) + 1, 32), [a], meta)


@pytest.mark.skipif(not triton_runs_in_process(), reason="Triton cannot run in this process")
def test_metadata_in_segments_runs_the_segment_kernels_at_a_per_token_size(monkeypatch):
    """A step of 40 rows on two adapters that chose segments (`lora_tuning.step_path`) launches the SGMV kernels,
    with the result the float64 reference gives."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pattern = [t % 2 for t in range(40)]
    slots = slots_tensor(pattern, device)
    meta = kernels.prepare_lora_metadata(slots, NUM_SLOTS).in_segments()
    launches = record_calls(monkeypatch, lora_triton, "_shrink_sgmv_kernel", "_shrink_bgmv_kernel",
                            "_expand_sgmv_kernel", "_expand_bgmv_kernel")
    x, y = torch.randn(40, 32, device=device), torch.randn(40, 24, device=device)
    (a,), (b,) = random_weights([(16, 32)], torch.float32, device), random_weights([(24, 16)], torch.float32, device)
    h = lora_triton.shrink_slices(x, [a], meta)
    want = expand_reference(y, shrink_reference(x, [a], slots), [b], slots)
    lora_triton.expand_slices(y, h, [b], meta)
    assert [call.name for call in launches] == ["_shrink_sgmv_kernel", "_expand_sgmv_kernel"]
    assert relative_error(y, want) <= (5e-3 if device == "cuda" else 1e-5)  # TF32 dots on CUDA


def test_the_side_stream_carveout_leaves_smaller_buckets_alone(monkeypatch):
    from kernels import lora_tuning

    monkeypatch.setenv(lora_tuning.SIDE_STREAM_CARVEOUT_ENV, "8")
    assert lora_tuning.side_stream_carveout(lora_tuning.SIDE_STREAM_CARVEOUT_MIN_TOKENS - 1) == 0


def test_the_side_stream_carveout_is_read_from_the_environment(monkeypatch):
    from kernels import lora_tuning

    monkeypatch.setenv(lora_tuning.SIDE_STREAM_CARVEOUT_ENV, "4")
    assert lora_tuning.side_stream_carveout(lora_tuning.SIDE_STREAM_CARVEOUT_MIN_TOKENS) == 4
    monkeypatch.setenv(lora_tuning.SIDE_STREAM_CARVEOUT_ENV, "0")
    assert lora_tuning.side_stream_carveout(lora_tuning.SIDE_STREAM_CARVEOUT_MIN_TOKENS) == 0


def test_a_side_stream_carveout_that_is_not_a_number_is_refused(monkeypatch):
    from kernels import lora_tuning

    monkeypatch.setenv(lora_tuning.SIDE_STREAM_CARVEOUT_ENV, "eight")
    with pytest.raises(ValueError, match="must be a number of SMs"):
        lora_tuning.side_stream_carveout(lora_tuning.SIDE_STREAM_CARVEOUT_MIN_TOKENS)
