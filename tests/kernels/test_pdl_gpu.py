"""Programmatic dependent launch on a Hopper GPU: a decoder layer's chain of Triton kernels (and the cuBLAS
matmuls between them) computes the same bits with PDL as without, eagerly and replayed from one CUDA graph.

Under PDL a kernel starts while its predecessor finishes, so a read placed before `wait_for_predecessor`
that should come after it would see the predecessor's input of the last run. Every run therefore starts
from new activations and adapter slots and from the same KV cache contents: a stale read shows as a
difference. The chain covers each kernel family: the LoRA shrink and expand (per-token and segmented),
the fused ops with and without a folded LoRA delta, split and single-pass decode attention, and the
greedy choice with and without its combine launch.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

import kernels
from kernels import LoRADelta, LoRAMetadata, fused, lora_tuning
from kernels.device import PDL_ENV, use_pdl
from kernels.pdl_triton import pdl_launch
from tests.kernels.lora_cases import NUM_SLOTS, packed_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                       reason="needs a CUDA device of compute capability 9.0 or more (PDL)"),
]

HEADS, KV_HEADS, DIM = 8, 2, 128
HIDDEN, KV, INTER, VOCAB, RANK = HEADS * DIM, KV_HEADS * DIM, 512, 4096, 16
BLOCK_SIZE, MAX_POSITION, EPS = 16, 300, 1e-5
DTYPE = torch.bfloat16


@dataclass
class Layer:
    """One decode step's inputs (rewritten in place between runs), weights and KV cache."""

    x: torch.Tensor
    residual: torch.Tensor
    slots: torch.Tensor
    meta: LoRAMetadata
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    initial_cache: tuple[torch.Tensor, torch.Tensor]
    weights: dict[str, torch.Tensor]
    a: dict[str, list[torch.Tensor]]
    b: dict[str, list[torch.Tensor]]

    def new_inputs(self) -> None:
        """Fresh activations and adapter slots."""
        self.x.copy_(torch.randn_like(self.x))
        self.residual.copy_(torch.randn_like(self.residual))
        self.slots.copy_(torch.randint_like(self.slots, -1, NUM_SLOTS))

    def reset_cache(self) -> None:
        """The KV cache back to its first contents (a run writes the step's K and V into it)."""
        self.k_cache.copy_(self.initial_cache[0])
        self.v_cache.copy_(self.initial_cache[1])


