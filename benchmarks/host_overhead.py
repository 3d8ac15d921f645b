"""Host (Python) time of one engine decode step: what the device waits on between forwards.

    python -m benchmarks.host_overhead [--device cpu|cuda] [--batches 64 256] [--steps 50] [--out FILE]

Builds an engine on a tiny random Llama (tests.tiny_models), with and without LoRA (64 slots, 64
random peft adapters, request i on adapter i % 64), adds `batch` greedy requests (ignore_eos,
fixed lengths), steps until every sequence decodes, then times --steps decode steps. The model's
forward, CUDA-graph replays and compute_logits are timed apart (perf_counter on the CPU, CUDA
events on a GPU); host time is the step's wall time minus theirs. A second, profiled run prints
the top functions by own time, counting only calls made outside the model.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from tests.tiny_models import make_peft_adapter, make_tiny_model

PROMPT_LEN = 8
NUM_ADAPTERS = 64
MAX_MODEL_LEN = 8192  # Llama-3-8B's: sets the width of the CUDA graphs' block tables
# code whose own time is the model's forward (or the replay of one), not the engine's host work
MODEL_FILES = ("engine/model.py", "kernels/", "torch/nn/", "torch/cuda/graphs.py")


@dataclass
class Measurement:
    device: str
    batch: int
    lora: bool
    steps: int
    wall_ms: float  # median decode step
    model_ms: float  # median per step inside the forward / graph replay and compute_logits
    host_ms: float  # median of each step's wall time less its model time


class ModelTimer:
    """Time inside wrapped model calls, per step: wall on the CPU, device time (CUDA events) on a GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._steps: list[list] = []  # per step: seconds (CPU) or (start, end) event pairs (CUDA)

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if not self._steps:
                return fn(*args, **kwargs)
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*args, **kwargs)
                end.record()
                self._steps[-1].append((start, end))
                return out
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self._steps[-1].append(time.perf_counter() - start)
            return out
        return timed

    def begin_step(self) -> None:
        self._steps.append([])

    def per_step(self) -> list[float]:
        """Seconds inside the wrapped calls, per step since the first begin_step (synchronizes a GPU)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [sum(s.elapsed_time(e) for s, e in step) / 1e3 for step in self._steps]
        return [sum(step) for step in self._steps]


class _TimedGraph:
    def __init__(self, graph, timer: ModelTimer):
        self.replay = timer.wrap(graph.replay)


def instrument(engine: LLMEngine) -> ModelTimer:
    """Routes the model's forward, compute_logits and graph replays through one timer."""
    timer = ModelTimer(engine.device)
    engine.model.forward = timer.wrap(engine.model.forward)
    engine.model.compute_logits = timer.wrap(engine.model.compute_logits)
    graphs = engine.runner.graphs
    if graphs is not None:
        graphs.graphs = {size: _TimedGraph(graph, timer) for size, graph in graphs.graphs.items()}
    return timer


