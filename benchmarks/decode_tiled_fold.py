"""The LoRA expand folded into the fused ops at decode sizes: the per-token variants (B read once a token)
against the tiled ones (B read once a 16-row tile of same-adapter tokens), over how many adapters the rows
share (H200).

Llama-3-8B shapes, rank 16, bf16; every op is one CUDA-graph replay (`triton.testing.do_bench_cudagraph`),
and each tiled result is compared with the per-token one.

    python3 benchmarks/decode_tiled_fold.py --out DIR
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accuracy import relative_error  # noqa: E402
from benchmarks.fused_ops import LLAMA3_8B, Inputs  # noqa: E402
from benchmarks.timing import graph_time_us  # noqa: E402
from kernels import fused_lora_tiles_triton as tiles  # noqa: E402
from kernels import fused_triton  # noqa: E402
from kernels.fused_lora_tiles_triton import LoRATileConfig  # noqa: E402

SILU_TILES = (LoRATileConfig(128, 16, 4, 16), LoRATileConfig(64, 16, 4, 16), LoRATileConfig(256, 16, 4, 16),
              LoRATileConfig(256, 16, 8, 16))
ROTARY_TILES = (LoRATileConfig(1, 16, 4, 16), LoRATileConfig(2, 16, 4, 16))


def measure(inp: Inputs, adapters: int, device: torch.device) -> dict[str, float]:
    """µs of each op's per-token fold and its tiled variants (and the silu variants' difference from it)."""
    gate_up = inp.lora([inp.shapes.intermediate] * 2, seed=2, adapters=adapters)
    qkv = inp.lora(inp.qkv_widths, seed=3, adapters=adapters)
    hidden = inp.lora([inp.shapes.hidden], seed=1, adapters=adapters)
    row: dict[str, float] = {}
    want = fused_triton.silu_and_mul(inp.gate_up, gate_up)
    row["silu per-token"] = graph_time_us(lambda: fused_triton.silu_and_mul(inp.gate_up, gate_up), device)
    for c in SILU_TILES:
        name = f"silu tile c{c.chunk} w{c.num_warps}"
        row[f"{name} rel diff"] = relative_error(tiles.silu_and_mul(inp.gate_up, gate_up, config=c), want)
        row[name] = graph_time_us(lambda c=c: tiles.silu_and_mul(inp.gate_up, gate_up, config=c), device)
    q, k, v = inp.qkv_views(inp.qkv.clone())
    k_cache, v_cache = inp.caches()
    rotary_args = (q, k, v, inp.cos, inp.sin, inp.positions, k_cache, v_cache, inp.slots, qkv)
    row["rotary per-token"] = graph_time_us(lambda: fused_triton.rotary_and_write_kv(*rotary_args), device)
    for c in ROTARY_TILES:
        row[f"rotary tile h{c.chunk}"] = graph_time_us(lambda c=c: tiles.rotary_and_write_kv(*rotary_args, config=c),
                                                       device)
    norm_args = (inp.x, inp.residual, inp.weight, 1e-5, hidden)
    row["rms per-token"] = graph_time_us(lambda: fused_triton.add_rms_norm(*norm_args), device)
    row["rms tile"] = graph_time_us(lambda: tiles.add_rms_norm(*norm_args), device)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 2, 4, 16, 64])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    results = {}
    for tokens in args.tokens:
        inp = Inputs.random(LLAMA3_8B, tokens, device)
        for adapters in args.adapters:
            row = results[f"{tokens}x{adapters}"] = measure(inp, adapters, device)
            print(f"{tokens:4} tokens x {adapters:<3} adapters  "
                  + "  ".join(f"{k} {v:.1e}" if "diff" in k else f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_tiled_fold.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
