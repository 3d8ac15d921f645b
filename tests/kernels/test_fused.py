"""The fused decoder-layer ops (Triton and torch) against float64 torch, on fresh random inputs."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels import fused_torch
from tests.kernels.lora_cases import record_calls, relative_error, skip_without_triton, triton_runs_in_process

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = skip_without_triton()
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _impls():
    impls = [pytest.param(fused_torch, id="torch")]
    if triton_runs_in_process():
        from kernels import fused_triton

        impls.append(pytest.param(fused_triton, id="triton"))
    return impls


@pytest.fixture(params=_impls())
def impl(request):
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(impl, dtype, with_residual):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 72, generator=gen).to(DEVICE, dtype)
    residual = torch.randn(7, 72, generator=gen).to(DEVICE, dtype) if with_residual else None
    weight = torch.rand(72, generator=gen).add(0.5).to(DEVICE, dtype)
    out, hidden = impl.add_rms_norm(x, residual, weight, 1e-6)
    h = x.double() + (residual.double() if with_residual else 0)
    want = weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert relative_error(hidden, h) <= TOLERANCE[dtype] and relative_error(out, want) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(impl, dtype):
    gen = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(5, 2 * 96, generator=gen) * 3).to(DEVICE, dtype)
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = gate * torch.sigmoid(gate) * up
    assert relative_error(impl.silu_and_mul(gate_up), want) <= TOLERANCE[dtype]


# (heads, kv_heads, head_dim): Llama-3-8B, the tiny test models, and padded head counts and half widths
HEAD_SHAPES = [pytest.param((32, 8, 128), id="llama3"), pytest.param((4, 2, 16), id="tiny"),
               pytest.param((6, 3, 24), id="padded")]
BLOCK_SIZE, NUM_BLOCKS = 4, 5


@dataclass
class RotaryKVCase:
    """Strided q/k/v views of one fused projection output, rotary tables, and NaN-poisoned caches."""

    qkv: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor

    def run(self, impl) -> None:
        impl.rotary_and_write_kv(self.q, self.k, self.v, self.cos, self.sin, self.positions, self.k_cache,
                                 self.v_cache, self.slots)


def _rotary_kv_case(tokens: int, shape: tuple[int, int, int], dtype: torch.dtype,
                    cache_dtype: torch.dtype | None = None, seed: int = 4) -> RotaryKVCase:
    heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    freqs = torch.outer(torch.arange(64.0), 1.0 / 100 ** (torch.arange(0, dim, 2) / dim))
    emb = torch.cat((freqs, freqs), dim=-1)
    cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, kv_heads, dim), float("nan"), dtype=cache_dtype or dtype,
                       device=DEVICE)
    return RotaryKVCase(
        qkv, q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim),
        emb.cos().to(DEVICE), emb.sin().to(DEVICE), torch.randint(0, 64, (tokens,), generator=gen).to(DEVICE),
        cache, cache.clone(), torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:tokens].to(DEVICE),
    )


@pytest.mark.parametrize("shape", HEAD_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_write_kv_rotates_q_and_k_in_place(impl, shape, dtype):
    case = _rotary_kv_case(7, shape, dtype)
    want_q, want_k = fused_torch.rotary(case.q.double(), case.k.double(), case.cos.double(), case.sin.double(),
                                        case.positions)
    case.run(impl)
    assert relative_error(case.q, want_q) <= TOLERANCE[dtype] and relative_error(case.k, want_k) <= TOLERANCE[dtype]


@pytest.mark.parametrize("shape", HEAD_SHAPES)
# float32 -> float16, not bfloat16: the Triton interpreter truncates float32 -> bfloat16 where GPUs and torch round
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.float16), (torch.bfloat16, torch.float32)])
def test_rotary_and_write_kv_stores_the_rotated_k_and_the_raw_v_at_each_slot(impl, shape, dtype, cache_dtype):
    case = _rotary_kv_case(7, shape, dtype, cache_dtype)
    raw_v = case.v.clone()
    case.run(impl)
    flat_k, flat_v = case.k_cache.flatten(0, 1), case.v_cache.flatten(0, 1)
    assert torch.equal(flat_k[case.slots], case.k.to(cache_dtype))
    assert torch.equal(flat_v[case.slots], raw_v.to(cache_dtype)) and torch.equal(case.v, raw_v)


def test_rotary_and_write_kv_leaves_every_other_cache_element_untouched(impl):
    case = _rotary_kv_case(7, (6, 3, 24), torch.float32)
    case.run(impl)
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    written[case.slots] = True
    for cache in (case.k_cache, case.v_cache):
        nan = cache.flatten(0, 1).isnan()
        assert torch.equal(nan, ~written[:, None, None].expand_as(nan))


def test_rotary_and_write_kv_with_no_tokens_changes_nothing(impl):
    case = _rotary_kv_case(0, (4, 2, 16), torch.float32)
    case.run(impl)
    assert case.k_cache.isnan().all() and case.v_cache.isnan().all()


@needs_triton
@pytest.mark.parametrize("shape", HEAD_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_rotary_and_write_kv_matches_the_torch_reference(shape, dtype):
    from kernels import fused_triton

    got, want = _rotary_kv_case(9, shape, dtype, seed=5), _rotary_kv_case(9, shape, dtype, seed=5)
    got.run(fused_triton)
    want.run(fused_torch)
    for a, b in [(got.qkv, want.qkv), (got.k_cache, want.k_cache), (got.v_cache, want.v_cache)]:
        torch.testing.assert_close(a, b, equal_nan=True)


@needs_triton
@pytest.mark.parametrize("backend,want", [("triton", ["_rotary_and_write_kv_kernel"]), ("torch", []),
                                          ("", ["_rotary_and_write_kv_kernel"] if DEVICE == "cuda" else [])])
def test_the_backend_switch_picks_one_fused_launch_or_the_torch_ops(backend, want, monkeypatch):
    from kernels import fused, fused_triton

    monkeypatch.setenv(fused.BACKEND_ENV, backend)
    launches = record_calls(monkeypatch, fused_triton, "_rotary_and_write_kv_kernel")
    case, want_case = _rotary_kv_case(3, (4, 2, 16), torch.float32), _rotary_kv_case(3, (4, 2, 16), torch.float32)
    case.run(fused)
    want_case.run(fused_torch)
    torch.testing.assert_close(case.k_cache, want_case.k_cache, equal_nan=True)
    assert [launch.name for launch in launches] == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_captured_rotary_and_write_kv_replays_with_the_next_steps_positions_and_slots():
    from kernels import fused_triton

    case = _rotary_kv_case(8, (32, 8, 128), torch.bfloat16)
    case.run(fused_triton)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run(fused_triton)
    want = _rotary_kv_case(8, (32, 8, 128), torch.bfloat16, seed=6)
    for name in ("qkv", "positions", "slots", "k_cache", "v_cache"):
        getattr(case, name).copy_(getattr(want, name))
    graph.replay()
    want.run(fused_torch)
    for a, b in [(case.qkv, want.qkv), (case.k_cache, want.k_cache), (case.v_cache, want.v_cache)]:
        torch.testing.assert_close(a, b, equal_nan=True)


def test_the_model_with_the_triton_ops_matches_transformers():
    """End to end: the tiny Llama's forward pass with LORASERVE_FUSED_BACKEND=triton (interpreted on the CPU)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, LORASERVE_FUSED_BACKEND="triton", TRITON_INTERPRET="1")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/engine/test_model_parity.py",
         "-k", "llama] or qwen2"],
        cwd=root, env=env, capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "2 passed" in run.stdout
