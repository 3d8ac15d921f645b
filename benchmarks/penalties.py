"""Where the sampler's time goes with penalties and logprobs, part by part, at Llama-3's vocabulary.

Serving's (a) with repetition, frequency and presence penalties, top-p and `logprobs=1` took 21 ms a decode step on
the H200 against 8.6 ms for top-p alone (BENCHMARKS.md, twenty-fifth session). This times, on one step's logits
for rows of a 512-token prompt and 64 output tokens (the prompt an int64 array, as the engine passes it): the whole
sampler with each parameter alone and all together, the logits processing, the gathering of the rows' token cells,
and the top and chosen logprobs. Each figure is the median wall time of `--repeats` calls, the device synchronized
around each.

    python benchmarks/penalties.py [--rows 32 128] [--device cuda] [--out DIR]
"""
from __future__ import annotations

import argparse
import array
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sampler import VOCAB, timed_ms  # noqa: E402
from engine.logits_processors import _token_cells, process_logits  # noqa: E402
from engine.logprobs import chosen_logprobs, requested_logprobs  # noqa: E402
from engine.sampler import Sampler  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.sampling_row import SamplingRow  # noqa: E402

PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.3)


def case(rows: int, device: torch.device, repeats: int) -> dict:
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
    raw = logits.float()
    token_ids = torch.randint(VOCAB, (rows, 576), generator=torch.Generator().manual_seed(1)).tolist()

    def sampling_rows(**params) -> list[SamplingRow]:
        sampling = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=128, **params)
        return [SamplingRow(sampling, array.array("q", ids[:512]), ids[512:]) for ids in token_ids]

    variants = dict(plain=sampling_rows(), repetition=sampling_rows(repetition_penalty=1.1),
                    frequency=sampling_rows(frequency_penalty=0.3), logprobs=sampling_rows(logprobs=1),
                    all=sampling_rows(**PENALTIES, logprobs=1))
    every = variants["all"]
    sampler = Sampler(eos_token_ids=set(), vocab_size=VOCAB)
    index = torch.arange(rows, device=device)
    chosen = raw.argmax(dim=-1)
    result = dict(rows=rows)
    for name, sampled_rows in variants.items():
        result[f"sampler_{name}_ms"] = timed_ms(lambda: sampler(logits, sampled_rows), device, repeats)
    result["sampler_all_left_in_flight_ms"] = timed_ms(lambda: sampler.pending(logits, every).result(), device,
                                                       repeats)
    for name in ("repetition", "frequency", "all"):
        result[f"process_{name}_ms"] = timed_ms(lambda: process_logits(raw, variants[name], set()), device, repeats)
    result["output_cells_ms"] = timed_ms(lambda: _token_cells(every, index, VOCAB, None, with_prompts=False),
                                         device, repeats)
    result["output_and_prompt_cells_ms"] = timed_ms(lambda: _token_cells(every, index, VOCAB, None, with_prompts=True),
                                                    device, repeats)
    result["top_logprobs_ms"] = timed_ms(lambda: requested_logprobs(raw, chosen, every), device, repeats)
    result["chosen_logprobs_ms"] = timed_ms(lambda: chosen_logprobs(raw, chosen), device, repeats)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="*", default=[32, 128])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    results = [case(rows, device, args.repeats) for rows in args.rows]
    names = [key for key in results[0] if key != "rows"]
    print("| ms | " + " | ".join(f"{r['rows']} rows" for r in results) + " |")
    print("|---|" + "---|" * len(results))
    for name in names:
        print(f"| {name.removesuffix('_ms')} | " + " | ".join(f"{r[name]:.3f}" for r in results) + " |")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "penalties.json").write_text(json.dumps(dict(device=str(device), results=results), indent=1))


if __name__ == "__main__":
    main()
