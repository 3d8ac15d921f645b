"""Where the GPU idles between the kernels of steady decode steps in the engine.

    python3 benchmarks/step_gaps.py [--batch 64] [--lora] [--out DIR]

A decode step's wall time exceeds the GPU time of its parts (graph replay, LM head, greedy choice) by
a few percent. This runs the engine's own decode steps back to back (async scheduling, as in serving)
under the torch profiler and reads the device timeline: busy time per step, the idle gaps between
consecutive device operations, and which operation pairs the idle time sits between.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving import (  # noqa: E402
    SHAPES, build_engine, build_lora_engine, finish_prefills, lora_requests, make_adapters, make_model_dir, prompts,
)
from engine import SamplingParams  # noqa: E402

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def device_events(trace: dict) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every device operation in a chrome trace, in start order."""
    events = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace["traceEvents"]
              if e.get("cat") in DEVICE_CATEGORIES and "dur" in e]
    return sorted(events)


def gaps_report(events: list[tuple[float, float, str]], steps: int, top: int = 12) -> dict:
    span = events[-1][1] - events[0][0]
    busy, idle_by_pair, end, previous = 0.0, collections.Counter(), events[0][0], None
    for start, stop, name in events:
        if start > end and previous is not None:
            idle_by_pair[(previous[:60], name[:60])] += start - end
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, previous = stop, name
    return dict(steps=steps, span_us_per_step=span / steps, busy_us_per_step=busy / steps,
                idle_us_per_step=(span - busy) / steps,
                top_idle=[dict(after=a, before=b, us_per_step=us / steps)
                          for (a, b), us in idle_by_pair.most_common(top)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lora", action="store_true", help="64 adapters, request i on adapter i % 64")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--work", default="/tmp/loraserve-bench")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.output_len, args.max_num_seqs, args.max_batched_tokens = 128, args.batch, 8192
    args.device, args.adapter_reader, args.admission_order, args.freeze_heap = "cuda", "threads", "fcfs", False
    args.max_lora_rank = 16
    shape = "llama3-8b"
    model_dir = make_model_dir(Path(args.work), shape)
    loras = [None] * args.batch
    if args.lora:
        engine = build_lora_engine(model_dir, args, 64)
        paths = make_adapters(Path(args.work) / f"adapters-{shape}", model_dir, shape, 64, 16)
        requests = lora_requests(paths[:64])
        loras = [requests[i % 64] for i in range(args.batch)]
    else:
        engine = build_engine(model_dir, args)
    params = SamplingParams(temperature=0, max_tokens=args.steps * 2 + 16, ignore_eos=True)
    for prompt, lora in zip(prompts(args.batch, args.prompt_len, SHAPES[shape]["vocab_size"], seed=7), loras):
        engine.add_request(prompt, params, lora)
    finish_prefills(engine)
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    report = gaps_report(device_events(trace), args.steps)
    report.update(batch=args.batch, lora=args.lora)
    print(f"batch {args.batch} {'64 adapters' if args.lora else 'base'}: span {report['span_us_per_step']:.0f} us "
          f"a step, busy {report['busy_us_per_step']:.0f}, idle {report['idle_us_per_step']:.0f}")
    for row in report["top_idle"]:
        print(f"  {row['us_per_step']:7.1f} us/step idle after {row['after']} before {row['before']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"step_gaps_b{args.batch}_{'lora' if args.lora else 'base'}.json"
        (args.out / name).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
