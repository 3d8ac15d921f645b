"""A decode graph's LoRA shrinks per token (BGMV) against in 16-row segments (SGMV), with the committed configs and
candidates: how the 16-row class is tuned, and whether segment shrinks would pay on per-token steps (they did not:
BGMV stays ahead below 129 rows except at 128 rows on one adapter; BENCHMARKS.md, twenty-eighth session).
Llama-3-8B shapes, bf16, rank 16, the four groups of a decoder layer (q/k/v, o, gate/up, down), each cycled over 32
layers' own slot stacks in one CUDA graph without an L2 flush (as in a decode step, where the first row of an adapter
brings its A from HBM and the rest find it in L2); µs per layer (`triton.testing.do_bench_cudagraph`). Also checks
every variant against float64 at every shape.

    python3 benchmarks/decode_shrinks.py --out DIR [--tokens 32 64 128] [--adapters 1 4 8 16 32]

Each variant is labelled path block_r/block_k/split_k/warps/stages (the committed configs: the path alone).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lora_kernels import LLAMA3_8B, SMOKE  # noqa: E402
from benchmarks.timing import graph_time_us  # noqa: E402
from kernels import lora_triton, lora_tuning, prepare_lora_metadata  # noqa: E402
from kernels.lora_metadata import LoRAMetadata  # noqa: E402
from kernels.lora_tuning import ShrinkConfig  # noqa: E402

LAYERS = 32
NUM_SLOTS = 64
# candidates beside the committed configs, in 16-row segments split further along K (more programs for a few
# tiles): ShrinkConfig(block_r, block_k, split_k, warps, stages)
CANDIDATES = [("sgmv", ShrinkConfig(16, bk, sk, w, st)) for bk, sk, w, st in
              [(64, 32, 2, 2), (64, 32, 4, 2), (128, 16, 4, 2), (64, 16, 4, 3), (64, 16, 2, 2), (128, 32, 4, 1),
               (64, 64, 2, 1), (64, 8, 2, 3), (32, 32, 2, 2)]]


def grouped_slots(tokens: int, adapters: int, device: str) -> torch.Tensor:
    """Rows spread evenly over `adapters` slots, interleaved (the metadata sorts them)."""
    return torch.tensor([i % adapters for i in range(tokens)], dtype=torch.int32, device=device)


def check(x: torch.Tensor, stacks: list[torch.Tensor], meta: LoRAMetadata, path: str,
          cfg: ShrinkConfig | None) -> float:
    h = lora_triton.shrink_slices(x, stacks, meta, path=path, config=cfg)
    slots = meta.slots[:meta.num_tokens].long()
    ref = torch.stack([torch.einsum("tk,trk->tr", x.double(), a.double()[slots]) for a in stacks])
    return float((h.double() - ref).norm() / ref.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, to check the script (TRITON_INTERPRET=1 without a GPU)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    groups, layers = (SMOKE, 2) if args.smoke else (LLAMA3_8B, LAYERS)
    torch.manual_seed(0)
    weights = {g.name: [[torch.randn(NUM_SLOTS, args.rank, g.k, device=device).mul_(g.k ** -0.5).bfloat16()
                         for _ in g.widths] for _ in range(layers)] for g in groups}
    rows = []
    for tokens in args.tokens:
        inputs = {g.name: torch.randn(tokens, g.k, device=device).bfloat16() for g in groups}
        for adapters in args.adapters:
            meta = prepare_lora_metadata(grouped_slots(tokens, adapters, device), NUM_SLOTS,
                                         out=LoRAMetadata.empty(tokens, NUM_SLOTS, device,
                                                                block_m=lora_tuning.DECODE_BLOCK_M))
            for path, cfg in [("bgmv", None), ("sgmv", None)] + CANDIDATES:
                label = path if cfg is None else \
                    f"{path} {cfg.block_r}/{cfg.block_k}/{cfg.split_k}/{cfg.num_warps}/{cfg.num_stages}"
                run_meta = meta.in_segments() if path == "sgmv" else meta
                row = dict(tokens=tokens, adapters=adapters, variant=label)
                for g in groups:
                    x = inputs[g.name]
                    row[f"{g.name}_err"] = check(x, weights[g.name][0], run_meta, path, cfg)
                    outs = [lora_triton.shrink_slices(x, weights[g.name][i], run_meta, path=path, config=cfg)
                            for i in range(layers)]

                    def step(g=g, x=x, outs=outs) -> None:
                        for i in range(layers):
                            lora_triton.shrink_slices(x, weights[g.name][i], run_meta, outs[i], path=path, config=cfg)

                    row[g.name] = graph_time_us(step, torch.device(device)) / layers
                row["layer"] = sum(row[g.name] for g in groups)
                rows.append(row)
                print(f"T{tokens:<4} A{adapters:<3} {label:22} " +
                      "  ".join(f"{g.name} {row[g.name]:6.2f}" for g in groups) + f"  layer {row['layer']:6.2f} us  "
                      f"err {max(row[f'{g.name}_err'] for g in groups):.1e}", flush=True)
            (args.out / "decode_shrinks.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
