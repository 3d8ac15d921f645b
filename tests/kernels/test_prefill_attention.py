"""The Triton prefill attention over the paged cache against float64: fresh and chunked sequences, GQA,
ragged lengths, shuffled tables, every dtype; the dispatch; and the engine's greedy tokens with it."""
from __future__ import annotations

import pytest
import torch

from kernels import prefill_attention_triton
from kernels.attention import prefill_attention
from kernels.prefill_attention_triton import (
    CONFIGS,
    DEFAULT_CONFIG,
    PrefillConfig,
    PrefillPlan,
    paged_attention_prefill,
)
from tests.kernels.lora_cases import record_calls, relative_error, skip_without_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = skip_without_triton()
DIM, SCALE = 16, 0.3
TOLERANCE = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _case(seed: int, heads: int, kv_heads: int, query_lens: list[int], context_lens: list[int],
          dtype: torch.dtype, block_size: int = 16, dim: int = DIM):
    """Random q and caches; shuffled tables padded with a scratch block, and every slot no sequence
    holds (the scratch block, the tails of last blocks) NaN, so reading one poisons the output."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in context_lens]
    width, num_blocks = max(blocks) + 2, sum(blocks) + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    order = torch.randperm(num_blocks - 1, generator=gen).tolist()
    tables = torch.full((len(context_lens), width), num_blocks - 1)
    live = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for row, (n, length) in enumerate(zip(blocks, context_lens)):
        tables[row, :n] = torch.tensor(order[:n])
        order = order[n:]
        positions = torch.arange(length)
        live[tables[row, positions // block_size] * block_size + positions % block_size] = True
    for cache in (k_cache, v_cache):
        cache.view(-1, kv_heads, dim)[~live] = float("nan")
    q = torch.randn(sum(query_lens), heads, dim, generator=gen)
    return q.to(DEVICE, dtype), k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype), tables.to(DEVICE)


def _reference(q, k_cache, v_cache, tables, query_lens, context_lens) -> torch.Tensor:
    """float64, one sequence at a time: query at position p sees keys 0..p of its sequence."""
    group = q.shape[1] // k_cache.shape[2]
    out, start = [], 0
    for table, q_len, ctx in zip(tables, query_lens, context_lens):
        keys = k_cache[table].flatten(0, 1)[:ctx].double().repeat_interleave(group, dim=1)
        values = v_cache[table].flatten(0, 1)[:ctx].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + q_len].double(), keys) * SCALE
        future = torch.arange(ctx, device=q.device)[None, :] > torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, values))
        start += q_len
    return torch.cat(out)


def _run(q, k_cache, v_cache, tables, query_lens, context_lens, config=None) -> torch.Tensor:
    """With small tiles by default (32 rows: 8 to 32 queries, 16 keys), so short sequences span several."""
    config = config or PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)
    block_q = config.block_q(q.shape[1] // k_cache.shape[2])
    plan = PrefillPlan.build(query_lens, context_lens, q.device, block_q)
    out = torch.full_like(q, float("nan"))
    paged_attention_prefill(q, k_cache, v_cache, tables, plan, SCALE, out=out, config=config)
    assert not out.isnan().any(), "rows left unwritten (or NaN slots read)"
    return out


def _check(case, query_lens, context_lens, dtype, config=None) -> None:
    out = _run(*case, query_lens, context_lens, config)
    assert relative_error(out, _reference(*case, query_lens, context_lens)) < TOLERANCE[dtype]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2), (6, 2)])
def test_fresh_prompts_match_float64_for_every_grouping(heads, kv_heads):
    # lengths around the 16-token blocks and the 8-, 16- and 32-query tiles
    lens = [5, 33, 16, 1, 47]
    _check(_case(heads * 10 + kv_heads, heads, kv_heads, lens, lens, torch.float32), lens, lens, torch.float32)


def test_chunked_prefill_continuations_attend_to_their_earlier_context():
    # earlier contexts of 23, 1, 64, 14 and 15 tokens: on, before and after block and key-tile edges
    query_lens, context_lens = [7, 40, 33, 5, 12], [30, 41, 97, 19, 27]
    case = _case(1, 8, 2, query_lens, context_lens, torch.float32)
    _check(case, query_lens, context_lens, torch.float32)


def test_single_query_chunks_mix_with_longer_prompts():
    query_lens, context_lens = [1, 20, 1, 1], [1, 20, 18, 64]
    _check(_case(2, 4, 1, query_lens, context_lens, torch.float32), query_lens, context_lens, torch.float32)


@pytest.mark.parametrize("block_size", [8, 32])
def test_other_block_sizes(block_size):
    query_lens, context_lens = [19, 50], [45, 50]
    case = _case(3, 4, 2, query_lens, context_lens, torch.float32, block_size=block_size)
    _check(case, query_lens, context_lens, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE != "cuda", reason="the Triton 3.9 interpreter's tl.dot gets bfloat16 wrong (the GPU test covers it)"))])
def test_half_precision_matches_float64_loosely(dtype):
    query_lens, context_lens = [37, 9, 64], [37, 80, 100]
    _check(_case(4, 8, 2, query_lens, context_lens, dtype), query_lens, context_lens, dtype)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_candidate_config_is_correct(name):
    query_lens, context_lens = [70, 3], [150, 3]  # group 4: 32-query tiles
    case = _case(5, 4, 1, query_lens, context_lens, torch.float32)
    _check(case, query_lens, context_lens, torch.float32, CONFIGS[name])


def test_writes_only_its_rows_of_a_larger_output():
    """The model passes the prefill rows of an output whose first rows the decode attention fills."""
    query_lens, context_lens = [12, 21], [12, 30]
    q, k_cache, v_cache, tables = _case(6, 4, 2, query_lens, context_lens, torch.float32)
    full = torch.full((3 + q.shape[0], *q.shape[1:]), float("nan"), device=DEVICE)
    plan = PrefillPlan.build(query_lens, context_lens, q.device, DEFAULT_CONFIG.block_q(2))
    paged_attention_prefill(q, k_cache, v_cache, tables, plan, SCALE, out=full[3:])
    assert full[:3].isnan().all()
    assert relative_error(full[3:], _reference(q, k_cache, v_cache, tables, query_lens, context_lens)) < 1e-6


def test_plan_puts_the_tiles_reading_most_keys_first():
    values = PrefillPlan.host_values([40, 10], [40, 100], block_q=32)
    # tiles: seq 0 queries 0..31 (32 keys), seq 0 queries 32..39 (40 keys), seq 1 queries 0..9 (100 keys)
    assert values == [1, 0, 0] + [0, 32, 0] + [0, 40] + [40, 10] + [40, 100]


@pytest.mark.parametrize("group,block_q", [(1, 128), (4, 32), (6, 16), (32, 4)])
def test_a_tile_holds_block_m_rows_whatever_the_grouping(group, block_q):
    assert PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3).block_q(group) == block_q


def test_rejects_a_head_dim_that_is_not_a_power_of_two():
    q = torch.zeros(4, 2, 24, device=DEVICE)
    cache = torch.zeros(2, 16, 2, 24, device=DEVICE)
    plan = PrefillPlan.build([4], [4], DEVICE, block_q=64)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        paged_attention_prefill(q, cache, cache, torch.zeros(1, 1, dtype=torch.long, device=DEVICE), plan, SCALE)


@pytest.mark.parametrize("backend,expect_triton", [("triton", True), ("torch", False), ("", DEVICE == "cuda")])
def test_backend_switch_picks_the_prefill_kernel(backend, expect_triton, monkeypatch):
    monkeypatch.setenv("LORASERVE_ATTENTION_BACKEND", backend)
    calls = record_calls(monkeypatch, prefill_attention_triton, "paged_attention_prefill")
    query_lens, context_lens = [9, 4], [20, 4]
    q, k_cache, v_cache, tables = _case(7, 4, 2, query_lens, context_lens, torch.float32)
    out = prefill_attention(q, k_cache, v_cache, tables, query_lens, context_lens, SCALE)
    assert relative_error(out, _reference(q, k_cache, v_cache, tables, query_lens, context_lens)) < 1e-6
    assert len(calls) == (1 if expect_triton else 0)


def test_the_plan_gives_no_tiles_to_long_fresh_prompts(monkeypatch):
    monkeypatch.setattr(prefill_attention_triton, "SDPA_MIN_FRESH_TOKENS", 12)
    plan = PrefillPlan.build([20, 5, 7, 12], [20, 5, 30, 12], "cpu", block_q=4)
    assert set(plan.tiles[0].tolist()) == {1, 2}


def test_long_fresh_prompts_run_through_sdpa_and_the_rest_through_the_kernel(monkeypatch):
    """Poisoned output: every row is written, by SDPA for the long fresh prompts (20 and 12 tokens with a
    threshold of 12), by the kernel for a short one and a continued chunk."""
    from kernels import attention

    monkeypatch.setenv("LORASERVE_ATTENTION_BACKEND", "triton")
    monkeypatch.setattr(prefill_attention_triton, "SDPA_MIN_FRESH_TOKENS", 12)
    sdpa_calls = record_calls(monkeypatch, attention, "paged_attention_prefill")
    query_lens, context_lens = [20, 5, 7, 12], [20, 5, 30, 12]
    q, k_cache, v_cache, tables = _case(9, 4, 2, query_lens, context_lens, torch.float32)
    slots = torch.tensor([table[p // 16] * 16 + p % 16  # the new tokens' keys and values, as the model has them
                          for table, q_len, ctx in zip(tables.tolist(), query_lens, context_lens)
                          for p in range(ctx - q_len, ctx)], device=DEVICE)
    k, v = (cache.view(-1, *cache.shape[2:])[slots] for cache in (k_cache, v_cache))
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, k_cache, v_cache, tables, query_lens, context_lens, SCALE, k=k, v=v, out=out)
    assert [length for call in sdpa_calls for length in call.args[4]] == [20, 12]
    assert not out.isnan().any()
    assert relative_error(out, _reference(q, k_cache, v_cache, tables, query_lens, context_lens)) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("query_lens,context_lens", [
    ([512] * 16, [512] * 16),
    ([512, 512, 300, 1, 700], [2560, 1024, 1900, 2000, 700]),
], ids=["fresh_16x512", "chunked"])
def test_llama3_8b_heads_match_float64_in_bfloat16_on_the_gpu(name, query_lens, context_lens):
    case = _case(8, 32, 8, query_lens, context_lens, torch.bfloat16, dim=128)
    out = _run(*case, query_lens, context_lens, CONFIGS[name])
    assert relative_error(out, _reference(*case, query_lens, context_lens)) <= 1e-2


@pytest.mark.skipif(DEVICE == "cuda", reason="CPU engines; on CUDA, tests/engine/test_cuda.py compares the CUDA "
                                             "engine (this kernel) with the CPU one (the torch loop) token for token")
def test_engine_greedy_tokens_are_the_same_with_either_backend(tiny_llama, monkeypatch):
    """Fresh prompts, a 32-token prompt chunked over three steps (16 tokens a step) and decodes in one batch."""
    from engine import SamplingParams
    from tests.engine.conftest import make_engine, run_to_completion

    prompts = ["Hello there", "The capital of France is Paris. The capital of Italy is Rome. And Spain?", "ab"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    launches = record_calls(monkeypatch, prefill_attention_triton, "paged_attention_prefill")

    def tokens(backend: str) -> list[list[int]]:
        monkeypatch.setenv("LORASERVE_ATTENTION_BACKEND", backend)
        engine = make_engine(tiny_llama, max_num_batched_tokens=16, max_model_len=128)
        ids = [engine.add_request(p, params) for p in prompts]
        outputs = run_to_completion(engine)
        return [outputs[i].outputs[0].token_ids for i in ids]

    triton_tokens = tokens("triton")
    # two layers a step: 5 + 11 fresh, 15 chunked, 6 chunked + 2 fresh
    assert [launch.kwargs["out"].shape[0] for launch in launches] == [16, 16, 15, 15, 8, 8]
    plans = [launch.args[4] for launch in launches]
    assert all(plans[i] is plans[i + 1] is not plans[i + 2] for i in (0, 2)), "one plan per step, from build_step"
    assert triton_tokens == tokens("torch")
    assert len(launches) == 6
