"""Top-p filtering (Triton and torch) against a float64 sort, on fresh random probabilities."""
from __future__ import annotations

import pytest
import torch

from kernels import top_p as top_p_module
from tests.kernels.lora_cases import record_calls, skip_without_triton, triton_runs_in_process

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = triton_runs_in_process()
needs_triton = skip_without_triton()


def _impls():
    impls = [pytest.param(top_p_module.top_p_torch, id="torch")]
    if TRITON:
        from kernels import top_p_triton

        impls += [pytest.param(top_p_triton.top_p_, id="triton"),
                  pytest.param(lambda *a: top_p_triton.top_p_(*a, probes=1, tile=256), id="triton-bisection")]
    return impls


@pytest.fixture(params=_impls())
def top_p_(request):
    return request.param


def _probs(rows: int, vocab: int, scale: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(rows, vocab, generator=gen, dtype=torch.float64)).softmax(dim=-1)


def _nucleus_sizes_and_top_p(probs: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """For each row, a top_p halfway between the mass of its `size - 1` and `size` most likely tokens: the
    nucleus is then those `size` tokens, far from any float32 rounding."""
    mass = torch.nn.functional.pad(probs.sort(dim=-1, descending=True).values.cumsum(dim=-1), (1, 0))
    return torch.tensor([(mass[r, s - 1] + mass[r, s]).item() / 2 for r, s in enumerate(sizes)])


def _reference(probs: torch.Tensor, rows: list[int], top_p: list[float]) -> torch.Tensor:
    """float64, by the definition: a token stays when the tokens ranked above it (descending) hold less than
    top_p; ties with the last kept token stay too."""
    out = probs.clone()
    for r, p in zip(rows, top_p):
        ordered = probs[r].sort(descending=True).values
        above = ordered.cumsum(dim=0) - ordered
        threshold = ordered[above < p].min()
        out[r] = probs[r].masked_fill(probs[r] < threshold, 0.0)
    return out


def _run(top_p_, probs64: torch.Tensor, rows: list[int], top_p: list[float]) -> torch.Tensor:
    probs = probs64.float().to(DEVICE)
    result = top_p_(probs, torch.tensor(rows, device=DEVICE), torch.tensor(top_p, dtype=torch.float32, device=DEVICE))
    assert result.data_ptr() == probs.data_ptr()  # in place
    return probs.cpu()


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0], ids=["flat", "spread", "peaked"])
@pytest.mark.parametrize("vocab", [700, 5000])
def test_each_row_keeps_exactly_its_nucleus(top_p_, scale, vocab):
    probs = _probs(4, vocab, scale, seed=vocab + int(scale * 10))
    likely = (probs >= 1e-4).sum(dim=-1).tolist()  # beyond them the masses of consecutive sizes round together
    sizes = [1, min(3, likely[1]), max(1, likely[2] // 2), likely[3]]
    top_p = _nucleus_sizes_and_top_p(probs, sizes).tolist()
    result = _run(top_p_, probs, [0, 1, 2, 3], top_p)
    assert ((result > 0).sum(dim=-1)).tolist() == sizes
    assert torch.equal(result, _reference(probs.float().double(), [0, 1, 2, 3], top_p).float())


def test_rows_not_listed_are_untouched(top_p_):
    probs = _probs(5, 900, 2.0, seed=1)
    top_p = _nucleus_sizes_and_top_p(probs[[3, 1]], [10, 20]).tolist()
    result = _run(top_p_, probs, [3, 1], top_p)
    for r in (0, 2, 4):
        assert torch.equal(result[r], probs[r].float())
    assert ((result[[3, 1]] > 0).sum(dim=-1)).tolist() == [10, 20]


def test_the_most_likely_token_always_stays(top_p_):
    probs = _probs(2, 600, 1.0, seed=2)
    result = _run(top_p_, probs, [0, 1], [1e-6, 1e-3])
    assert ((result > 0).sum(dim=-1)).tolist() == [1, 1]
    assert torch.equal(result.argmax(dim=-1), probs.argmax(dim=-1))


def test_ties_with_the_last_token_of_the_nucleus_stay(top_p_):
    probs = torch.full((1, 1000), 0.0)
    probs[0, [7, 300, 301, 999]] = torch.tensor([0.4, 0.2, 0.2, 0.2])
    result = _run(top_p_, probs.double(), [0], [0.5])  # 0.4 + the first 0.2 reach it; the other two tie with it
    assert (result[0] > 0).nonzero().flatten().tolist() == [7, 300, 301, 999]


def test_a_row_holding_less_than_top_p_keeps_every_token(top_p_):
    """As rows whose mass rounds below top_p: the tokens top-k or min-p zeroed stay zero."""
    probs = torch.zeros(1, 800, dtype=torch.float64)
    probs[0, 100:105] = 0.19
    result = _run(top_p_, probs, [0], [0.99])
    assert torch.equal(result, probs.float())


@needs_triton
@pytest.mark.parametrize("backend,want_triton", [("triton", True), ("torch", False), ("", DEVICE == "cuda")])
def test_the_backend_switch_picks_the_triton_kernel_or_torch(backend, want_triton, monkeypatch):
    from kernels import top_p_triton

    monkeypatch.setenv(top_p_module.BACKEND_ENV, backend)
    launches = record_calls(monkeypatch, top_p_triton, "_top_p_kernel")
    probs = _probs(2, 300, 2.0, seed=4)
    top_p = _nucleus_sizes_and_top_p(probs, [5, 9]).tolist()
    result = _run(top_p_module.top_p_, probs, [0, 1], top_p)
    assert ((result > 0).sum(dim=-1)).tolist() == [5, 9]
    assert bool(launches) is want_triton


@needs_triton
def test_the_kernel_refuses_probabilities_it_cannot_filter_in_place():
    from kernels import top_p_triton

    with pytest.raises(ValueError, match="float32"):
        top_p_triton.top_p_(torch.ones(2, 8, dtype=torch.float16, device=DEVICE), torch.tensor([0], device=DEVICE),
                            torch.tensor([0.5], device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scale", [0.5, 8.0], ids=["flat", "peaked"])
def test_triton_keeps_the_torch_nucleus_at_llama3_vocabulary_on_the_gpu(scale):
    from kernels import top_p_triton

    probs = (scale * torch.randn(64, 128256, device="cuda")).softmax(dim=-1)
    rows = torch.arange(64, device="cuda")
    top_p = torch.rand(64, device="cuda") * 0.5 + 0.45
    got = top_p_triton.top_p_(probs.clone(), rows, top_p)
    want = top_p_module.top_p_torch(probs.clone(), rows, top_p)
    differing = ((got > 0) != (want > 0)).sum(dim=-1)
    assert differing.max().item() <= 1  # only a token whose mass above is within rounding of top_p may differ
    assert (differing == 0).float().mean().item() >= 0.9
