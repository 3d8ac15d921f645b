"""Host (Python) time of one engine decode step: what the device waits on between forwards.

    python -m benchmarks.host_overhead [--device cpu|cuda] [--shape tiny|llama3-8b] [--max-model-len 8192]
                                       [--batches 64 256] [--steps 50] [--async-scheduling off|on|both]
                                       [--no-profile] [--out FILE]

Builds an engine on a tiny random Llama (tests.tiny_models; or Llama-3-8B's shapes with random
weights, for a GPU), with and without LoRA (64 slots, 64 random peft adapters, request i on
adapter i % 64), adds `batch` greedy requests (ignore_eos, fixed lengths), steps until every
sequence decodes, then times --steps decode steps. The model's
forward, CUDA-graph replays and compute_logits are timed apart (perf_counter on the CPU, CUDA
events on a GPU); host time is the step's wall time minus theirs (all medians over the steps).
Exposed time is the host work before the step's first model call plus that after its sampling
returned: the device idles through it however long the forward takes (the rest of the host work
can run while a big enough model computes). A second, profiled run prints the top functions by
own time, counting only calls made outside the model.

With async scheduling (on the CPU: its eager form, the same engine code without any overlap) a step
launches the next forward before reading the previous one's tokens, so steps are not synchronized
one by one: wall is the step's own time in the steady pipeline, and exposed is wall less model time,
what the device waits for per step.
"""
from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks.serving import finish_prefills, make_adapters, make_model_dir
from engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from tests.tiny_models import make_peft_adapter, make_tiny_model

NUM_ADAPTERS = 64
MAX_POSITIONS = 8192  # Llama-3-8B's
# code whose own time is the model's forward (or the replay of one), not the engine's host work
MODEL_FILES = ("engine/model.py", "kernels/", "torch/nn/", "torch/cuda/graphs.py")


@dataclass
class Measurement:
    device: str
    batch: int
    lora: bool
    steps: int
    async_scheduling: bool
    wall_ms: float  # median decode step
    model_ms: float  # median per step inside the forward / graph replay and compute_logits
    host_ms: float  # median of each step's wall time less its model time
    # median of (step start -> first model call) + (sampler's return -> step end): host work that
    # a device idles through whatever the model's size (the rest can overlap a long enough forward)
    exposed_ms: float


@dataclass
class StepTimes:
    start: float
    model: list = field(default_factory=list)  # seconds (CPU) or (start, end) CUDA event pairs
    first_model_call: float | None = None
    sampled: float | None = None  # when the last sampling call returned
    end: float | None = None


