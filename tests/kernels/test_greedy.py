"""Greedy choice (Triton and torch) against float64 torch, on fresh random logits."""
from __future__ import annotations

import pytest
import torch

from kernels import greedy as greedy_module
from tests.kernels.lora_cases import record_calls, skip_without_triton, triton_runs_in_process

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = triton_runs_in_process()
needs_triton = skip_without_triton()


def _impls():
    impls = [pytest.param(greedy_module.greedy_torch, id="torch")]
    if TRITON:
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
@pytest.mark.parametrize("rows", [1, 64, 1024])
def test_triton_matches_torch_at_llama3_vocabulary_on_the_gpu(rows):
    from kernels import greedy_triton

    logits = _logits(rows, 128256, torch.bfloat16, seed=7)
    token_ids, logprobs = greedy_triton.greedy(logits, 128256)
    want_ids, want_logprobs = greedy_module.greedy_torch(logits, 128256)
    assert torch.equal(token_ids, want_ids)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 64])
def test_a_captured_greedy_replays_on_the_next_logits_on_the_gpu(rows):
    """The split count and scratch come from static shapes, so a CUDA graph can capture the launches."""
    from kernels import greedy_triton

    logits = _logits(rows, 128256, torch.bfloat16, seed=31)
    greedy_triton.greedy(logits, 128256)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        token_ids, logprobs = greedy_triton.greedy(logits, 128256)
    logits.copy_(_logits(rows, 128256, torch.bfloat16, seed=37))
    graph.replay()
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


@needs_triton
@pytest.mark.parametrize("backend,want_triton", [("triton", True), ("torch", False), ("", DEVICE == "cuda")])
def test_the_backend_switch_picks_the_triton_kernel_or_torch(backend, want_triton, monkeypatch):
    from kernels import greedy_triton

    monkeypatch.setenv(greedy_module.BACKEND_ENV, backend)
    launches = record_calls(monkeypatch, greedy_triton, "_greedy_kernel", "_greedy_split_kernel")
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


@needs_triton
def test_more_columns_than_the_logits_hold_are_refused():
    from kernels import greedy_triton

    with pytest.raises(ValueError, match="more than"):
        greedy_triton.greedy(torch.zeros(2, 10, device=DEVICE), 11)


@needs_triton
def test_no_columns_are_refused():
    from kernels import greedy_triton

    with pytest.raises(ValueError, match="at least 1"):
        greedy_triton.greedy(torch.zeros(2, 10, device=DEVICE), 0)


