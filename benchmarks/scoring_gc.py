"""What Python's garbage collector costs a scoring run, with list and with flat prompt-logprob records.

Scoring prompts (`prompt_logprobs=1`, one token out) keeps a dict and its `Logprob`s alive for every prompt token
until the run ends; each collection of the oldest generation walks them all. `SamplingParams(flat_logprobs=True)`
keeps them in a few arrays instead (`engine.FlatLogprobs`). This scores the same prompts both ways, alternately, on
a small random Llama (the collector's cost does not depend on the model), and reports the wall time and the time
spent in collections.

    python benchmarks/scoring_gc.py [--prompts 1024] [--prompt-len 400] [--runs 2] [--device cpu]
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=400)
    parser.add_argument("--runs", type=int, default=2, help="runs of each record kind, alternating")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    model = make_tiny_model(Path(tempfile.mkdtemp()) / "model")
    llm = LLM(str(model), dtype="float32", device=args.device, max_model_len=512, max_num_seqs=128,
              max_num_batched_tokens=8192)
    ids = torch.randint(10, 370, (args.prompts, args.prompt_len), generator=torch.Generator().manual_seed(0))
    prompts = [{"prompt_token_ids": p} for p in ids.tolist()]
    pauses: list[tuple[int, float]] = []
    began = [0.0]

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - began[0]))

    gc.callbacks.append(note)
    print("| records | wall s | collections s | oldest generation s (collections) |")
    print("|---|---|---|---|")
    for flat in [False, True] * args.runs:
        gc.collect()
        pauses.clear()
        start = time.perf_counter()
        outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1, flat_logprobs=flat),
                               use_tqdm=False)
        wall = time.perf_counter() - start
        oldest = [seconds for generation, seconds in pauses if generation == 2]
        print(f"| {'flat' if flat else 'list'} | {wall:.2f} | {sum(s for _, s in pauses):.2f} | "
              f"{sum(oldest):.2f} ({len(oldest)}) |", flush=True)
        del outputs
    gc.callbacks.remove(note)


if __name__ == "__main__":
    main()
