"""The Triton paged decode attention against the float64 torch computation, GQA and ragged lengths."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import paged_attention_decode as torch_decode
from tests.kernels.lora_cases import triton_runs_in_process

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_runs_in_process(),
                                reason="Triton was imported before its interpreter could be enabled")


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_matches_float64_reference(heads, kv_heads, dtype):
    from kernels.paged_attention_triton import paged_attention_decode

    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    num_blocks, block_size, dim = 24, 4, 16
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    q = torch.randn(4, heads, dim, generator=gen).to(DEVICE, dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:20].view(4, 5).to(DEVICE)
    lengths = torch.tensor([1, 6, 20, 13], device=DEVICE)
    out = torch.full_like(q, float("nan"))
    paged_attention_decode(q, k_cache, v_cache, tables, lengths, 0.3, out=out)
    ref = torch_decode(q.double(), k_cache.double(), v_cache.double(), tables, lengths, 0.3)
    error = (out.double() - ref).norm() / ref.norm()
    assert error < (1e-6 if dtype == torch.float32 else 2e-3)
