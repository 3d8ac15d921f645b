"""Plot throughput against the number of distinct adapters from `serving.py`'s JSON.

    python benchmarks/plot_serving.py results/serving.json benchmarks/serving_throughput.png
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(source: str, target: str) -> None:
    results = json.load(open(source))
    sweep = {int(k): v["tok_per_s"] for k, v in results.get("sweep", {}).items()}
    if "c_64_adapters" in results:
        sweep.setdefault(64, results["c_64_adapters"]["tok_per_s"])
    points = sorted(sweep.items())
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot([n for n, _ in points], [t for _, t in points], "o-", label="loraserve (uniform over N adapters)")
    if "d_1000_zipf" in results:
        d = results["d_1000_zipf"]
        ax.plot([1000], [d["tok_per_s"]], "s", label=f"loraserve, 1000 adapters Zipf ({d['distinct_adapters']} used)")
    if "a_base" in results:
        ax.axhline(results["a_base"]["tok_per_s"], color="gray", ls="--", label="loraserve, base model only")
    if "transformers_peft" in results:
        peft = results["transformers_peft"]
        ax.plot([peft["mixed_adapters"]], [peft["mixed_tok_per_s"]], "x", color="red", ms=10,
                label=f"transformers+peft, {peft['mixed_adapters']} mixed adapters (batch {peft['batch']})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("distinct adapters in the workload")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{results['config']['shape']} (random weights), H200, bf16, rank 16 on all projections")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
