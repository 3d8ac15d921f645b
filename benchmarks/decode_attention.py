"""Paged decode attention at Llama-3-8B shapes: single pass vs split context.

For each batch × context it checks the Triton decode (one pass, `num_splits=1`, and the default
split count) against float64 torch on a few rows, times both inside CUDA graphs
(`triton.testing.do_bench_cudagraph`) and sets them against the bytes floor: K and V of every
context token read once, at the bandwidth of a 2 GiB device-to-device copy measured in the same
run. Block tables are random; `--table-tokens` makes them wider than the context (padded with a
scratch block), as the engine's graphs are. `--splits` also times the given split counts (for tuning the default).
Small shapes stay in the 60 MB L2 across graph replays, so their fraction of the floor can pass 1.

    python benchmarks/decode_attention.py [--out DIR]
    python benchmarks/decode_attention.py --smoke     # tiny shapes; on a CPU under the Triton interpreter
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hbm import measure_bandwidth  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
SMOKE_HEADS, SMOKE_KV_HEADS, SMOKE_HEAD_DIM = 4, 2, 16
SCALE = HEAD_DIM ** -0.5
CHECK_ROWS = 4


def _time_us(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench_cudagraph(fn, rep=20) * 1e3
    fn()
    begin = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - begin) / 3 * 1e6


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


class Shapes:
    def __init__(self, smoke: bool):
        self.heads = SMOKE_HEADS if smoke else HEADS
        self.kv_heads = SMOKE_KV_HEADS if smoke else KV_HEADS
        self.head_dim = SMOKE_HEAD_DIM if smoke else HEAD_DIM


def decode_row(shapes: Shapes, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: int, context: int,
               table_tokens: int, splits: list[int], bandwidth: float) -> dict:
    from kernels.paged_attention_triton import (
        default_num_splits,
        multiprocessor_count,
        paged_attention_decode,
    )

    device = k_cache.device
    gen = torch.Generator(device=device).manual_seed(batch * 100003 + context)
    scratch = k_cache.shape[0] - 1
    used = context // BLOCK_SIZE
    width = max(used, table_tokens // BLOCK_SIZE)
    tables = torch.full((batch, width), scratch, dtype=torch.long, device=device)
    tables[:, :used] = torch.randperm(scratch, generator=gen, device=device)[:batch * used].view(batch, used)
    lens = torch.full((batch,), context, dtype=torch.long, device=device)
    q = torch.randn(batch, shapes.heads, shapes.head_dim, generator=gen, device=device, dtype=k_cache.dtype)
    out = torch.empty_like(q)
    rows = slice(0, min(batch, CHECK_ROWS))
    ref = _reference_rows(q, k_cache, v_cache, tables, lens, rows)
    default = default_num_splits(batch, shapes.kv_heads, width * BLOCK_SIZE, multiprocessor_count(device))
    times, errors = {}, {}
    for count in dict.fromkeys([1, default, *splits]):
        def run(count=count):
            return paged_attention_decode(q, k_cache, v_cache, tables, lens, SCALE, out=out, num_splits=count)
        errors[count] = _rel(run()[rows], ref)
        times[count] = _time_us(run, device)
    floor_us = 2 * batch * context * shapes.kv_heads * shapes.head_dim * k_cache.element_size() / bandwidth * 1e6
    return dict(batch=batch, context=context, table_tokens=width * BLOCK_SIZE, default_splits=default,
                single_us=times[1], split_us=times[default], floor_us=floor_us,
                rel_err=max(errors.values()), times_by_splits={str(k): v for k, v in times.items()})


def _reference_rows(q, k_cache, v_cache, tables, lens, rows) -> torch.Tensor:
    """float64 torch on the checked rows only, gathering just their blocks (the whole cache in float64 is too big)."""
    from kernels.attention import paged_attention_decode as torch_decode

    needed = tables[rows]
    blocks, local = torch.unique(needed, return_inverse=True)
    return torch_decode(q[rows].double(), k_cache[blocks].double(), v_cache[blocks].double(), local, lens[rows], SCALE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64, 128, 256])
    parser.add_argument("--contexts", type=int, nargs="*", default=[128, 512, 2048, 8192])
    parser.add_argument("--table-tokens", type=int, default=0,
                        help="block-table width in tokens (default: the context)")
    parser.add_argument("--splits", type=int, nargs="*", default=[], help="also time these split counts")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, fp16; runs on a CPU (Triton interpreter)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.batches, args.contexts = [1, 3], [16, 80]
        args.splits = args.splits or [2]
    shapes = Shapes(args.smoke)
    dtype = torch.float16 if args.smoke else torch.bfloat16
    bandwidth = measure_bandwidth(device)
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    slots = max(args.batches) * max(args.contexts)
    num_blocks = -(-slots // BLOCK_SIZE) + 1
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, shapes.kv_heads, shapes.head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    decode = []
    print(f"{'batch':>6}{'context':>8}{'splits':>7}{'single us':>11}{'split us':>10}{'floor us':>10}"
          f"{'of floor':>9}{'speedup':>9}{'rel err':>9}")
    for batch in args.batches:
        for context in args.contexts:
            row = decode_row(shapes, k_cache, v_cache, batch, context, args.table_tokens, args.splits, bandwidth)
            decode.append(row)
            others = "  " + " ".join(f"{k}:{v:.1f}" for k, v in row["times_by_splits"].items()) if args.splits else ""
            print(f"{batch:>6}{context:>8}{row['default_splits']:>7}{row['single_us']:>11.1f}{row['split_us']:>10.1f}"
                  f"{row['floor_us']:>10.1f}{row['floor_us'] / row['split_us']:>9.2f}"
                  f"{row['single_us'] / row['split_us']:>8.2f}x{row['rel_err']:>9.1e}{others}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        result = dict(device=str(device), dtype=str(dtype), bandwidth_bytes_per_s=bandwidth, decode=decode)
        (args.out / "decode_attention.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
