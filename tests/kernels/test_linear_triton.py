"""The skinny Triton linear against a float64 oracle, on fresh random inputs and poisoned outputs.

N 40 and K 70 are not multiples of the 16-wide blocks, so every program masks columns and
the last K block is partial; split-K 3 over 5 K blocks leaves uneven splits. TMA copies need
16-byte rows, so their tests use K 72. On a CPU the kernel runs under the Triton interpreter;
`test_kernel_compiles_for_sm90` compiles it for an H200 (no GPU needed), with and without PDL, to
catch what only the real compiler rejects. PDL itself is checked on a GPU in test_linear_gpu.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import linear_triton, linear_tuning
from kernels.linear_triton import LinearWorkspace, skinny_linear
from kernels.linear_tuning import LinearConfig
from tests.kernels.lora_cases import record_calls, triton_runs_in_process

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_HERE = triton_runs_in_process()
needs_triton = pytest.mark.skipif(
    not TRITON_HERE, reason="Triton was imported before its interpreter could be enabled: see the subprocess test"
)
ROOT = Path(__file__).resolve().parents[2]
N, K = 40, 70
POISON = -7777.0
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def small(split_k: int = 1, swap_ab: bool = False, tma: bool = False) -> LinearConfig:
    return LinearConfig(block_n=16, block_k=16, split_k=split_k, num_warps=4, num_stages=1, swap_ab=swap_ab, tma=tma)


def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


def workspace() -> LinearWorkspace:
    return LinearWorkspace.create(max_m=160, max_n=64, max_split_k=4, device=DEVICE)


def poisoned(m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((m, n), POISON, dtype=dtype, device=DEVICE)


def rel_err(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    want = x.double() @ w.double().T
    return ((y.double() - want).norm() / want.norm()).item()


@needs_triton
@pytest.mark.parametrize("split_k", [1, 3], ids=["whole_k", "split_k"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("m", [1, 5, 16, 33, 64, 127])
def test_matches_float64(m, dtype, split_k):
    x, w = rand(m, K, dtype=dtype), rand(N, K, dtype=dtype)
    y = skinny_linear(x, w, out=poisoned(m, N, dtype), config=small(split_k), workspace=workspace())
    assert y.dtype == dtype
    assert rel_err(y, x, w) <= TOLERANCE[dtype]


@needs_triton
def test_split_k_leaves_the_counters_at_zero():
    ws = workspace()
    x, w = rand(33, K), rand(N, K)
    skinny_linear(x, w, config=small(3), workspace=ws)
    assert not ws.counters.any(), "the last split of every tile puts its counter back to zero"


@needs_triton
def test_no_split_is_left_without_k_blocks(monkeypatch):
    calls = record_calls(monkeypatch, linear_triton, "_linear_kernel")
    x, w = rand(5, K), rand(N, K)  # 5 K blocks: 4 splits of 2 blocks would leave the last one empty
    y = skinny_linear(x, w, out=poisoned(5, N, x.dtype), config=small(4), workspace=workspace())
    assert [c.grid[1] for c in calls] == [3]
    assert rel_err(y, x, w) <= TOLERANCE[torch.bfloat16]


@needs_triton
def test_use_pdl_is_ignored_by_the_interpreter():
    x, w = rand(5, K), rand(N, K)
    with_pdl = skinny_linear(x, w, config=small(3), workspace=workspace(), use_pdl=True)
    assert torch.equal(with_pdl, skinny_linear(x, w, config=small(3), workspace=workspace()))


@needs_triton
@pytest.mark.parametrize("split_k", [1, 3], ids=["whole_k", "split_k"])
@pytest.mark.parametrize("m", [1, 33])
def test_swapped_operands_match_float64(m, split_k):
    x, w = rand(m, K), rand(N, K)
    y = skinny_linear(x, w, out=poisoned(m, N, x.dtype), config=small(split_k, swap_ab=True), workspace=workspace())
    assert rel_err(y, x, w) <= TOLERANCE[torch.bfloat16]


@needs_triton
@pytest.mark.parametrize("swap_ab", [False, True], ids=["plain", "swapped"])
@pytest.mark.parametrize("split_k", [1, 3], ids=["whole_k", "split_k"])
@pytest.mark.parametrize("m", [1, 33])
def test_tma_copies_match_float64(m, split_k, swap_ab):
    k = 72  # 144-byte rows: TMA-aligned, and still not a multiple of the K block
    x, w = rand(m, k), rand(N, k)
    assert linear_triton._tma_ready(x) and linear_triton._tma_ready(w)
    y = skinny_linear(x, w, out=poisoned(m, N, x.dtype), config=small(split_k, swap_ab, tma=True), workspace=workspace())
    assert rel_err(y, x, w) <= TOLERANCE[torch.bfloat16]


@needs_triton
def test_tma_falls_back_to_loads_for_unaligned_rows():
    x, w = rand(5, K), rand(N, K)  # 140-byte rows
    assert not linear_triton._tma_ready(x)
    y = skinny_linear(x, w, config=small(3, tma=True), workspace=workspace())
    assert rel_err(y, x, w) <= TOLERANCE[torch.bfloat16]


@needs_triton
@pytest.mark.parametrize("split_k", [1, 3], ids=["whole_k", "split_k"])
def test_rows_past_one_tile_reduce_per_tile(split_k):
    x, w = rand(130, K), rand(N, K)  # two row tiles (128 + 2), each with its own split-K counters
    ws = workspace()
    y = skinny_linear(x, w, out=poisoned(130, N, x.dtype), config=small(split_k), workspace=ws)
    assert rel_err(y, x, w) <= TOLERANCE[torch.bfloat16]
    assert not ws.counters.any()


@needs_triton
def test_repeated_calls_reuse_the_workspace():
    ws = workspace()
    for m in (5, 33, 5):
        x, w = rand(m, K), rand(N, K)
        y = skinny_linear(x, w, out=poisoned(m, N, x.dtype), config=small(3), workspace=ws)
        assert rel_err(y, x, w) <= TOLERANCE[torch.bfloat16]
        assert not ws.counters.any(), "the last split of every tile puts its counter back to zero"


@needs_triton
def test_writes_into_out_with_a_row_stride():
    x, w = rand(5, K), rand(N, K)
    wide = poisoned(5, N + 8, x.dtype)
    out = wide[:, :N]
    y = skinny_linear(x, w, out=out, config=small(3), workspace=workspace())
    assert y.data_ptr() == out.data_ptr()
    assert rel_err(out, x, w) <= TOLERANCE[torch.bfloat16]
    assert (wide[:, N:] == POISON).all()


@needs_triton
def test_reads_inputs_with_row_strides():
    x_wide, w_wide = rand(5, K + 6), rand(N, K + 10)
    x, w = x_wide[:, :K], w_wide[:, 3 : 3 + K]
    y = skinny_linear(x, w, config=small(3), workspace=workspace())
    assert rel_err(y, x, w) <= TOLERANCE[torch.bfloat16]


@needs_triton
def test_split_k_without_a_workspace_makes_one():
    x, w = rand(5, K), rand(N, K)
    assert rel_err(skinny_linear(x, w, config=small(3)), x, w) <= TOLERANCE[torch.bfloat16]


@needs_triton
def test_default_config():
    x, w = rand(5, K), rand(N, K)
    assert rel_err(skinny_linear(x, w), x, w) <= TOLERANCE[torch.bfloat16]


def test_inputs_strided_along_k_are_rejected():
    x = rand(K, 5).T
    with pytest.raises(ValueError, match="unit stride"):
        skinny_linear(x, rand(N, K))


def test_mismatched_k_is_rejected():
    with pytest.raises(ValueError, match="expected x"):
        skinny_linear(rand(5, K), rand(N, K + 1))


def test_a_too_small_workspace_is_rejected():
    small_ws = LinearWorkspace.create(max_m=4, max_n=64, max_split_k=4, device=DEVICE)
    with pytest.raises(ValueError, match="too small"):
        skinny_linear(rand(5, K), rand(N, K), config=small(3), workspace=small_ws)


def test_default_split_k_fills_the_gpu_without_oversplitting():
    h200_sms = 132
    o = linear_tuning.default_config(64, 4096, 4096, h200_sms)
    assert 4096 // o.block_n * o.split_k == 256  # about two programs per SM, splits in powers of two
    assert linear_tuning.default_config(64, 28672, 4096, h200_sms).split_k == 1
    assert linear_tuning.default_config(1, 4096, 1024, h200_sms).split_k == 1  # too few K blocks to share


def test_tuned_configs_stop_past_the_largest_bucket():
    assert linear_tuning.m_bucket(5) == 16
    assert linear_tuning.tuned_config(linear_tuning.M_BUCKETS[-1] + 1, 4096, 4096) is None


def test_kernel_compiles_for_sm90():
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "skinny_gemm.py"), "--compile-only", "--smoke"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


@pytest.mark.skipif(TRITON_HERE, reason="the Triton kernels ran in this process")
def test_triton_kernels_in_a_fresh_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__))],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
