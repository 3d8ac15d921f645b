"""The skinny Triton linear on a CUDA device: PDL gives the same results as plain launches, eagerly and from a
CUDA graph, and graph replays reduce split K every time.

The PDL chain is two linears launched with PDL: the first lets the second launch once its K loop is done,
before it stores y (or reduces its splits), so a second linear reading x before its wait would see the
NaN its x was filled with. Without splits the results are the same bits with and without PDL; with splits the
order of the reduction depends on which split arrives last, so they are compared with the float64 oracle.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels.linear_triton import LinearWorkspace, skinny_linear
from kernels.linear_tuning import LinearConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

M, K, N1, N2 = 64, 4096, 2048, 4096
WHOLE = LinearConfig(block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3)
SPLIT = LinearConfig(block_n=64, block_k=256, split_k=4, num_warps=4, num_stages=3)
CONFIGS = pytest.mark.parametrize("config", [WHOLE, SPLIT], ids=["whole_k", "split_k"])
SMALL = LinearConfig(block_n=16, block_k=16, split_k=3, num_warps=4, num_stages=1)
needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="PDL needs sm_90 or later"
)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda").div(shape[-1] ** 0.25).to(torch.bfloat16)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


class Chain:
    """x -> h = x @ w1^T -> y = h @ w2^T, each linear split K with its own workspace."""

    def __init__(self, config: LinearConfig, use_pdl: bool):
        torch.manual_seed(0)
        self.x, self.w1, self.w2 = rand(M, K), rand(N1, K), rand(N2, N1)
        self.h = torch.empty(M, N1, dtype=torch.bfloat16, device="cuda")
        self.y = torch.empty(M, N2, dtype=torch.bfloat16, device="cuda")
        self.ws = [LinearWorkspace.create(M, n, SPLIT.split_k, "cuda") for n in (N1, N2)]
        self.config, self.use_pdl = config, use_pdl

    def __call__(self) -> None:
        skinny_linear(self.x, self.w1, out=self.h, workspace=self.ws[0], config=self.config, use_pdl=self.use_pdl)
        skinny_linear(self.h, self.w2, out=self.y, workspace=self.ws[1], config=self.config, use_pdl=self.use_pdl)

    def check(self, plain: Chain) -> None:
        """Against the float64 oracle, and the same bits as `plain` (same inputs) where K is not split."""
        assert rel_err(self.y, self.want()) <= 1e-2
        if self.config.split_k == 1:
            assert torch.equal(self.y, plain.y)
        assert not any(ws.counters.any() for ws in self.ws)

    def want(self) -> torch.Tensor:
        h = (self.x.double() @ self.w1.double().T).to(torch.bfloat16)
        return h.double() @ self.w2.double().T


@needs_hopper
@CONFIGS
def test_pdl_chain_matches_plain_launches_eagerly(config):
    plain, pdl = Chain(config, use_pdl=False), Chain(config, use_pdl=True)
    plain()
    pdl()
    torch.cuda.synchronize()
    pdl.check(plain)


@needs_hopper
@CONFIGS
def test_pdl_chain_from_a_graph_reads_each_replays_inputs(config):
    plain, pdl = Chain(config, use_pdl=False), Chain(config, use_pdl=True)
    pdl()  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pdl()
    for _ in range(2):
        plain.x.copy_(rand(M, K))
        pdl.x.copy_(plain.x)
        pdl.h.fill_(float("nan"))
        pdl.y.fill_(float("nan"))
        graph.replay()
        plain()
        torch.cuda.synchronize()
        pdl.check(plain)


@pytest.mark.parametrize("tma", [False, True], ids=["loads", "tma"])
def test_graph_replays_reduce_split_k_every_time(tma):
    m, n, k = 5, 40, 72
    x, w = rand(m, k), rand(n, k)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    ws = LinearWorkspace.create(m, n, SMALL.split_k, "cuda")
    config = replace(SMALL, tma=tma)
    skinny_linear(x, w, out=out, config=config, workspace=ws)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_linear(x, w, out=out, config=config, workspace=ws)
    for _ in range(3):
        x.copy_(rand(m, k))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, x.double() @ w.double().T) <= 1e-2
        assert not ws.counters.any()