class StepTimer:
    """Per step: time inside wrapped model calls (wall on the CPU, CUDA events on a GPU), and when the
    first model call began and the sampler returned."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.steps: list[StepTimes] = []

    def wrap_model(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if not self.steps:
                return fn(*args, **kwargs)
            step = self.steps[-1]
            now = time.perf_counter()
            if step.first_model_call is None:
                step.first_model_call = now
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*args, **kwargs)
                end.record()
                step.model.append((start, end))
                return out
            out = fn(*args, **kwargs)
            step.model.append(time.perf_counter() - now)
            return out
        return timed

    def wrap_sampling(self, fn: Callable) -> Callable:
        def stamped(*args, **kwargs):
            out = fn(*args, **kwargs)
            if self.steps:
                self.steps[-1].sampled = time.perf_counter()
            return out
        return stamped

    def begin_step(self) -> None:
        self.steps.append(StepTimes(start=time.perf_counter()))

    def end_step(self) -> None:
        self.steps[-1].end = time.perf_counter()

    def measurement(self, device: str, batch: int, lora: bool, overlapped: bool) -> Measurement:
        """Medians over the steps, so that a step slowed by another process on the machine does not count.
        overlapped: async scheduling, where the device waits per step for wall less model time."""
        if self.cuda:
            torch.cuda.synchronize()
            models = [sum(s.elapsed_time(e) for s, e in step.model) / 1e3 for step in self.steps]
        else:
            models = [sum(step.model) for step in self.steps]
        walls = [step.end - step.start for step in self.steps]
        if overlapped:
            exposed = [max(0.0, w - m) for w, m in zip(walls, models)]
        else:
            exposed = [(step.first_model_call - step.start) + (step.end - step.sampled) for step in self.steps]
        return Measurement(device=device, batch=batch, lora=lora, steps=len(self.steps),
                           async_scheduling=overlapped, wall_ms=_median_ms(walls),
                           model_ms=_median_ms(models), host_ms=_median_ms(w - m for w, m in zip(walls, models)),
                           exposed_ms=_median_ms(exposed))


def _median_ms(seconds) -> float:
    return statistics.median(seconds) * 1e3


class _TimedGraph:
    def __init__(self, graph, timer: StepTimer):
        self.replay = timer.wrap_model(graph.replay)


class _StampedSampler:
    """The engine's sampler, noting when each of its public methods returns (its .tolist() waited for
    the device)."""

    def __init__(self, sampler, timer: StepTimer):
        self._sampler, self._timer = sampler, timer

    def __call__(self, *args, **kwargs):
        return self._timer.wrap_sampling(self._sampler)(*args, **kwargs)

    def __getattr__(self, name: str):
        attr = getattr(self._sampler, name)
        return self._timer.wrap_sampling(attr) if callable(attr) and not name.startswith("_") else attr


def instrument(engine: LLMEngine) -> StepTimer:
    """Routes the model's forward, compute_logits, graph replays and the sampler through one timer."""
    timer = StepTimer(engine.device)
    engine.model.forward = timer.wrap_model(engine.model.forward)
    engine.model.compute_logits = timer.wrap_model(engine.model.compute_logits)
    graphs = engine.runner.graphs
    if graphs is not None:
        graphs.graphs = {key: _TimedGraph(graph, timer) for key, graph in graphs.graphs.items()}
    engine.sampler = _StampedSampler(engine.sampler, timer)
    return timer


@dataclass
class Setup:
    """The model and adapters on disk, and how the engine runs them."""

    model_dir: Path
    adapters: list[Path]
    device: str
    dtype: str
    load_format: str
    max_lora_rank: int
    prompt_len: int
    max_model_len: int = MAX_POSITIONS  # sets the width of the CUDA graphs' block tables
    async_scheduling: bool = False