def build_engine(model_dir: Path, device: str, batch: int, lora: bool, steps: int) -> LLMEngine:
    lora_args = dict(enable_lora=True, max_loras=NUM_ADAPTERS, max_cpu_loras=NUM_ADAPTERS, max_lora_rank=8) \
        if lora else {}
    blocks_per_seq = -(-(PROMPT_LEN + 2 * steps + 8) // 16)
    return LLMEngine(EngineConfig(model=str(model_dir), device=device, dtype="float32", max_num_seqs=batch,
                                  max_model_len=MAX_MODEL_LEN, num_kv_blocks=batch * blocks_per_seq, **lora_args))


def add_requests(engine: LLMEngine, batch: int, adapters: list[Path] | None, max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    vocab = engine.hf_config.vocab_size
    for i in range(batch):
        prompt = [(i * 7 + j * 13) % vocab for j in range(PROMPT_LEN)]
        lora = LoRARequest(f"adapter{i % NUM_ADAPTERS}", i % NUM_ADAPTERS + 1, str(adapters[i % NUM_ADAPTERS])) \
            if adapters else None
        engine.add_request(prompt, params, lora)


def run_steps(engine: LLMEngine, steps: int, timer: ModelTimer | None = None) -> list[float]:
    """Wall seconds of each of `steps` steps (a GPU is synchronized after each)."""
    walls = []
    for _ in range(steps):
        if timer is not None:
            timer.begin_step()
        start = time.perf_counter()
        engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    return walls


def prepare(model_dir: Path, device: str, batch: int, adapters: list[Path] | None, steps: int) -> LLMEngine:
    """An engine whose whole batch has finished prefill, warmed up by a few decode steps."""
    engine = build_engine(model_dir, device, batch, adapters is not None, steps)
    add_requests(engine, batch, adapters, max_tokens=2 * steps + 8)
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    run_steps(engine, 3)
    return engine


def measure(model_dir: Path, device: str, batch: int, adapters: list[Path] | None, steps: int) -> Measurement:
    """Medians over the steps, so that a step slowed by another process on the machine does not count."""
    engine = prepare(model_dir, device, batch, adapters, steps)
    timer = instrument(engine)
    walls = run_steps(engine, steps, timer)
    models = timer.per_step()
    return Measurement(device=str(engine.device), batch=batch, lora=adapters is not None, steps=steps,
                       wall_ms=statistics.median(walls) * 1e3, model_ms=statistics.median(models) * 1e3,
                       host_ms=statistics.median(w - m for w, m in zip(walls, models)) * 1e3)


def model_functions(stats: dict) -> set:
    """Functions in the model's files, and those only ever called from them (torch.einsum's builtin)."""
    model = {func for func in stats if any(part in func[0] for part in MODEL_FILES)}
    while True:
        more = {func for func, (*_, callers) in stats.items()
                if func not in model and callers and all(caller in model for caller in callers)}
        if not more:
            return model
        model |= more


def host_profile(model_dir: Path, device: str, batch: int, adapters: list[Path] | None, steps: int,
                 top: int = 25) -> list[dict]:
    """Per function: own time (ms per step) and calls per step, from callers outside the model."""
    engine = prepare(model_dir, device, batch, adapters, steps)
    profiler = cProfile.Profile()
    profiler.runcall(run_steps, engine, steps)
    stats = pstats.Stats(profiler).stats
    model = model_functions(stats)
    rows = []
    for func, (*_, callers) in stats.items():
        if func in model:
            continue
        host = [c for caller, c in callers.items() if caller not in model]
        own = sum(c[2] for c in host)
        if own > 0:
            rows.append({"function": pstats.func_std_string(func), "calls_per_step": sum(c[1] for c in host) / steps,
                         "tottime_ms_per_step": own / steps * 1e3})
    rows.sort(key=lambda row: -row["tottime_ms_per_step"])
    return rows[:top]


def make_adapters(model_dir: Path, workdir: Path) -> list[Path]:
    return [make_peft_adapter(model_dir, workdir / f"adapter{i}", seed=i) for i in range(NUM_ADAPTERS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile breakdown")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier timings)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_dir = make_tiny_model(workdir / "model", max_position_embeddings=MAX_MODEL_LEN)
        lora_adapters = make_adapters(model_dir, workdir)
        results, profiles = [], {}
        for batch in args.batches:
            for adapters in (None, lora_adapters):
                m = measure(model_dir, args.device, batch, adapters, args.steps)
                results.append(m)
                print(f"{m.device} batch {m.batch:4d} lora {m.lora!s:5}: wall {m.wall_ms:7.3f} ms/step, "
                      f"model {m.model_ms:7.3f}, host {m.host_ms:7.3f}", flush=True)
                if not args.no_profile:
                    key = f"batch{batch}_{'lora' if adapters else 'base'}"
                    profiles[key] = host_profile(model_dir, args.device, batch, adapters, args.steps)
                    print(f"  host functions by own time ({key}), ms/step:")
                    for row in profiles[key]:
                        print(f"    {row['tottime_ms_per_step']:7.3f}  {row['calls_per_step']:8.1f}  {row['function']}")
    if args.out:
        args.out.write_text(json.dumps({"results": [asdict(m) for m in results], "profiles": profiles}, indent=1))


if __name__ == "__main__":
    main()