def _assert_matches_float64(logits: torch.Tensor, num_cols: int, token_ids: torch.Tensor,
                            logprobs: torch.Tensor) -> None:
    reference = logits[:, :num_cols].double()
    assert token_ids.tolist() == reference.argmax(dim=-1).tolist()
    want = reference.log_softmax(dim=-1).gather(1, token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs.double(), want, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("num_cols,splits", [(9000, 2), (9000, 3), (9000, 7), (9000, 64), (128256, 5)])
def test_split_rows_give_the_first_maximum_and_the_float64_log_softmax(num_cols, splits):
    from kernels import greedy_triton

    logits = _logits(3, num_cols + 37, torch.bfloat16, seed=splits)
    logits[:, num_cols:] = 1e4  # past the vocabulary: no split may read it
    _assert_matches_float64(logits, num_cols, *greedy_triton.greedy(logits, num_cols, splits=splits))


@needs_triton
@pytest.mark.parametrize("offsets,want_offset", [((-1, 0), -1), ((0, 1), 0), ((5, 0), 5)],
                         ids=["last_of_one_split_and_first_of_the_next", "first_of_two_splits",
                              "later_within_the_first_split"])
def test_ties_across_splits_give_the_lowest_index(offsets, want_offset):
    """Maxima in splits 1 and 2 (offsets from each split's start), or just before split 1."""
    from kernels import greedy_triton

    split_cols, used = greedy_triton.split_layout(9000, 4)
    assert used == 4
    logits = _logits(2, 9000, torch.bfloat16, seed=13)
    positions = [split_cols + offsets[0], 2 * split_cols + offsets[1]]
    logits[:, positions] = 50.0
    token_ids, logprobs = greedy_triton.greedy(logits, 9000, splits=4)
    assert token_ids.tolist() == [split_cols + want_offset] * 2
    _assert_matches_float64(logits, 9000, token_ids, logprobs)


@needs_triton
@pytest.mark.parametrize("splits", [1, 4])
def test_splits_and_blocks_entirely_minus_infinity_leave_finite_logprobs(splits):
    from kernels import greedy_triton

    split_cols, _ = greedy_triton.split_layout(9000, 4)
    logits = _logits(3, 9000, torch.float32, seed=17)
    logits[0, :split_cols] = -float("inf")  # the first split
    logits[1, split_cols:3 * split_cols] = -float("inf")  # two middle splits
    logits[2, :-5] = -float("inf")  # all but the last few columns (unsplit: two whole blocks)
    token_ids, logprobs = greedy_triton.greedy(logits, 9000, splits=splits)
    assert logprobs.isfinite().all()
    _assert_matches_float64(logits, 9000, token_ids, logprobs)


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy computes that NaN as log(0)
@pytest.mark.parametrize("splits", [1, 4])
def test_a_row_entirely_minus_infinity_gives_token_0_and_the_torch_logprob(splits):
    """torch's log_softmax of such a row is NaN; the kernel agrees, and the other rows stay finite."""
    from kernels import greedy_triton

    logits = _logits(2, 9000, torch.float32, seed=19)
    logits[0] = -float("inf")
    token_ids, logprobs = greedy_triton.greedy(logits, 9000, splits=splits)
    want_ids, want_logprobs = greedy_module.greedy_torch(logits, 9000)
    assert token_ids.tolist() == [0, want_ids[1].item()]
    torch.testing.assert_close(logprobs, want_logprobs, equal_nan=True)
    assert logprobs[1].isfinite()


@needs_triton
def test_one_row_split_the_most_ways_matches_float64():
    from kernels import greedy_triton

    logits = _logits(1, 9000, torch.bfloat16, seed=23)
    _assert_matches_float64(logits, 9000, *greedy_triton.greedy(logits, 9000, splits=greedy_triton.MAX_SPLITS))


@needs_triton
def test_many_rows_split_match_float64():
    from kernels import greedy_triton

    logits = _logits(70, 700, torch.bfloat16, seed=29)
    _assert_matches_float64(logits, 700, *greedy_triton.greedy(logits, 700, splits=3))


@needs_triton
@pytest.mark.parametrize("splits", [0, -2, 65, 2.0, True])
def test_invalid_split_counts_are_refused(splits):
    from kernels import greedy_triton

    with pytest.raises(ValueError, match="splits"):
        greedy_triton.greedy(_logits(1, 100, torch.float32, seed=0), 100, splits=splits)


@needs_triton
@pytest.mark.parametrize("num_cols,splits", [(9000, 7), (128256, 32), (100, 8), (64, 3), (1, 64)])
def test_split_layout_covers_the_columns_with_aligned_nonempty_splits(num_cols, splits):
    from kernels import greedy_triton

    split_cols, used = greedy_triton.split_layout(num_cols, splits)
    assert split_cols % greedy_triton.SPLIT_ALIGN == 0
    assert 1 <= used <= splits
    assert (used - 1) * split_cols < num_cols <= used * split_cols


@needs_triton
def test_default_splits_is_one_without_cuda():
    from kernels import greedy_triton

    assert greedy_triton.default_splits(1, 128256, multiprocessors=1) == 1


@needs_triton
@pytest.mark.parametrize("rows", [1, 8, 32, 64, 128, 256])
def test_default_splits_give_each_multiprocessor_its_programs_or_the_narrowest_splits(rows):
    from kernels import greedy_triton

    splits = greedy_triton.default_splits(rows, 128256, multiprocessors=132)
    widest = -(-128256 // greedy_triton.SPLIT_MIN_COLS)
    assert rows * splits >= greedy_triton.PROGRAMS_PER_SM * 132 or splits == widest
    assert rows * (splits - 1) < greedy_triton.PROGRAMS_PER_SM * 132 and splits <= widest


@needs_triton
def test_default_splits_leave_many_rows_unsplit():
    from kernels import greedy_triton

    assert greedy_triton.default_splits(greedy_triton.PROGRAMS_PER_SM * 132, 128256, multiprocessors=132) == 1


@needs_triton
@pytest.mark.parametrize("many_rows,want", [(False, ["_greedy_split_kernel", "_combine_kernel"]),
                                             (True, ["_greedy_kernel"])])
def test_the_default_split_count_follows_rows_and_multiprocessors(many_rows, want, monkeypatch):
    """Two multiprocessors want 2 * PROGRAMS_PER_SM programs: 2 rows are split, that many rows are not."""
    from kernels import greedy_triton

    monkeypatch.setattr(greedy_triton, "multiprocessor_count", lambda device: 2)
    launches = record_calls(monkeypatch, greedy_triton, "_greedy_kernel", "_greedy_split_kernel", "_combine_kernel")
    rows = 2 * greedy_triton.PROGRAMS_PER_SM if many_rows else 2
    logits = _logits(rows, 9000, torch.bfloat16, seed=41)
    _assert_matches_float64(logits, 9000, *greedy_triton.greedy(logits, 9000))
    assert [launch.name for launch in launches] == want