def build_engine(setup: Setup, batch: int, lora: bool, steps: int, **overrides) -> LLMEngine:
    lora_args = {"enable_lora": True, "max_loras": NUM_ADAPTERS, "max_cpu_loras": NUM_ADAPTERS,
                 "max_lora_rank": setup.max_lora_rank} if lora else {}
    blocks_per_seq = -(-(setup.prompt_len + 2 * steps + 8) // 16)
    return LLMEngine(EngineConfig(model=str(setup.model_dir), device=setup.device, dtype=setup.dtype,
                                  load_format=setup.load_format, max_num_seqs=batch, max_model_len=setup.max_model_len,
                                  num_kv_blocks=batch * blocks_per_seq, async_scheduling=setup.async_scheduling,
                                  async_scheduling_eager=setup.async_scheduling and setup.device == "cpu",
                                  **lora_args, **overrides))


def add_requests(engine: LLMEngine, batch: int, adapters: list[Path] | None, prompt_len: int, max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    vocab = engine.hf_config.vocab_size
    for i in range(batch):
        prompt = [(i * 7 + j * 13) % vocab for j in range(prompt_len)]
        lora = LoRARequest(f"adapter{i % NUM_ADAPTERS}", i % NUM_ADAPTERS + 1, str(adapters[i % NUM_ADAPTERS])) \
            if adapters else None
        engine.add_request(prompt, params, lora)


def run_steps(engine: LLMEngine, steps: int, timer: StepTimer | None = None) -> None:
    """`steps` engine steps; a GPU is synchronized after each (the step's sampling already waited for it),
    except with async scheduling, whose steps overlap by design."""
    sync = engine.device.type == "cuda" and not engine.async_scheduling
    for _ in range(steps):
        if timer is not None:
            timer.begin_step()
        engine.step()
        if sync:
            torch.cuda.synchronize()
        if timer is not None:
            timer.end_step()


def prepare(setup: Setup, batch: int, lora: bool, steps: int) -> LLMEngine:
    """An engine whose whole batch has finished prefill, warmed up by a few decode steps."""
    engine = build_engine(setup, batch, lora, steps)
    add_requests(engine, batch, setup.adapters if lora else None, setup.prompt_len, max_tokens=2 * steps + 8)
    finish_prefills(engine)
    run_steps(engine, 3)
    return engine


def measure(setup: Setup, batch: int, lora: bool, steps: int) -> Measurement:
    engine = prepare(setup, batch, lora, steps)
    timer = instrument(engine)
    run_steps(engine, steps, timer)
    return timer.measurement(str(engine.device), batch, lora, engine.async_scheduling)


def model_functions(stats: dict) -> set:
    """Functions in the model's files, and those only ever called from them (torch.einsum's builtin)."""
    model = {func for func in stats if any(part in func[0] for part in MODEL_FILES)}
    while True:
        more = {func for func, (*_, callers) in stats.items()
                if func not in model and callers and all(caller in model for caller in callers)}
        if not more:
            return model
        model |= more


def host_profile(setup: Setup, batch: int, lora: bool, steps: int, top: int = 25) -> list[dict]:
    """Per function: own time (ms per step) and calls per step, from callers outside the model."""
    engine = prepare(setup, batch, lora, steps)
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


def tiny_setup(workdir: Path, device: str) -> Setup:
    """A 2-layer random Llama, and 64 random peft adapters of rank 8 on every projection."""
    model_dir = make_tiny_model(workdir / "model", max_position_embeddings=MAX_POSITIONS)
    adapters = [make_peft_adapter(model_dir, workdir / f"adapter{i}", seed=i) for i in range(NUM_ADAPTERS)]
    return Setup(model_dir, adapters, device, dtype="float32", load_format="auto", max_lora_rank=8, prompt_len=8)


def llama3_8b_setup(workdir: Path, device: str, prompt_len: int) -> Setup:
    """Llama-3-8B's shapes with random weights in bfloat16, and 64 adapters of rank 16 (serving.py's)."""
    model_dir = make_model_dir(workdir, "llama3-8b")
    adapters = make_adapters(workdir / "adapters", model_dir, "llama3-8b", NUM_ADAPTERS, unique=4)
    return Setup(model_dir, adapters, device, dtype="bfloat16", load_format="dummy", max_lora_rank=16,
                 prompt_len=prompt_len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=["tiny", "llama3-8b"], default="tiny",
                        help="llama3-8b: real shapes, random bf16 weights (for a GPU)")
    parser.add_argument("--prompt-len", type=int, default=512, help="llama3-8b only (tiny: 8 tokens)")
    parser.add_argument("--max-model-len", type=int, default=MAX_POSITIONS)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--async-scheduling", choices=["off", "on", "both"], default="both",
                        help="measure with async scheduling off, on, or each")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile breakdown")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier timings)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        setup = tiny_setup(workdir, args.device) if args.shape == "tiny" else \
            llama3_8b_setup(workdir, args.device, args.prompt_len)
        setup.max_model_len = args.max_model_len
        results, profiles = [], {}
        modes = {"off": [False], "on": [True], "both": [False, True]}[args.async_scheduling]
        for batch, lora, overlapped in itertools.product(args.batches, (False, True), modes):
            setup.async_scheduling = overlapped
            m = measure(setup, batch, lora, args.steps)
            results.append(m)
            print(f"{m.device} batch {m.batch:4d} lora {m.lora!s:5} async {m.async_scheduling!s:5}: "
                  f"wall {m.wall_ms:7.3f} ms/step, model {m.model_ms:7.3f}, host {m.host_ms:7.3f}, "
                  f"exposed {m.exposed_ms:7.3f}", flush=True)
            if not args.no_profile:
                key = f"batch{batch}_{'lora' if lora else 'base'}{'_async' if overlapped else ''}"
                profiles[key] = host_profile(setup, batch, lora, args.steps)
                print(f"  host functions by own time ({key}), ms/step:")
                for row in profiles[key]:
                    print(f"    {row['tottime_ms_per_step']:7.3f}  {row['calls_per_step']:8.1f}  {row['function']}")
    if args.out:
        args.out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()},
                                        "results": [asdict(m) for m in results], "profiles": profiles}, indent=1))


if __name__ == "__main__":
    main()
