"""Decode-step time against its bytes floor on the GPU, for the base model and for rows spread over 64 (or
other counts of) adapters, at a few batch sizes: the wall time of steps back to back, the GPU time of their parts, and how long the host
waits for the GPU. A shorter companion of `serving.py` for comparing decode-path changes. Each row names the
LoRA folds its graph handed to the fused ops' tiled variants; `LORASERVE_LORA_DECODE_TILES=0` measures the steps
without them.

    python3 benchmarks/decode_step.py --out DIR
    python3 benchmarks/decode_step.py --switch LORASERVE_LORA_SIDE_CARVEOUT --values 4 8 4 8 --out DIR

With `--switch`, each case runs once per value on an engine built (and run) under it, in the order given: an A/B
of a switch read at graph capture, in one process on one device.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_identity import gpu_identity  # noqa: E402
from benchmarks.hbm import measure_bandwidth  # noqa: E402
from benchmarks.serving import (  # noqa: E402
    SHAPES, build_engine, build_lora_engine, bytes_floor_ms, decode_step_profile, lora_requests, make_adapters,
    make_model_dir, release_gpu_memory,
)
from benchmarks.switch_ab import environment_value  # noqa: E402
from engine.config import CUDAGRAPH_MODES  # noqa: E402
from kernels import lora_tuning  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--work", default="/tmp/loraserve-bench")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--cases", nargs="+", choices=("base", "lora"), default=["base", "lora"])
    parser.add_argument("--adapters", type=int, nargs="+", default=[64],
                        help="distinct adapters the rows of the lora case are spread over (0..64; 0: every row on the base "
                             "model, in the LoRA engine), one run each")
    parser.add_argument("--adapter-rank", type=int, default=16, help="the adapters' rank")
    parser.add_argument("--max-lora-rank", type=int, default=16,
                        help="the engine's slot rank: adapters of a lower rank sit in slots padded up to it")
    parser.add_argument("--cudagraph-mode", choices=CUDAGRAPH_MODES, default="full_and_piecewise",
                        help="full_decode_only builds the engines faster; decode steps replay the same graphs")
    parser.add_argument("--profile", action="store_true",
                        help="write each row's kernels by GPU time (one engine step) to DIR/profile_*.txt")
    parser.add_argument("--freeze-heap", action="store_true",
                        help="freeze each engine's start-up heap out of the collector's reach, as the server does")
    parser.add_argument("--switch", help="an environment variable each case's engine is built and run under, once per "
                                             "--values value")
    parser.add_argument("--values", nargs="+", default=[], help="the switch's values, in this order")
    parser.add_argument("--segments-from", type=int, nargs=2, metavar=("SPREAD", "SHARED"),
                        help="decode graphs run the LoRA kernels in segments from this many rows at every rank, when the "
                             "rows are spread over many adapters and when they share few (lora_tuning.SEGMENTS_FROM "
                             "otherwise; LORASERVE_LORA_DECODE_SEGMENTS=0 turns them off)")
    parser.add_argument("--sgmv-min-tokens", type=int,
                        help="decode graphs of this many rows and more take the segment path by their size "
                             "(lora_tuning.SGMV_MIN_TOKENS otherwise); below it, --segments-from still decides")
    args = parser.parse_args(argv)
    if bool(args.switch) != bool(args.values):
        parser.error("--switch and --values go together")
    if args.sgmv_min_tokens is not None:
        lora_tuning.SGMV_MIN_TOKENS = args.sgmv_min_tokens
    if args.segments_from is not None:
        lora_tuning.SEGMENTS_FROM = dict.fromkeys(lora_tuning.SEGMENTS_FROM, lora_tuning.SegmentsFrom(*args.segments_from))
    args.output_len, args.max_num_seqs, args.max_batched_tokens = 128, max(args.batches), 8192
    args.device, args.adapter_reader, args.admission_order = "cuda", "threads", "fcfs"
    args.out.mkdir(parents=True, exist_ok=True)
    vocab = SHAPES[args.shape]["vocab_size"]
    model_dir = make_model_dir(Path(args.work), args.shape)
    rank_suffix = "" if args.adapter_rank == 16 else f"-r{args.adapter_rank}"
    count = max(args.adapters)
    paths = make_adapters(Path(args.work) / f"adapters-{args.shape}{rank_suffix}", model_dir, args.shape, count,
                          min(count, 16), rank=args.adapter_rank)
    bandwidth = measure_bandwidth("cuda")
    results: dict = {"gpu": gpu_identity(), "bandwidth_tbs": bandwidth / 1e12,
                     "decode_tiles": lora_tuning.decode_tiles(),
                     "sgmv_min_tokens": lora_tuning.SGMV_MIN_TOKENS,
                     "segments_from": {rank: vars(start) for rank, start in lora_tuning.SEGMENTS_FROM.items()},
                     "adapter_rank": args.adapter_rank, "max_lora_rank": args.max_lora_rank, "rows": []}

    def measure(label: str, engine, loras_for) -> None:
        for batch in args.batches:
            t = time.perf_counter()
            loras = loras_for(batch)
            # a first run warms the step as serving's runs do (first replays, the sampler's first calls); its
            # figures are dropped
            decode_step_profile(engine, batch, args.prompt_len, loras, vocab)
            name = re.sub("[^A-Za-z0-9]+", "_", label)  # names `device` brings back
            profile_to = args.out / f"profile_{name}_b{batch}.txt" if args.profile else None
            row = decode_step_profile(engine, batch, args.prompt_len, loras, vocab, profile_to)
            distinct = len({lora.lora_int_id for lora in loras if lora is not None})
            row["floor_ms"] = bytes_floor_ms(engine, batch, args.prompt_len + 32, distinct, bandwidth,
                                             rank=args.adapter_rank)
            row["over_floor"] = row["step_wall_ms"] / row["floor_ms"]
            row["case"] = label
            results["rows"].append(row)
            print(f"{label:12} b{batch:<4} wall {row['step_wall_ms']:.2f} ms  graph {row['graph_replay_ms']:.2f}  "
                  f"head+greedy {row['lm_head_and_greedy_ms']:.2f}  host waits {row['host_wait_ms']:.2f}  "
                  f"floor {row['floor_ms']:.2f}  x{row['over_floor']:.3f}  tiled {','.join(row['tiled_folds']) or '-'}  "
                  f"rank width {row['rank_width'] or '-'}  {'segments' if row['segments'] else 'per token'}  "
                  f"({time.perf_counter() - t:.0f} s)", flush=True)
            (args.out / "decode_step.json").write_text(json.dumps(results, indent=1))

    requests = lora_requests(paths)
    for value in args.values or [None]:
        switched = environment_value(args.switch, value) if args.switch else nullcontext()
        suffix = f" {args.switch}={value}" if args.switch else ""
        with switched:
            if "base" in args.cases:
                engine = build_engine(model_dir, args)
                measure(f"base{suffix}", engine, lambda b: [None] * b)
                del engine
                release_gpu_memory()
            if "lora" in args.cases:
                engine = build_lora_engine(model_dir, args, 64)
                for request in requests:
                    engine.lora_manager.add(request)
                for count in args.adapters:  # 0: base-model rows on the LoRA engine
                    measure(f"{count} adapters{suffix}", engine,
                            lambda b, count=count: [requests[i % count] if count else None for i in range(b)])
                del engine
                release_gpu_memory()
    return results


if __name__ == "__main__":
    main()
