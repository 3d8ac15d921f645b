"""Decode-attention launch configs with the KV cache cold, as a decode step meets it (H200).

`decode_attention.py --sweep` replays one cache, part of which stays in L2. Here each config runs over 32
layers' caches in one CUDA graph, so K and V come from HBM, with the block tables shuffled or in order.
Every tile (16-128 tokens) x warps (2, 4) x stages (1-3) x splits (1-4) is timed against the committed
table's choice; the output is checked against the committed config's.

    python3 benchmarks/decode_attention_cold.py --out DIR
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hbm import measure_bandwidth  # noqa: E402
from benchmarks.timing import median_replay_us  # noqa: E402
from kernels.device import multiprocessor_count  # noqa: E402
from kernels.paged_attention_triton import (  # noqa: E402
    DecodeConfig, decode_config, default_num_splits, paged_attention_decode,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 32, 8, 128, 16, 32
CASES = ((64, 560, True), (64, 560, False), (128, 560, True), (32, 560, True), (64, 2048, True))


def candidates(batch: int, width: int, device: torch.device) -> list[tuple[DecodeConfig, int, bool]]:
    """(config, splits, committed?) for the committed choice and the whole grid."""
    committed = decode_config(torch.bfloat16, batch, KV_HEADS)
    splits = default_num_splits(batch, KV_HEADS, width * BLOCK, multiprocessor_count(device),
                                committed.programs_per_sm)
    grid = [(DecodeConfig(tokens=t, num_warps=w, num_stages=s), sp, False)
            for t, w, s, sp in itertools.product((16, 32, 64, 128), (2, 4), (1, 2, 3), (1, 2, 3, 4))]
    return [(committed, splits, True), *grid]


def run_case(batch: int, context: int, shuffled: bool, bandwidth: float, device: torch.device) -> list[dict]:
    width = triton.cdiv(context, BLOCK)
    blocks = batch * width
    caches = [tuple(torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
                    for _ in "kv") for _ in range(LAYERS)]
    order = torch.randperm(blocks, device=device) if shuffled else torch.arange(blocks, device=device)
    tables = order.view(batch, width).to(torch.int32)
    lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    floor_us = batch * context * KV_HEADS * HEAD_DIM * 4 / bandwidth * 1e6
    rows, reference = [], None
    for config, splits, committed in candidates(batch, width, device):
        def step(config=config, splits=splits) -> None:
            for k_cache, v_cache in caches:
                paged_attention_decode(q, k_cache, v_cache, tables, lens, HEAD_DIM ** -0.5, out=out,
                                       num_splits=splits, config=config)
        try:
            us = median_replay_us(step, 5) / LAYERS
        except Exception as exc:  # noqa: BLE001 - a config past the shared memory limit
            print(f"  {config} splits {splits}: {type(exc).__name__}", flush=True)
            continue
        reference = out.clone() if reference is None else reference
        error = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
        rows.append(dict(batch=batch, context=context, shuffled=shuffled, tokens=config.tokens,
                         warps=config.num_warps, stages=config.num_stages, splits=splits, committed=committed,
                         us=us, floor_us=floor_us, rel_diff_to_committed=error))
    best = sorted(rows, key=lambda r: r["us"])
    mine = next(r for r in rows if r["committed"])
    print(f"batch {batch} context {context} shuffled {shuffled}: floor {floor_us:.1f} us, committed "
          f"{mine['us']:.1f} (tokens {mine['tokens']}, warps {mine['warps']}, stages {mine['stages']}, "
          f"splits {mine['splits']})", flush=True)
    for r in best[:6]:
        print(f"   {r['us']:6.1f}  tokens {r['tokens']} warps {r['warps']} stages {r['stages']} splits {r['splits']}"
              f"  diff {r['rel_diff_to_committed']:.1e}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    bandwidth = measure_bandwidth("cuda")
    rows = []
    for batch, context, shuffled in CASES:
        rows += run_case(batch, context, shuffled, bandwidth, device)
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_attention_cold.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
