"""Workload (c) against (a) for each value of an engine switch, in one process on one device: (a) once, then (c)
once per value in the order given (repeat values for A B A B). A switch read when an engine is built (an
environment variable such as LORASERVE_LORA_SIDE_CARVEOUT, read at graph capture) is then compared without the
spread between machines, which is larger than the effects measured. The workloads are `serving.py`'s offline ones.

    python3 benchmarks/switch_ab.py --switch LORASERVE_LORA_SIDE_CARVEOUT --values 0 8 0 8 --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_identity import gpu_identity  # noqa: E402
from benchmarks.serving import (  # noqa: E402
    SHAPES, build_engine, build_lora_engine, lora_requests, make_adapters, make_model_dir, offline, prompts,
    release_gpu_memory, warm_up,
)
from engine.config import CUDAGRAPH_MODES  # noqa: E402
from engine.scheduler import ADMISSION_ORDERS  # noqa: E402


@contextmanager
def environment_value(name: str, value: str) -> Iterator[None]:
    """`name` set to `value` inside; after, as it was before (unset if it was)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--switch", required=True, help="the environment variable set before each (c) engine is built")
    parser.add_argument("--values", nargs="+", required=True, help="its values, one (c) run each, in this order")
    parser.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    parser.add_argument("--adapters", type=int, default=64, help="distinct adapters of (c), one request in turn each")
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    parser.add_argument("--admission-order", choices=ADMISSION_ORDERS, default="balanced",
                        help="as serving.py's offline workloads (balanced, the offline LLM's); fcfs puts "
                             "min(adapters, max-num-seqs) distinct adapters in every full batch")
    parser.add_argument("--cudagraph-mode", choices=CUDAGRAPH_MODES, default="full_and_piecewise")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--work", default="/tmp/loraserve-bench")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args(argv)
    args.freeze_heap = True  # as serving.py is run for BENCHMARKS.md, and as `loraserve serve` does
    args.max_lora_rank = 16  # the adapters' rank
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    model_dir = make_model_dir(work, args.shape)
    paths = make_adapters(work / f"adapters-{args.shape}", model_dir, args.shape, args.adapters,
                          min(args.adapters, 16))
    batch = prompts(args.num_requests, args.prompt_len, SHAPES[args.shape]["vocab_size"])
    results: dict = {"config": {k: str(v) for k, v in vars(args).items()},
                     "gpu": gpu_identity() if args.device == "cuda" else {}, "runs": []}

    def record(label: str, run: dict) -> None:
        results["runs"].append({"label": label, **run})
        (args.out / "switch_ab.json").write_text(json.dumps(results, indent=1, default=str))
        print(f"{label}: {run['tok_per_s']:.1f} tok/s, median decode step {run['median_decode_step_ms']:.3f} ms",
              flush=True)

    engine = build_engine(model_dir, args)
    warm_up(engine, batch, [None], args)
    base = offline(engine, batch, [None] * len(batch), args.output_len)
    record("a", base)
    del engine
    release_gpu_memory()
    requests = lora_requests(paths)
    for value in args.values:
        with environment_value(args.switch, value):  # through the run: some switches are read at each step
            engine = build_lora_engine(model_dir, args, args.adapters)
            for request in requests:
                engine.lora_manager.add(request)
            warm_up(engine, batch, requests[:8], args)
            run = offline(engine, batch, [requests[i % len(requests)] for i in range(len(batch))], args.output_len)
        run["c_over_a"] = run["tok_per_s"] / base["tok_per_s"]
        record(f"c {args.switch}={value}", run)
        del engine
        release_gpu_memory()
    return results


if __name__ == "__main__":
    main()
