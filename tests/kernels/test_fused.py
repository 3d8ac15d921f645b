"""The fused decoder-layer ops (Triton and torch) against float64 torch, on fresh random inputs."""
from __future__ import annotations

import pytest
import torch

from kernels import fused_torch
from tests.kernels.lora_cases import triton_runs_in_process

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_runs_in_process(),
                                  reason="Triton was imported before its interpreter could be enabled")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _impls():
    impls = [pytest.param(fused_torch, id="torch")]
    if triton_runs_in_process():
        from kernels import fused_triton

        impls.append(pytest.param(fused_triton, id="triton"))
    return impls


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


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
    assert _rel(hidden, h) <= TOLERANCE[dtype] and _rel(out, want) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(impl, dtype):
    gen = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(5, 2 * 96, generator=gen) * 3).to(DEVICE, dtype)
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = gate * torch.sigmoid(gate) * up
    assert _rel(impl.silu_and_mul(gate_up), want) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_on_strided_views_of_the_fused_projection(impl, dtype):
    gen = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, dim = 6, 6, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE, dtype)
    freqs = torch.outer(torch.arange(32.0), 1.0 / 100 ** (torch.arange(0, dim, 2) / dim))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    positions = torch.tensor([0, 3, 7, 8, 20, 31], device=DEVICE)
    expected_v = qkv[:, (heads + kv_heads) * dim:].clone()
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    want_q, want_k = fused_torch.rotary(q.double(), k.double(), cos.double(), sin.double(), positions)
    got_q, got_k = impl.rotary(q, k, cos, sin, positions)
    assert _rel(got_q, want_q) <= TOLERANCE[dtype] and _rel(got_k, want_k) <= TOLERANCE[dtype]
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], expected_v)  # v is never touched


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