def make_layer(tokens: int, device: str = "cuda") -> Layer:
    positions = torch.randint(0, MAX_POSITION, (tokens,), device=device)
    width = -(-MAX_POSITION // BLOCK_SIZE)
    block_tables = torch.randperm(tokens * width, device=device).view(tokens, width).int()
    slot_mapping = block_tables.gather(1, (positions // BLOCK_SIZE)[:, None])[:, 0].long() * BLOCK_SIZE \
        + positions % BLOCK_SIZE
    angles = torch.arange(MAX_POSITION, device=device)[:, None] \
        * 10000.0 ** (-torch.arange(0, DIM, 2, device=device) / DIM)[None, :]
    angles = torch.cat([angles, angles], dim=1)
    cache_shape = (tokens * width, BLOCK_SIZE, KV_HEADS, DIM)
    initial_cache = (torch.randn(cache_shape, device=device, dtype=DTYPE),
                     torch.randn(cache_shape, device=device, dtype=DTYPE))

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, device=device) / cols ** 0.5).to(DTYPE)

    widths = {"qkv": (HIDDEN, KV, KV), "o": (HIDDEN,), "gate_up": (INTER, INTER)}
    inputs = {"qkv": HIDDEN, "o": HIDDEN, "gate_up": HIDDEN}
    return Layer(
        x=torch.empty(tokens, HIDDEN, device=device, dtype=DTYPE),
        residual=torch.empty(tokens, HIDDEN, device=device, dtype=DTYPE),
        slots=torch.empty(tokens, device=device, dtype=torch.int32),
        meta=LoRAMetadata.empty(tokens, NUM_SLOTS, device),
        positions=positions, slot_mapping=slot_mapping, block_tables=block_tables,
        context_lens=(positions + 1).int(), cos=angles.cos(), sin=angles.sin(),
        k_cache=initial_cache[0].clone(), v_cache=initial_cache[1].clone(), initial_cache=initial_cache,
        weights={"qkv": weight(HIDDEN + 2 * KV, HIDDEN), "o": weight(HIDDEN, HIDDEN),
                 "gate_up": weight(2 * INTER, HIDDEN), "norm": 1 + 0.1 * weight(1, HIDDEN)[0],
                 "lm_head": weight(VOCAB, INTER)},
        a={name: packed_weights([(RANK, inputs[name])] * len(w), DTYPE, device) for name, w in widths.items()},
        b={name: packed_weights([(n, RANK) for n in w], DTYPE, device) for name, w in widths.items()},
    )


def run_layer(layer: Layer, fold: bool, splits: int) -> dict[str, torch.Tensor]:
    """The decode step of one layer and the LM head, as the engine runs it: with `fold` each LoRA expand is
    left to the fused op that consumes the projection, otherwise it is a launch of its own."""
    from kernels.greedy_triton import greedy
    from kernels.paged_attention_triton import paged_attention_decode

    tokens = layer.x.shape[0]
    meta = kernels.prepare_lora_metadata(layer.slots, NUM_SLOTS, out=layer.meta)

    def project(x: torch.Tensor, name: str) -> tuple[torch.Tensor, LoRADelta | None]:
        y = x @ layer.weights[name].T
        delta = LoRADelta(kernels.lora_shrink_slices(x, layer.a[name], meta), tuple(layer.b[name]), meta)
        if fold:
            return y, delta
        delta.apply(y)
        return y, None

    qkv, delta = project(layer.x, "qkv")
    q, k, v = (t.view(tokens, -1, DIM) for t in qkv.split([HIDDEN, KV, KV], dim=1))
    fused.rotary_and_write_kv(q, k, v, layer.cos, layer.sin, layer.positions, layer.k_cache, layer.v_cache,
                              layer.slot_mapping, lora=delta)
    attention = paged_attention_decode(q, layer.k_cache, layer.v_cache, layer.block_tables, layer.context_lens,
                                       DIM ** -0.5, num_splits=splits).reshape(tokens, HIDDEN)
    o, delta = project(attention, "o")
    normed, hidden = fused.add_rms_norm(o, layer.residual, layer.weights["norm"], EPS, lora=delta)
    gate_up, delta = project(normed, "gate_up")
    activated = fused.silu_and_mul(gate_up, lora=delta)
    token_ids, logprobs = greedy(activated @ layer.weights["lm_head"].T, VOCAB, splits=splits)
    return {"qkv": qkv, "attention": attention, "o": o, "normed": normed, "hidden": hidden, "gate_up": gate_up,
            "activated": activated, "token_ids": token_ids, "logprobs": logprobs, "k_cache": layer.k_cache,
            "v_cache": layer.v_cache}


def snapshot(outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    torch.cuda.synchronize()
    return {name: t.clone() for name, t in outputs.items()}


def assert_same_bits(with_pdl: dict[str, torch.Tensor], without: dict[str, torch.Tensor]) -> None:
    different = [name for name in without if not torch.equal(with_pdl[name], without[name])]
    assert not different, f"with PDL these differ: {different}"


@pytest.fixture(autouse=True)
def shrinks_in_one_split(monkeypatch):
    """Split-K shrinks add their partials with atomics, in an order no run repeats: with one split every run of
    the chain computes the same bits, with PDL or without."""
    shrink_config = lora_tuning.shrink_config
    monkeypatch.setattr(lora_tuning, "shrink_config", lambda *key: replace(shrink_config(*key), split_k=1))


@pytest.fixture
def set_pdl(monkeypatch):
    """set_pdl(on): launch the kernels with PDL or without from here on."""
    def switch(on: bool) -> None:
        monkeypatch.setenv(PDL_ENV, "1" if on else "0")
        use_pdl.cache_clear()
        assert pdl_launch(torch.device("cuda", torch.cuda.current_device()))["launch_pdl"] is on

    yield switch
    use_pdl.cache_clear()


CHAINS = pytest.mark.parametrize("tokens,fold,splits", [(64, True, 4), (64, False, 1), (200, False, 4)],
                                 ids=["per-token-folded-split", "per-token-single-pass", "segments-split"])


@CHAINS
def test_eager_chain_computes_the_same_bits_with_pdl(tokens, fold, splits, set_pdl):
    torch.manual_seed(0)
    layer = make_layer(tokens)
    for _ in range(3):
        layer.new_inputs()
        runs = {}
        for on in (False, True):
            set_pdl(on)
            layer.reset_cache()
            runs[on] = snapshot(run_layer(layer, fold, splits))
        assert_same_bits(runs[True], runs[False])


@CHAINS
def test_graph_replay_computes_the_same_bits_with_pdl(tokens, fold, splits, set_pdl):
    torch.manual_seed(0)
    layer = make_layer(tokens)
    layer.new_inputs()
    graphs = {}
    for on in (False, True):
        set_pdl(on)
        run_layer(layer, fold, splits)  # compiles this variant outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = run_layer(layer, fold, splits)
        graphs[on] = graph, outputs
    for _ in range(3):
        layer.new_inputs()
        runs = {}
        for on, (graph, outputs) in graphs.items():
            layer.reset_cache()
            graph.replay()
            runs[on] = snapshot(outputs)
        assert_same_bits(runs[True], runs[False])
