"""The Triton kernels on a CUDA device: real Llama-3-8B widths, both paths, and CUDA-graph replay."""

import pytest
import torch

import kernels
from kernels import LoRAMetadata, lora_tuning
from tests.kernels.lora_cases import expand_reference, relative_error, shrink_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLOTS, RANK, K, WIDTHS = 8, 16, 4096, (4096, 1024, 1024)


def weights(tails, dtype=torch.bfloat16):
    return [torch.randn(SLOTS, *t, device="cuda").div(t[-1] ** 0.5).to(dtype) for t in tails]


def random_slots(num_tokens: int) -> torch.Tensor:
    return torch.randint(-1, SLOTS, (num_tokens,), device="cuda", dtype=torch.int32)


@pytest.mark.parametrize("num_tokens", [7, lora_tuning.SGMV_MIN_TOKENS + 37], ids=["bgmv", "sgmv"])
def test_qkv_shrink_and_expand_match_float64_in_bfloat16(num_tokens):
    slots = random_slots(num_tokens)
    x = torch.randn(num_tokens, K, device="cuda", dtype=torch.bfloat16)
    a, b = weights([(RANK, K)] * 3), weights([(w, RANK) for w in WIDTHS])
    y = torch.randn(num_tokens, sum(WIDTHS), device="cuda", dtype=torch.bfloat16)
    h = kernels.lora_shrink_slices(x, a, slots)
    ref_y = expand_reference(y, h, b, slots)
    kernels.lora_expand_slices(y, h, b, slots)
    assert relative_error(h, shrink_reference(x, a, slots)) <= 1e-2
    assert relative_error(y, ref_y) <= 1e-2


def test_captured_graph_replays_with_the_next_steps_slots():
    num_tokens = 64
    meta = LoRAMetadata.empty(num_tokens, SLOTS, "cuda")
    x = torch.randn(num_tokens, K, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(num_tokens, sum(WIDTHS), device="cuda", dtype=torch.bfloat16)
    h = torch.empty(3, num_tokens, RANK, device="cuda")
    a, b = weights([(RANK, K)] * 3), weights([(w, RANK) for w in WIDTHS])
    kernels.prepare_lora_metadata(random_slots(num_tokens), SLOTS, out=meta)

    def step():
        kernels.lora_shrink_slices(x, a, meta, out=h)
        kernels.lora_expand_slices(y, h, b, meta)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    slots = random_slots(num_tokens)
    kernels.prepare_lora_metadata(slots, SLOTS, out=meta)
    x.copy_(torch.randn_like(x))
    y.copy_(torch.randn_like(y))
    ref_h = shrink_reference(x, a, slots)
    ref_y = expand_reference(y, ref_h, b, slots)
    graph.replay()
    assert relative_error(h, ref_h) <= 1e-2
    assert relative_error(y, ref_y) <= 1e-2
