"""Host time of launching an eager mixed step (prefill rows beside decode rows) and where it goes.

    python3 benchmarks/mixed_step.py --device cuda                  # Llama-3-8B shapes, bf16 (H200)
    python3 benchmarks/mixed_step.py --device cpu --shape tiny      # a smoke run of the code

Steps admitting a few prompts cannot replay a decode graph. Run eagerly (`--modes full_decode_only`),
they launch the whole forward from Python, and when the prefill is small that launch, not the GPU, sets
the step's length; with piecewise graphs (`full_and_piecewise`, the default) they replay a graph between
attentions. For each mode this builds an engine with LoRA (64 random rank-16 adapters, 32 decode
sequences on them), then times `ModelRunner.execute` (the launch, no sync) and the whole step for steps
that admit `--admit` new prompts of `--prompt-len` tokens each, and profiles one such launch by own time.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.host_overhead import NUM_ADAPTERS, Setup, build_engine, llama3_8b_setup, tiny_setup  # noqa: E402
from benchmarks.serving import finish_prefills  # noqa: E402
from engine import LLMEngine, LoRARequest, SamplingParams  # noqa: E402
from engine.config import CUDAGRAPH_MODES  # noqa: E402


def add(engine: LLMEngine, setup: Setup, first: int, count: int, prompt_len: int, max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    vocab = engine.hf_config.vocab_size
    for i in range(first, first + count):
        adapter = i % NUM_ADAPTERS
        prompt = [(i * 7 + j * 13) % vocab for j in range(prompt_len)]
        engine.add_request(prompt, params, LoRARequest(f"adapter{adapter}", adapter + 1, str(setup.adapters[adapter])))


class LaunchTimer:
    """Wall time of each `execute` call: the launch, which waits for nothing on a GPU."""

    def __init__(self, engine: LLMEngine, profile: bool):
        self.engine, self.launches, self.profiler = engine, [], cProfile.Profile() if profile else None
        self.execute = engine.runner.execute
        engine.runner.execute = self

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        if self.profiler is not None:
            out = self.profiler.runcall(self.execute, *args, **kwargs)
        else:
            out = self.execute(*args, **kwargs)
        self.launches.append(time.perf_counter() - t)
        return out

    def remove(self) -> None:
        self.engine.runner.__dict__.pop("execute", None)


def mixed_steps(engine: LLMEngine, setup: Setup, steps: int, admit: int, prompt_len: int, profile: bool) -> dict:
    """Each step admits `admit` prompts beside the running decode rows; returns launch and step times."""
    walls, launches, timer = [], [], None
    first = 10_000
    for s in range(steps):
        add(engine, setup, first + s * admit, admit, prompt_len, max_tokens=4)
        timer = LaunchTimer(engine, profile and s == steps - 1)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
        launches.append(sum(timer.launches))
        timer.remove()
    result = dict(admit=admit, prompt_len=prompt_len, launch_ms=1e3 * statistics.median(launches),
                  step_ms=1e3 * statistics.median(walls))
    if timer is not None and timer.profiler is not None:
        result["profile"] = top_functions(timer.profiler)
    return result


def top_functions(profiler: cProfile.Profile, top: int = 30, key: str = "tottime_ms") -> list[dict]:
    """The `top` functions by `key` (tottime_ms: own time; cumtime_ms: with callees, which shows phases)."""
    stats = pstats.Stats(profiler).stats
    rows = [{"function": pstats.func_std_string(func), "calls": calls, "tottime_ms": 1e3 * tottime,
             "cumtime_ms": 1e3 * cumtime} for func, (_, calls, tottime, cumtime, _) in stats.items()]
    rows.sort(key=lambda row: -row[key])
    return rows[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=["tiny", "llama3-8b"], default="llama3-8b")
    parser.add_argument("--decode", type=int, default=32, help="running decode sequences")
    parser.add_argument("--admit", type=int, nargs="+", default=[1, 4], help="prompts admitted per mixed step")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--modes", nargs="+", choices=CUDAGRAPH_MODES, default=list(CUDAGRAPH_MODES),
                        help="EngineConfig.cudagraph_mode values to measure, one engine each")
    parser.add_argument("--profile-build", action="store_true",
                        help="profile each engine build (cProfile) and report its slowest calls with their callees")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        setup = tiny_setup(workdir, args.device) if args.shape == "tiny" else \
            llama3_8b_setup(workdir, args.device, args.prompt_len)
        setup.max_model_len, setup.prompt_len = 2048, args.prompt_len
        for mode in args.modes:
            profiler = cProfile.Profile() if args.profile_build else None
            t = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            engine = build_engine(setup, batch=args.decode + max(args.admit) * args.steps, lora=True,
                                  steps=args.steps * len(args.admit) + 8, cudagraph_mode=mode)
            built = dict(mode=mode, build_s=time.perf_counter() - t)
            if profiler is not None:
                profiler.disable()
                built["build_profile"] = top_functions(profiler, top=40, key="cumtime_ms")
                for row in built["build_profile"][:30]:
                    print(f"  build {row['cumtime_ms']:9.1f} {row['tottime_ms']:9.1f} {row['calls']:7d}  {row['function']}")
            if torch.cuda.is_available():
                built["reserved_gib"] = torch.cuda.memory_reserved() / 2**30
            results.append(built)
            print(f"{ {k: v for k, v in built.items() if k != 'build_profile'} }", flush=True)
            add(engine, setup, 0, args.decode, args.prompt_len, max_tokens=args.steps * len(args.admit) * 2 + 16)
            finish_prefills(engine)
            for admit in args.admit:
                mixed_steps(engine, setup, 2, admit, args.prompt_len, profile=False)  # warm: compiles, slot loads
                r = dict(mode=mode) | mixed_steps(engine, setup, args.steps, admit, args.prompt_len, profile=True)
                results.append(r)
                print(f"{mode}: admit {admit} x {args.prompt_len} beside ~{args.decode} decode rows: launch "
                      f"{r['launch_ms']:.2f} ms, step {r['step_ms']:.2f} ms", flush=True)
                for row in r["profile"][:12]:
                    print(f"  {row['tottime_ms']:8.2f} {row['cumtime_ms']:8.2f} {row['calls']:6d}  {row['function']}")
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                       indent=1))


if __name__ == "__main__":
    main()
