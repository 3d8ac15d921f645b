"""Greedy choice (Triton and torch) against float64 torch, on fresh random logits."""
from __future__ import annotations

import pytest
import torch

from kernels import greedy as greedy_module
from tests.kernels.lora_cases import triton_runs_in_process

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _impls():
    impls = [pytest.param(greedy_module.greedy_torch, id="torch")]
    if triton_runs_in_process():
        from kernels import greedy_triton

        impls.append(pytest.param(greedy_triton.greedy, id="triton"))
    return impls


@pytest.fixture(params=_impls())
def greedy(request):
    return request.param


def _logits(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=gen) * 4).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_cols", [1000, 9000])
def test_tokens_are_the_first_maximum_and_logprobs_the_float64_log_softmax(greedy, dtype, num_cols):
    logits = _logits(5, num_cols + 37, dtype, seed=num_cols)  # columns past num_cols are not vocabulary
    logits[:, num_cols:] = 1e4
    token_ids, logprobs = greedy(logits, num_cols)
    reference = logits[:, :num_cols].double()
    assert token_ids.dtype == torch.long and logprobs.dtype == torch.float32
    assert token_ids.tolist() == reference.argmax(dim=-1).tolist()
    want = reference.log_softmax(dim=-1).gather(1, token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("positions", [(5, 9), (100, 4200, 8300), (8999,)])
def test_ties_and_late_maxima_give_the_first_maximum(greedy, positions):
    logits = _logits(2, 9000, torch.bfloat16, seed=3)
    for position in positions:
        logits[:, position] = 50.0
    token_ids, logprobs = greedy(logits, 9000)
    assert token_ids.tolist() == [positions[0]] * 2
    want = logits.double().log_softmax(dim=-1)[:, positions[0]]
    torch.testing.assert_close(logprobs.double(), want, rtol=1e-5, atol=1e-5)


def test_no_rows_gives_empty_results(greedy):
    token_ids, logprobs = greedy(torch.empty(0, 64, device=DEVICE), 64)
    assert token_ids.shape == (0,) and logprobs.shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_matches_torch_at_llama3_vocabulary_on_the_gpu():
    from kernels import greedy_triton

    logits = _logits(64, 128256, torch.bfloat16, seed=7)
    token_ids, logprobs = greedy_triton.greedy(logits, 128256)
    want_ids, want_logprobs = greedy_module.greedy_torch(logits, 128256)
    assert torch.equal(token_ids, want_ids)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)


def test_logits_with_a_strided_last_dim_give_the_dense_result(greedy):
    dense = _logits(4, 9000, torch.bfloat16, seed=11)
    strided = dense.t().contiguous().t()  # the same values, column-major
    assert strided.stride(1) != 1
    want_ids, want_logprobs = greedy(dense, 9000)
    token_ids, logprobs = greedy(strided, 9000)
    assert torch.equal(token_ids, want_ids)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-6, atol=1e-6)


class _CountingKernel:
    """Stands in for a Triton kernel and records each launch's grid before running it."""

    def __init__(self, kernel, launches: list[tuple]):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


@pytest.mark.skipif(not triton_runs_in_process(), reason="Triton was imported before its interpreter could be enabled")
@pytest.mark.parametrize("backend,want_triton", [("triton", True), ("torch", False), ("", DEVICE == "cuda")])
def test_the_backend_switch_picks_the_triton_kernel_or_torch(backend, want_triton, monkeypatch):
    from kernels import greedy_triton

    monkeypatch.setenv(greedy_module.BACKEND_ENV, backend)
    launches: list[tuple] = []
    monkeypatch.setattr(greedy_triton, "_greedy_kernel", _CountingKernel(greedy_triton._greedy_kernel, launches))
    logits = _logits(3, 500, torch.float32, seed=2)
    token_ids, _ = greedy_module.greedy(logits, 500)
    assert token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert bool(launches) is want_triton


def test_the_backend_switch_rejects_unknown_names(monkeypatch):
    monkeypatch.setenv(greedy_module.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match=greedy_module.BACKEND_ENV):
        greedy_module.greedy(_logits(1, 10, torch.float32, seed=0), 10)


def test_rows_starting_with_minus_infinity_keep_finite_logprobs(greedy):
    logits = _logits(2, 9000, torch.float32, seed=5)
    logits[0, :8500] = -float("inf")  # more than one block of the Triton kernel
    logits[1, ::2] = -float("inf")
    token_ids, logprobs = greedy(logits, 9000)
    reference = logits.double()
    assert token_ids.tolist() == reference.argmax(dim=-1).tolist()
    want = reference.log_softmax(dim=-1).gather(1, token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs.double(), want, rtol=1e-5, atol=1e-5)


def test_more_columns_than_the_logits_hold_are_refused():
    if not triton_runs_in_process():
        pytest.skip("Triton was imported before its interpreter could be enabled")
    from kernels import greedy_triton

    with pytest.raises(ValueError, match="more than"):
        greedy_triton.greedy(torch.zeros(2, 10, device=DEVICE), 11)
