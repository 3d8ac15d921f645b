"""CPU cost of `check_adapter`, the validation a request's first use of an adapter pays in `add_request`.

    python benchmarks/adapter_check.py                 # 8 Llama-3-8B-shaped rank-16 adapters, ms per check
    python benchmarks/adapter_check.py --profile       # plus a cProfile top-15 by own time

The adapters are the serving benchmark's (`serving.make_adapters`): peft directories of rank 16 on all
7 projections of 32 layers (448 tensors, 84 MB in bf16), whose weight files link to `--unique` files,
checked against the model config `serving.make_model_dir` writes, as workload (d) checks them. Each
round checks every adapter once; the median is over all checks after the first (warm-up) round.

On the repository's 2-core CPU machine: 2.23-2.32 ms per check with meta tensors for the header and
the targets matched per adapter; 0.84-0.86 ms with plain header objects and the targets, plans and
key parsing cached (most of what is left is safetensors parsing the 448-entry header).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters_registry import ModelInfo, check_adapter  # noqa: E402
from benchmarks.serving import make_adapters, make_model_dir, module_shapes  # noqa: E402


def model_info(model_dir: Path, shape: str) -> ModelInfo:
    """What the engine validates against for a model of this shape (`LLMEngine.model_info`)."""
    return ModelInfo(architecture="LlamaForCausalLM", model_type="llama", name_or_path=str(model_dir),
                     module_shapes=module_shapes(shape), max_lora_rank=64)


def time_checks(paths: list[Path], model: ModelInfo, rounds: int) -> list[float]:
    """Seconds per check, for every adapter in every round after a warm-up round."""
    for path in paths:
        check_adapter(path, model)
    times = []
    for _ in range(rounds):
        for path in paths:
            start = time.perf_counter()
            check_adapter(path, model)
            times.append(time.perf_counter() - start)
    return times


def profile_checks(paths: list[Path], model: ModelInfo, rounds: int, top: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(rounds):
        for path in paths:
            check_adapter(path, model)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--unique", type=int, default=1, help="distinct weight files the adapters link to")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--work", default="/tmp/loraserve-adapter-check",
                        help="where the model config and adapters are written (kept between runs)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    work = Path(args.work)
    model_dir = make_model_dir(work, args.shape)
    paths = make_adapters(work / f"adapters-{args.shape}", model_dir, args.shape, args.adapters, args.unique)
    model = model_info(model_dir, args.shape)
    times = time_checks(paths, model, args.rounds)
    print(f"check_adapter, {len(paths)} {args.shape} adapters x {args.rounds} rounds: "
          f"median {1e3 * statistics.median(times):.2f} ms, min {1e3 * min(times):.2f} ms, "
          f"max {1e3 * max(times):.2f} ms per check")
    if args.profile:
        print(profile_checks(paths, model, args.rounds, top=15))


if __name__ == "__main__":
    main()
