"""The Triton paged decode attention and KV write against float64 torch: splits, GQA, ragged lengths, launch configs;
and the config table's lookup."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import decode_attention, write_kv_torch
from kernels.attention import paged_attention_decode as torch_decode
from tests.kernels.lora_cases import record_calls, relative_error, skip_without_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = skip_without_triton()
BLOCK_SIZE, DIM = 16, 16
TOLERANCE = {torch.float32: 1e-6, torch.float16: 2e-3}


def _case(seed: int, heads: int, kv_heads: int, lengths: list[int], width: int, dtype: torch.dtype, dim: int = DIM):
    """Random q and caches; block tables `width` blocks wide, unused entries pointing at a scratch block."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    num_blocks = batch * width + 1
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    q = torch.randn(batch, heads, dim, generator=gen).to(DEVICE, dtype)
    tables = torch.randperm(num_blocks - 1, generator=gen).view(batch, width)
    for row, length in enumerate(lengths):
        tables[row, -(-length // BLOCK_SIZE):] = num_blocks - 1
    lens = torch.tensor(lengths)
    return q, k_cache, v_cache, tables.to(DEVICE), lens.to(DEVICE)


def _reference(q, k_cache, v_cache, tables, lens) -> torch.Tensor:
    return torch_decode(q.double(), k_cache.double(), v_cache.double(), tables, lens, 0.3)


def _run(q, k_cache, v_cache, tables, lens, num_splits: int | None, config=None) -> torch.Tensor:
    from kernels.paged_attention_triton import paged_attention_decode

    out = torch.full_like(q, float("nan"))
    paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.3, out=out, num_splits=num_splits, config=config)
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_decode_matches_float64_with_ragged_lengths(heads, kv_heads, dtype):
    # 32-token tiles (fp32) or 64 (fp16); 3 splits: lengths on and around tile and split boundaries
    lengths = [1, 32, 33, 64, 96, 150, 192, 17]
    q, k_cache, v_cache, tables, lens = _case(heads * 10 + kv_heads, heads, kv_heads, lengths, 13, dtype)
    out = _run(q, k_cache, v_cache, tables, lens, num_splits=3)
    assert relative_error(out, _reference(q, k_cache, v_cache, tables, lens)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_single_pass_decode_matches_float64(dtype):
    q, k_cache, v_cache, tables, lens = _case(7, 8, 2, [1, 6, 20, 13, 80], 6, dtype)
    out = _run(q, k_cache, v_cache, tables, lens, num_splits=1)
    assert relative_error(out, _reference(q, k_cache, v_cache, tables, lens)) < TOLERANCE[dtype]


@pytest.mark.parametrize("num_splits", [1, 4])
def test_rows_of_length_zero_are_left_untouched(num_splits):
    q, k_cache, v_cache, tables, lens = _case(3, 4, 2, [40, 0, 100, 0], 8, torch.float32)
    out = _run(q, k_cache, v_cache, tables, lens, num_splits=num_splits)
    assert out[[1, 3]].isnan().all()
    live = torch.tensor([0, 2])
    ref = _reference(q[live], k_cache, v_cache, tables[live], lens[live])
    assert relative_error(out[live], ref) < 1e-6


def test_more_splits_than_tiles_leaves_the_extra_splits_idle():
    q, k_cache, v_cache, tables, lens = _case(5, 6, 3, [1, 31, 45, 70], 5, torch.float32)
    out = _run(q, k_cache, v_cache, tables, lens, num_splits=8)
    assert relative_error(out, _reference(q, k_cache, v_cache, tables, lens)) < 1e-6


def test_default_path_matches_float64_on_a_wide_padded_table():
    q, k_cache, v_cache, tables, lens = _case(11, 4, 1, [300, 5, 513], 40, torch.float32)
    out = _run(q, k_cache, v_cache, tables, lens, num_splits=None)
    assert relative_error(out, _reference(q, k_cache, v_cache, tables, lens)) < 1e-6


@pytest.mark.parametrize("batch,max_context,splits", [
    (64, 512, 1),  # 512 programs already fill 132 multiprocessors
    (16, 2048, 4),
    (1, 8192, 32),  # capped at MAX_SPLITS
    (1, 512, 8),  # capped at one split per 64 tokens of the table
    (1, 256, 1),  # short tables take one pass
])
def test_default_split_count_fills_the_multiprocessors(batch, max_context, splits):
    from kernels.paged_attention_triton import default_num_splits

    assert default_num_splits(batch, 8, max_context, multiprocessors=132) == splits


@pytest.mark.parametrize("tokens,num_warps,num_stages", [(16, 2, 1), (32, 8, 2), (128, 4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_with_other_launch_configs_matches_float64(tokens, num_warps, num_stages, dtype):
    from kernels.paged_attention_triton import DecodeConfig

    # a 320-token table is wider than one pass; on a CPU's one "SM", 48 programs over 4 sequences x 2 KV heads
    # ask for 6 splits, capped at 5 (one per 64 tokens of the table)
    config = DecodeConfig(tokens=tokens, num_warps=num_warps, num_stages=num_stages, programs_per_sm=48)
    q, k_cache, v_cache, tables, lens = _case(tokens + num_warps, 8, 2, [300, 17, 129, 64], 20, dtype)
    out = _run(q, k_cache, v_cache, tables, lens, num_splits=None, config=config)
    assert relative_error(out, _reference(q, k_cache, v_cache, tables, lens)) < TOLERANCE[dtype]


@pytest.mark.parametrize("programs_per_sm,combined", [(1, False), (48, True)])
def test_a_configs_split_target_decides_whether_the_context_is_split(programs_per_sm, combined, monkeypatch):
    from kernels import paged_attention_triton
    from kernels.paged_attention_triton import DecodeConfig

    launches = record_calls(monkeypatch, paged_attention_triton, "_combine_kernel")
    monkeypatch.setattr(paged_attention_triton, "multiprocessor_count", lambda device: 4)  # 4 programs: 2 x 2 heads
    config = DecodeConfig(tokens=32, num_warps=4, num_stages=3, programs_per_sm=programs_per_sm)
    q, k_cache, v_cache, tables, lens = _case(9, 4, 2, [300, 40], 20, torch.float32)
    out = _run(q, k_cache, v_cache, tables, lens, num_splits=None, config=config)
    assert bool(launches) == combined
    assert relative_error(out, _reference(q, k_cache, v_cache, tables, lens)) < 1e-6


@pytest.mark.parametrize("tokens", [8, 48])
def test_config_rejects_tiles_that_are_not_a_power_of_two_of_at_least_16(tokens):
    from kernels.paged_attention_triton import DecodeConfig

    with pytest.raises(ValueError, match="power of two"):
        DecodeConfig(tokens=tokens, num_warps=4, num_stages=3)


@pytest.mark.parametrize("dtype,expected", [(torch.bfloat16, "16bit"), (torch.float16, "16bit"),
                                            (torch.float32, "fp32")])
def test_shape_class_is_the_dtype_class_and_the_programs_rounded_up_to_a_power_of_two(dtype, expected):
    from kernels.paged_attention_triton import decode_class

    assert decode_class(dtype, 48, 8) == (expected, 512)
    assert decode_class(dtype, 64, 8) == (expected, 512)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch", [1, 7, 64, 256, 4096])
def test_every_shape_has_a_config_in_the_table(dtype, batch):
    from kernels.paged_attention_triton import DecodeConfig, decode_config

    assert isinstance(decode_config(dtype, batch, 8), DecodeConfig)


@pytest.fixture
def small_table(monkeypatch):
    """A table with two 16-bit buckets and one fp32 bucket, the lookup's cache cleared around the test."""
    from kernels import paged_attention_triton
    from kernels.paged_attention_triton import DecodeConfig

    table = {("16bit", 256): DecodeConfig(16, 2, 1), ("16bit", 1024): DecodeConfig(32, 8, 2),
             ("fp32", 256): DecodeConfig(128, 4, 4)}
    monkeypatch.setattr(paged_attention_triton, "DECODE_CONFIGS", table)
    paged_attention_triton.decode_config.cache_clear()
    yield table
    paged_attention_triton.decode_config.cache_clear()


@pytest.mark.parametrize("dtype,batch,key", [
    (torch.bfloat16, 1, ("16bit", 256)),  # below the smallest bucket
    (torch.bfloat16, 32, ("16bit", 256)),  # 256 programs: exactly the bucket
    (torch.float16, 33, ("16bit", 1024)),  # 264: the next bucket up
    (torch.bfloat16, 1000, ("16bit", 1024)),  # above every bucket: the largest
    (torch.float32, 64, ("fp32", 256)),  # fp32 has its own class
])
def test_lookup_takes_the_smallest_bucket_at_or_above_the_shape(small_table, dtype, batch, key):
    from kernels.paged_attention_triton import decode_config

    assert decode_config(dtype, batch, 8) == small_table[key]


def test_default_split_count_follows_the_split_target():
    from kernels.paged_attention_triton import default_num_splits

    assert default_num_splits(64, 8, 544, multiprocessors=132, programs_per_sm=4) == 1
    assert default_num_splits(64, 8, 544, multiprocessors=132, programs_per_sm=8) == 2


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_every_table_config_matches_float64_at_llama3_8b_heads_on_the_gpu():
    from kernels.paged_attention_triton import DECODE_CONFIGS

    # a table 2048 tokens wide, as the decode graphs' are; lengths across tiles and splits
    lengths = [544, 1, 2048, 1000, 17, 1500, 64, 700]
    for (dtype_class, bucket), config in DECODE_CONFIGS.items():
        dtype = torch.float32 if dtype_class == "fp32" else torch.bfloat16
        q, k_cache, v_cache, tables, lens = _case(bucket, 32, 8, lengths, 128, dtype, dim=128)
        out = _run(q, k_cache, v_cache, tables, lens, num_splits=None, config=config)
        error = relative_error(out, _reference(q, k_cache, v_cache, tables, lens))
        assert error <= 1e-2, f"{(dtype_class, bucket)}: {config} is off float64 by {error:.1e}"


def _kv_case(tokens: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(tokens)
    num_blocks, kv_heads = 6, 3
    k_cache = torch.full((num_blocks, BLOCK_SIZE, kv_heads, DIM), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    # k and v as strided views of one fused projection, as the model produces them
    qkv = torch.randn(tokens, 4 * kv_heads * DIM, generator=gen).to(DEVICE)
    k = qkv[:, kv_heads * DIM:2 * kv_heads * DIM].view(tokens, kv_heads, DIM)
    v = qkv[:, 3 * kv_heads * DIM:].view(tokens, kv_heads, DIM)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:tokens].to(DEVICE)
    return k_cache, v_cache, k, v, slots


@pytest.mark.parametrize("backend,expect_triton", [("triton", True), ("torch", False), ("", DEVICE == "cuda")])
def test_backend_switch_picks_the_decode_kernel(backend, expect_triton, monkeypatch):
    from kernels import paged_attention_triton

    monkeypatch.setenv("LORASERVE_ATTENTION_BACKEND", backend)
    calls = record_calls(monkeypatch, paged_attention_triton, "paged_attention_decode")
    k_cache, v_cache, k, v, slots = _kv_case(BLOCK_SIZE * 4, torch.float32)
    write_kv_torch(k_cache, v_cache, k, v, slots)
    q = torch.randn(2, 6, DIM, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    tables = torch.tensor([[0, 1, 2, 3], [5, 4, 2, 1]], device=DEVICE)
    lens = torch.tensor([64, 50], device=DEVICE)
    caches = k_cache.nan_to_num(), v_cache.nan_to_num()
    out = decode_attention(q, *caches, tables, lens, 0.3)
    assert relative_error(out, _reference(q, *caches, tables, lens)) < 1e-6
    assert len(calls) == (1 if expect_triton else 0)


def test_backend_switch_rejects_unknown_names(monkeypatch):
    monkeypatch.setenv("LORASERVE_ATTENTION_BACKEND", "cuda")
    k_cache, v_cache, *_ = _kv_case(BLOCK_SIZE, torch.float32)
    q = torch.randn(1, 6, DIM, device=DEVICE)
    tables = torch.tensor([[0]], device=DEVICE)
    with pytest.raises(ValueError, match="LORASERVE_ATTENTION_BACKEND"):
        decode_attention(q, k_cache, v_cache, tables, torch.tensor([4], device=DEVICE), 0.3)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_torch_decode_ignores_whatever_lies_past_each_context(poison):
    """Blocks past a sequence's context hold other sequences' or freed values: a NaN there (one request's bad
    adapter) must not reach any other sequence's output."""
    q, k_cache, v_cache, tables, lens = _case(7, 4, 2, [5, 21, 16], 3, torch.float32)
    clean = torch_decode(q, k_cache, v_cache, tables, lens, 0.3)
    for cache in (k_cache, v_cache):
        cache[-1] = poison  # the scratch block the unused table entries point at
        for row, length in enumerate(lens.tolist()):
            if length % BLOCK_SIZE:
                cache[tables[row, length // BLOCK_SIZE], length % BLOCK_SIZE:] = poison
    torch.testing.assert_close(torch_decode(q, k_cache, v_cache, tables, lens, 0.3), clean, rtol=0, atol=0)
