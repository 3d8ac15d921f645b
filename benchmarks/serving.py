"""Serving benchmark: base model vs many adapters, offline throughput and online latency.

    python benchmarks/serving.py --shape llama3-8b --out results/      # on the H200
    python benchmarks/serving.py --shape small --num-requests 16 --device cpu  # a smoke run of the code

No weights are downloaded: the model has random weights at the real shapes (`load_format="dummy"`)
and the adapters are random peft directories of rank 16 (`--adapter-rank`) on all 7 projections, written to disk
(adapter i of a large population is a directory whose weight file is a link to one of
`--unique-adapters` files, so a thousand adapters take the disk of a few).

Workloads: (a) base model only; (b) one adapter for every request; (c) 64 distinct adapters,
uniform; (d) 1000 registered adapters, Zipf popularity, max_loras=32. Plus a sweep of the number
of distinct adapters, online latency at a fixed request rate, the decode step against its bytes
floor, and transformers+peft with a mixed-adapter batch as the baseline. On a GPU, (a) also runs with
sequences that may end by EOS, with random sampling (temperature, top-p, penalties, logprobs), scoring its prompts
(one token and every prompt logprob), and with every step synchronous.
"""
from __future__ import annotations

import argparse
import contextlib
import asyncio
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_identity import gpu_identity  # noqa: E402
from benchmarks.hbm import measure_bandwidth  # noqa: E402

from engine import AsyncEngine, EngineConfig, LLMEngine, LoRARequest, SamplingParams  # noqa: E402
from engine.config import CUDAGRAPH_MODES  # noqa: E402
from engine.gc_heap import freeze_startup_heap  # noqa: E402
from engine.lora_manager import LoRAManager  # noqa: E402
from engine.sampler import PendingTokens  # noqa: E402
from engine.scheduler import ADMISSION_ORDERS  # noqa: E402
from kernels import lora_tuning  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                      rope_theta=500000.0),
    "small": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=2048, max_position_embeddings=2048, rope_theta=10000.0),
}
RESULTS: dict = {}


WORKLOAD_BASE, WORKLOAD_ADAPTERS, WORKLOAD_ZIPF = WORKLOADS = ("base", "adapters", "zipf")


@contextlib.contextmanager
def cpu_profile(to: Path | None):
    """Where the engine thread's time goes (top functions by own time), written to `to`."""
    if to is None:
        yield
        return
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
        to.write_text(text.getvalue())


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- model and adapters on disk -----------------------------------------------------------------
def make_model_dir(root: Path, shape: str, word_tokenizer: bool = False) -> Path:
    """config.json and a tokenizer: the tests' 384-token BPE, or with `word_tokenizer` one word per id."""
    import transformers

    from tests.tiny_models import make_tokenizer

    path = root / (f"model-{shape}-words" if word_tokenizer else f"model-{shape}")
    path.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(str(path))
    if word_tokenizer:
        make_word_tokenizer(path, SHAPES[shape]["vocab_size"])
    else:
        make_tokenizer(path)
    return path


def make_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A tokenizer with a word for every id of the model's vocabulary, so that every token the random model
    picks is text to detokenize and stream, as with a real tokenizer (with the tests' BPE, ids past its 384
    decode to nothing, and a server streams almost no text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.tiny_models import CHAT_TEMPLATE, SPECIAL_TOKENS

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    words = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[0]))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))


def module_shapes(shape: str) -> dict[str, tuple[int, int]]:
    s = SHAPES[shape]
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * head_dim
    h, inter = s["hidden_size"], s["intermediate_size"]
    per_layer = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                 "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                 "mlp.down_proj": (h, inter)}
    return {f"model.layers.{i}.{name}": shp for i in range(s["num_hidden_layers"]) for name, shp in per_layer.items()}


def make_adapters(root: Path, model_dir: Path, shape: str, total: int, unique: int, rank: int = 16) -> list[Path]:
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    config = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(PROJECTIONS), bias="none",
                  base_model_name_or_path=str(model_dir), fan_in_fan_out=False, use_rslora=False, use_dora=False)
    weight_files = []
    for u in range(unique):
        file = root / f"weights-{u}.safetensors"
        if not file.exists():
            gen = torch.Generator().manual_seed(1000 + u)
            tensors = {}
            for name, (out_f, in_f) in module_shapes(shape).items():
                key = f"base_model.model.{name}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, in_f, generator=gen) / in_f ** 0.5).bfloat16()
                tensors[f"{key}.lora_B.weight"] = (torch.randn(out_f, rank, generator=gen) * 0.01).bfloat16()
            save_file(tensors, str(file))
        weight_files.append(file)
    paths = []
    for i in range(total):
        path = root / f"adapter-{i}"
        path.mkdir(exist_ok=True)
        (path / "adapter_config.json").write_text(json.dumps(config))
        link = path / "adapter_model.safetensors"
        if not link.exists():
            link.symlink_to(weight_files[i % unique])
        paths.append(path)
    return paths


# ---- workloads ------------------------------------------------------------------------------------
def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=gen).tolist()


def zipf_choice(n: int, population: int, seed: int = 0, a: float = 1.1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, population + 1, dtype=torch.float64) ** a
    return torch.multinomial(weights, n, replacement=True, generator=gen).tolist()


PHASES = ("schedule", "launch", "sample", "read_back")


def time_phases(engine: LLMEngine) -> dict[str, float]:
    """Time spent per step, summed into the returned dict until `untime_phases`: in scheduling; in the model
    runner's `execute` (the forward's launch: no sync, so a launch as long as its step means the step was
    host-bound); in a synchronous step's sampling, which waits for its forward; and in reading back the
    step left in flight before (async scheduling), which waits for that step's forward."""
    spent: dict[str, float] = {}

    def timed(name, function):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
        return run

    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine.scheduler.schedule_decode = timed("schedule", engine.scheduler.schedule_decode)  # async decode steps
    engine.runner.execute = timed("launch", engine.runner.execute)
    engine._sample = timed("sample", engine._sample)
    engine._read_back = timed("read_back", engine._read_back)
    return spent


def untime_phases(engine: LLMEngine) -> None:
    for owner, name in ((engine.scheduler, "schedule"), (engine.scheduler, "schedule_decode"),
                        (engine.runner, "execute"), (engine, "_sample"), (engine, "_read_back")):
        owner.__dict__.pop(name, None)


@contextlib.contextmanager
def collector_pauses():
    """Each cyclic garbage collection while the block runs, as (generation, seconds). Unless `--freeze-heap`
    froze it, a collection of the oldest generation walks the whole start-up heap while every step waits."""
    pauses, began = [], []

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            began.append(time.perf_counter())
        else:
            pauses.append((info["generation"], time.perf_counter() - began.pop()))

    gc.callbacks.append(note)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(note)


@contextlib.contextmanager
def kernel_compiles(steps: list):
    """Each Triton kernel variant first launched in this process while the block runs, as (step, variant):
    after the warm-up, a compile (or a load from Triton's disk cache) that stalls the step it falls in.
    `steps` is the list the block appends a row to per step."""
    from triton import knobs

    compiles = []

    def note(**hook) -> bool:
        # the launch options, then the constexpr values (the repr's argument list is cut short in triton 3.6)
        compiles.append((len(steps), f"{hook['repr'].split('](')[0]}] {hook.get('compile', {}).get('constants')}"))
        return False  # compile as usual

    previous, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, note
    try:
        yield compiles
    finally:
        knobs.runtime.jit_cache_hook = previous


def _pause_summary(pauses: list[tuple[int, float]]) -> dict:
    oldest = [seconds for generation, seconds in pauses if generation == 2]
    return dict(gc_collections=len(pauses), gc_seconds=sum(seconds for _, seconds in pauses),
                gc_oldest_collections=len(oldest), gc_oldest_seconds=sum(oldest))


# Chat-like sampling: penalties (they read each row's tokens), top-p and logprobs
PENALTIES_AND_LOGPROBS = dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1, frequency_penalty=0.3,
                              presence_penalty=0.3, logprobs=1)


def offline(engine: LLMEngine, batch: list[list[int]], loras: list[LoRARequest | None], output_len: int,
            timeline_to: Path | None = None, **sampling) -> dict:
    """Offline throughput of one workload; `timeline_to` gets one row per step (JSON) for finding stalls.
    sampling: SamplingParams fields over greedy `ignore_eos` (ignore_eos=False: sequences may end by a token, as
    chat traffic does; the random model rarely samples one)."""
    params = SamplingParams(**{"temperature": 0, "max_tokens": output_len, "ignore_eos": True, **sampling})
    sync()
    start = time.perf_counter()
    if engine.lora_manager is not None:  # the batch's adapters checked together, as `LLM.generate` does
        engine.lora_manager.ensure_loaded(lora for lora in loras if lora is not None)
    for prompt, lora in zip(batch, loras):
        engine.add_request(prompt, params, lora)
    add_seconds = time.perf_counter() - start
    decode_walls, steady_walls, batch_sizes, timeline = [], [], [], []
    after_decode_only = False
    phases = time_phases(engine) if timeline_to is not None else {}
    before = first = engine.stats()
    suspensions = engine.scheduler.num_suspensions
    tokens = 0
    with collector_pauses() as pauses, kernel_compiles(timeline) as compiles:
        while engine.has_unfinished_requests():
            prefilled = all(s.num_computed_tokens >= s.num_prompt_tokens for s in engine.scheduler.running)
            t = time.perf_counter()
            outputs = engine.step()
            wall = time.perf_counter() - t
            tokens += sum(len(output.outputs[0].token_ids) for output in outputs if output.finished)
            after = engine.stats()
            decode_only = prefilled and after.num_waiting == before.num_waiting  # nothing admitted or preempted
            batch_sizes.append(after.num_running)
            if decode_only:
                decode_walls.append(wall)
                if after_decode_only:
                    steady_walls.append(wall)
            after_decode_only = decode_only
            timeline.append(dict(ms=round(1e3 * wall, 3), running=after.num_running, waiting=after.num_waiting,
                                 decode_only=decode_only, slot_loads=after.lora_slot_loads - before.lora_slot_loads,
                                 disk_reads=after.lora_disk_reads - before.lora_disk_reads,
                                 **{f"{name}_ms": round(1e3 * phases.pop(name, 0.0), 3) for name in PHASES}))
            before = after
    sync()
    elapsed = time.perf_counter() - start
    untime_phases(engine)
    if timeline_to is not None:
        timeline_to.write_text(json.dumps(timeline))
    return dict(seconds=elapsed, output_tokens=tokens, tok_per_s=tokens / elapsed, steps=len(timeline),
                median_decode_step_ms=1e3 * statistics.median(decode_walls) if decode_walls else None,
                add_seconds=add_seconds, mean_running=statistics.mean(batch_sizes),
                idle_steps=batch_sizes.count(0), decode_steps=len(decode_walls), decode_seconds=sum(decode_walls),
                slot_loads=before.lora_slot_loads - first.lora_slot_loads,
                disk_reads=before.lora_disk_reads - first.lora_disk_reads,
                suspensions=engine.scheduler.num_suspensions - suspensions,
                **_stalls(steady_walls), **_pause_summary(pauses), kernel_compiles=compiles)


def scoring(engine: LLMEngine, batch: list[list[int]], **sampling) -> dict:
    """The batch's prompts scored as evaluation harnesses do (one token each, every prompt token's logprob and its
    most likely alternative): offline's figures plus prompt tokens per second."""
    result = offline(engine, batch, [None] * len(batch), 1, prompt_logprobs=1, **sampling)
    return dict(result, prompt_tok_per_s=sum(map(len, batch)) / result["seconds"])


def _stalls(decode_walls: list[float]) -> dict:
    """Decode-only steps that took over twice the median: time lost to something other than decoding
    (a host-side wait, an allocation, a compile). The caller passes only those after a decode-only step: one
    after an admitting step left in flight also waits for that step's prefill."""
    if not decode_walls:
        return {}
    limit = 2 * statistics.median(decode_walls)
    slow = [w for w in decode_walls if w > limit]
    return dict(stalled_decode_steps=len(slow), stalled_decode_excess_seconds=sum(slow) - len(slow) * limit / 2)


def _kernel_table(run) -> str:
    """Per-kernel GPU time of `run()` (torch.profiler), after one run to warm it."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        run()
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            sync()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)


def finish_prefills(engine: LLMEngine) -> None:
    """Steps the engine until nothing waits and every running sequence has its prompt computed."""
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in scheduler.running):
        engine.step()


def decode_step_profile(engine: LLMEngine, batch_size: int, context: int, loras: list, vocab: int,
                        profile_to: Path | None = None) -> dict:
    """Wall time per decode step at a fixed batch (40 steps back to back) and the GPU time of one (its graph
    replayed alone), for the floor ratio and the GPU-idle fraction."""
    # no sequence may end before the replays below: a step of fewer rows would leave the bucket's graph inputs
    # past its rows stale (the staging's placeholder ids, which the graph then embeds)
    params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - context, ignore_eos=True)
    for prompt, lora in zip(prompts(batch_size, context, vocab, seed=7), loras):
        engine.add_request(prompt, params, lora)
    finish_prefills(engine)
    steps = 40
    torch.cuda.synchronize()
    with _timed_token_waits() as waits:
        t = time.perf_counter()
        for _ in range(steps):  # back to back, as in serving: a step's host work may overlap the previous one's
            engine.step()
        torch.cuda.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - t) / steps
    if profile_to is not None:  # two more steps of the same batch: the graph replay as serving runs it
        profile_to.write_text(f"decode step, batch {batch_size}\n{_kernel_table(engine.step)}")
    engine.drain()  # the running sequences' last tokens are real again (async scheduling leaves one in flight)
    # the graph the steps replayed: it depends on the rows' adapter slots (`cuda_graphs.graph_key`)
    slots = [engine.lora_manager.slot_for(lora) if engine.lora_manager else -1 for lora in loras]
    for request_id in list(engine.requests):
        engine.abort(request_id)
    # GPU busy time of one step: 20 replays of the captured graph back to back, then 20 steps of replay,
    # LM head and greedy choice (outside the graph) back to back. Timing each step between syncs instead
    # would add the device's start-up after idling to every one.
    graphs = engine.runner.graphs
    key = graphs.key(batch_size, slots)

    def gpu_ms(step) -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.inference_mode():
            step()
            torch.cuda.synchronize()
            begin.record()
            for _ in range(20):
                step()
            end.record()
            torch.cuda.synchronize()
        return begin.elapsed_time(end) / 20

    def full_step():
        graphs.graphs[key].replay()
        engine.sampler.greedy_pending(engine.model.compute_logits(graphs.outputs[key][:batch_size]))

    graph_ms, step_ms = gpu_ms(graphs.graphs[key].replay), gpu_ms(full_step)
    return dict(batch=batch_size, context=context, tiled_folds=sorted(key.tiled_folds), rank_width=key.rank_width,
                segments=key.segments or lora_tuning.choose_path(key.bucket) == "sgmv",
                step_wall_ms=wall_ms, graph_replay_ms=graph_ms,
                lm_head_and_greedy_ms=step_ms - graph_ms, gpu_idle_fraction=max(0.0, 1 - step_ms / wall_ms),
                host_wait_ms=1e3 * sum(waits) / steps)


@contextlib.contextmanager
def _timed_token_waits():
    """Seconds the host spends waiting for sampled tokens, one entry per wait: near zero when the host,
    not the GPU, sets the pace of the steps. Only async steps wait here (synchronous ones wait in the
    sampler's .tolist(), which this does not count)."""
    waits: list[float] = []
    wait = PendingTokens.wait

    def timed(self):
        t = time.perf_counter()
        wait(self)
        waits.append(time.perf_counter() - t)

    PendingTokens.wait = timed
    try:
        yield waits
    finally:
        PendingTokens.wait = wait


def bytes_floor_ms(engine: LLMEngine, batch_size: int, context: int, distinct_adapters: int, bandwidth: float,
                   rank: int = 16) -> float:
    model = engine.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()  # rows gathered
    cfg = engine.hf_config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = 2 * cfg.num_hidden_layers * batch_size * context * cfg.num_key_value_heads * head_dim * 2
    adapter_bytes = sum(rank * (out_f + in_f) * 2 for out_f, in_f in model.module_shapes().values())
    return 1e3 * (weight_bytes + kv_bytes + distinct_adapters * adapter_bytes) / bandwidth


async def online(engine: AsyncEngine, batch: list[list[int]], loras: list, output_len: int, rate: float) -> dict:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    ttft, tpot = [], []

    async def one(prompt, lora):
        start = time.perf_counter()
        first = None
        async for out in engine.generate(prompt, params, lora):
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
        done = time.perf_counter()
        ttft.append(first - start)
        tpot.append((done - first) / max(1, output_len - 1))

    gen = torch.Generator().manual_seed(3)
    gaps = torch.empty(len(batch)).exponential_(rate, generator=gen).tolist()
    tasks = []
    start = time.perf_counter()
    for prompt, lora, gap in zip(batch, loras, gaps):
        tasks.append(asyncio.create_task(one(prompt, lora)))
        await asyncio.sleep(gap)
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start

    def pct(values, q):
        return 1e3 * sorted(values)[min(len(values) - 1, int(q * len(values)))]

    return dict(rate=rate, requests=len(batch), seconds=elapsed, ttft_p50_ms=pct(ttft, 0.5), ttft_p99_ms=pct(ttft, 0.99),
                tpot_p50_ms=pct(tpot, 0.5), tpot_p99_ms=pct(tpot, 0.99))


def transformers_peft_baseline(model_dir: Path, adapter_paths: list[Path], batch: int, prompt_len: int,
                               new_tokens: int, vocab: int) -> dict:
    import peft
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    ids = torch.tensor(prompts(batch, prompt_len, vocab, seed=11), device="cuda")
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:2], max_new_tokens=2, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        base = batch * new_tokens / (time.perf_counter() - t)
    names = []
    for i, path in enumerate(adapter_paths[:batch]):
        name = f"a{i}"
        if i == 0:
            model = peft.PeftModel.from_pretrained(model, str(path), adapter_name=name)
        else:
            model.load_adapter(str(path), adapter_name=name)
        names.append(name)
    model.eval()
    with torch.no_grad():
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(input_ids=ids, adapter_names=[names[i % len(names)] for i in range(batch)], **kwargs)
        torch.cuda.synchronize()
        mixed = batch * new_tokens / (time.perf_counter() - t)
    del model
    return dict(batch=batch, new_tokens=new_tokens, base_tok_per_s=base, mixed_adapters=len(names),
                mixed_tok_per_s=mixed)


# ---- driver ----------------------------------------------------------------------------------------
def tensor_parallel_comparison(model_dir: Path, paths: list[Path], batch: list[list[int]], args, out: Path) -> None:
    """Workload (c) at each tensor-parallel size, on as many GPUs."""
    RESULTS["tensor_parallel"] = {}
    for size in args.tensor_parallel_sizes:
        engine = build_lora_engine(model_dir, args, 64, tensor_parallel_size=size, enforce_eager=args.enforce_eager)
        requests = lora_requests(paths[:64])
        offline(engine, batch[:8], requests[:8], 4)
        result = offline(engine, batch, [requests[i % 64] for i in range(len(batch))], args.output_len)
        RESULTS["tensor_parallel"][size] = dict(result, enforce_eager=args.enforce_eager)
        log(f"TP={size}: {result}")
        engine.close()
        del engine
        release_gpu_memory()
        save(out)


def warm_up(engine: LLMEngine, batch: list[list[int]], loras: list, args) -> None:
    """A short run shaped like the measured ones: full prefill chunks, then prefill chunks cut short by
    decode rows, then decodes of every batch size down to one. Their kernels compile, and the adapters and
    decode graphs are used, before the clock starts (a warm-up of one chunk left the mixed steps' compiles
    to the first measured run, which made the first engine's first workload look slower). The engine's own
    start-up warm-up (`engine/warmup.py`) already covers each LoRA tile class once."""
    count = args.max_num_seqs + max(1, args.max_batched_tokens // args.prompt_len)
    offline(engine, batch[:count], [loras[i % len(loras)] for i in range(count)], 8)


def _reader_variant(text: str) -> tuple[int, float]:
    threads, interval_ms = text.split(":")
    return int(threads), float(interval_ms)


ENGINE_SETTINGS = ("adapter_reader", "admission_order", "suspend_margin", "cudagraph_mode")


def build_engine(model_dir: Path, args, **overrides) -> LLMEngine:
    """The benchmarks' engine; the settings a script's flags leave out (`ENGINE_SETTINGS`) keep EngineConfig's
    defaults."""
    settings = {name: getattr(args, name) for name in ENGINE_SETTINGS if hasattr(args, name)} | overrides
    config = EngineConfig(model=str(model_dir), dtype="bfloat16" if args.device == "cuda" else "float32",
                          device=args.device, load_format="dummy",
                          max_model_len=args.prompt_len + args.output_len + 64, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_batched_tokens, **settings)
    engine = LLMEngine(config)
    if args.freeze_heap:
        freeze_startup_heap()
    return engine


def lora_requests(paths: list[Path]) -> list[LoRARequest]:
    """One request per adapter directory, named and numbered alike in every benchmark."""
    return [LoRARequest(f"adapter-{i}", i + 1, str(p)) for i, p in enumerate(paths)]


def build_lora_engine(model_dir: Path, args, slots: int, **overrides) -> LLMEngine:
    """`build_engine` with `slots` adapter slots of rank `args.max_lora_rank`, and room for as many adapters in host
    memory: every adapter a run asks for stays loaded."""
    return build_engine(model_dir, args, enable_lora=True, max_loras=slots, max_lora_rank=args.max_lora_rank,
                        max_cpu_loras=slots, **overrides)


def release_gpu_memory() -> None:
    """After the caller dropped its engine: collect it now (unfrozen, if `--freeze-heap` froze it) and return its
    memory to the device."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def suspend_margin_arg(text: str) -> int | None:
    """--suspend-margin's value: steps, or 'off'."""
    return None if text == "off" else int(text)


def save(out: Path) -> None:
    (out / "serving.json").write_text(json.dumps(RESULTS, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    parser.add_argument("--unique-adapters", type=int, default=16)
    parser.add_argument("--zipf-seed", type=int, default=0,
                        help="the seed of (d)'s Zipf picks (`benchmarks/zipf_schedule.py --seed` simulates the same)")
    parser.add_argument("--adapter-rank", type=int, default=16, help="the adapters' rank")
    parser.add_argument("--max-lora-rank", type=int,
                        help="the engines' slot rank (default: the adapters' rank); adapters of a lower rank are padded "
                             "up to it in their slots")
    parser.add_argument("--sweep", type=int, nargs="*", default=[1, 4, 16])
    parser.add_argument("--online-rate", type=float, default=8.0)
    parser.add_argument("--online-requests", type=int, default=96)
    parser.add_argument("--budget-s", type=float, default=500)
    parser.add_argument("--work", default="/tmp/loraserve-bench")
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--word-tokenizer", action="store_true",
                        help="a tokenizer with a word for every id, so every output token is text (make_word_tokenizer)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tensor-parallel-sizes", type=int, nargs="*", default=[],
                        help="only run workload (c) once per size (TP comparison) and exit")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=WORKLOADS,
                        help="base: (a) and its decode profile; adapters: (b), (c), online; zipf: (d)")
    parser.add_argument("--zipf-reader-variants", type=_reader_variant, nargs="*", default=[],
                        help="extra (d) runs reading on threads, each THREADS:SWITCH_MS (adapter reader threads, "
                             "GIL switch interval)")
    parser.add_argument("--adapter-reader", choices=("auto", "threads", "process"), default="auto",
                        help="where the engines read adapters in the background (EngineConfig.adapter_reader)")
    parser.add_argument("--admission-order", choices=ADMISSION_ORDERS, default="balanced",
                        help="the order the engines admit waiting requests in for the offline workloads "
                             "(EngineConfig.admission_order; the default is the offline LLM's); the online run "
                             "admits in arrival order, as `loraserve serve` does")
    parser.add_argument("--suspend-margin", type=suspend_margin_arg, default=EngineConfig.suspend_margin,
                        help="balanced admission's suspension margin in steps, or 'off' (EngineConfig.suspend_margin)")
    parser.add_argument("--cudagraph-mode", choices=CUDAGRAPH_MODES, default="full_and_piecewise",
                        help="CUDA graphs for decode steps only, or for mixed steps' pieces too (EngineConfig)")
    parser.add_argument("--profile-host", action="store_true", help="cProfile the engine thread during (d)")
    parser.add_argument("--freeze-heap", action="store_true",
                        help="freeze each engine's start-up heap out of the garbage collector's reach, as `loraserve "
                             "serve` does (by default only the online run does)")
    args = parser.parse_args()
    if args.online_requests < 1:
        parser.error("--online-requests must be at least 1 (its latency percentiles need a request)")
    args.max_lora_rank = args.max_lora_rank or args.adapter_rank
    if args.max_lora_rank < args.adapter_rank:
        parser.error(f"--max-lora-rank {args.max_lora_rank} is below the adapters' rank {args.adapter_rank}")
    began = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    vocab = SHAPES[args.shape]["vocab_size"]
    model_dir = make_model_dir(work, args.shape, args.word_tokenizer)
    t = time.perf_counter()
    rank_suffix = "" if args.adapter_rank == 16 else f"-r{args.adapter_rank}"
    paths = make_adapters(work / f"adapters-{args.shape}{rank_suffix}", model_dir, args.shape, 1000,
                          args.unique_adapters, rank=args.adapter_rank)
    log(f"adapters written in {time.perf_counter() - t:.1f}s")
    RESULTS["config"] = vars(args)
    gpu = args.device == "cuda"
    RESULTS["gpu"] = gpu_identity() if gpu else {}
    RESULTS["hbm_bytes_per_s"] = bandwidth = measure_bandwidth("cuda") if gpu else 0.0
    log(f"measured D2D bandwidth {bandwidth / 1e12:.2f} TB/s")
    batch = prompts(args.num_requests, args.prompt_len, vocab)

    def over_budget() -> bool:
        return time.perf_counter() - began > args.budget_s

    if args.tensor_parallel_sizes:
        tensor_parallel_comparison(model_dir, paths, batch, args, out)
        return

    # (a) base only
    if WORKLOAD_BASE in args.workloads:
        engine = build_engine(model_dir, args)
        warm_up(engine, batch, [None], args)
        RESULTS["a_base"] = offline(engine, batch, [None] * len(batch), args.output_len)
        log(f"(a) base: {RESULTS['a_base']}")
        if gpu:
            RESULTS["decode_base_b64"] = decode_step_profile(engine, 64, args.prompt_len, [None] * 64, vocab,
                                                              out / "profile_base_b64.txt")
            RESULTS["decode_base_b64"]["floor_ms"] = bytes_floor_ms(engine, 64, args.prompt_len + 32, 0, bandwidth)
            log(f"decode base b64: {RESULTS['decode_base_b64']}")
            RESULTS["a_base_eos"] = offline(engine, batch, [None] * len(batch), args.output_len, ignore_eos=False)
            log(f"(a) base, sequences that may end by EOS: {RESULTS['a_base_eos']}")
            RESULTS["a_base_sampled"] = offline(engine, batch, [None] * len(batch), args.output_len, temperature=0.8)
            log(f"(a) base, random sampling (drawn on the device): {RESULTS['a_base_sampled']}")
            RESULTS["a_base_sampled_top_p"] = offline(engine, batch, [None] * len(batch), args.output_len,
                                                      temperature=0.8, top_p=0.95)
            log(f"(a) base, random sampling with top-p: {RESULTS['a_base_sampled_top_p']}")
            RESULTS["a_base_penalties_logprobs"] = offline(engine, batch, [None] * len(batch), args.output_len,
                                                           **PENALTIES_AND_LOGPROBS)
            log(f"(a) base, sampling with penalties and logprobs: {RESULTS['a_base_penalties_logprobs']}")
            RESULTS["a_base_scoring"] = scoring(engine, batch)
            log(f"(a) base, scoring the prompts: {RESULTS['a_base_scoring']}")
            RESULTS["a_base_scoring_flat"] = scoring(engine, batch, flat_logprobs=True)
            log(f"(a) base, scoring the prompts into flat records: {RESULTS['a_base_scoring_flat']}")
            if engine.async_scheduling:  # the same engine with every step synchronous, for comparison
                engine.async_scheduling = False
                RESULTS["a_base_sync"] = offline(engine, batch, [None] * len(batch), args.output_len)
                log(f"(a) base, synchronous steps: {RESULTS['a_base_sync']}")
                RESULTS["a_base_sampled_sync"] = offline(engine, batch, [None] * len(batch), args.output_len,
                                                         temperature=0.8)
                log(f"(a) base, random sampling, synchronous steps: {RESULTS['a_base_sampled_sync']}")
                RESULTS["a_base_penalties_logprobs_sync"] = offline(engine, batch, [None] * len(batch),
                                                                    args.output_len, **PENALTIES_AND_LOGPROBS)
                log(f"(a) base, penalties and logprobs, synchronous steps: {RESULTS['a_base_penalties_logprobs_sync']}")
                RESULTS["a_base_scoring_sync"] = scoring(engine, batch)
                log(f"(a) base, scoring the prompts, synchronous steps: {RESULTS['a_base_scoring_sync']}")
                RESULTS["decode_base_b64_sync"] = decode_step_profile(engine, 64, args.prompt_len, [None] * 64, vocab)
                log(f"decode base b64, synchronous steps: {RESULTS['decode_base_b64_sync']}")
                engine.async_scheduling = True
        del engine
        release_gpu_memory()
        save(out)

    # (b), (c) and the sweep: one engine with 64 slots
    if WORKLOAD_ADAPTERS in args.workloads:
        engine = build_lora_engine(model_dir, args, 64)
        requests = lora_requests(paths[:64])
        t = time.perf_counter()
        for r in requests:
            engine.lora_manager.add(r)
        RESULTS["adapter_cold_load_s"] = (time.perf_counter() - t) / len(requests)
        sync()
        t = time.perf_counter()
        engine.lora_manager.pin(requests[0])
        sync()
        RESULTS["adapter_host_to_slot_s"] = time.perf_counter() - t
        engine.lora_manager.unpin(requests[0])
        warm_up(engine, batch, requests[:8], args)
        RESULTS["b_one_adapter"] = offline(engine, batch, [requests[0]] * len(batch), args.output_len)
        log(f"(b) one adapter: {RESULTS['b_one_adapter']}")
        RESULTS["c_64_adapters"] = offline(engine, batch, [requests[i % 64] for i in range(len(batch))], args.output_len)
        log(f"(c) 64 adapters: {RESULTS['c_64_adapters']}")
        if gpu:
            RESULTS["decode_lora_b64"] = decode_step_profile(engine, 64, args.prompt_len, requests[:64], vocab,
                                                              out / "profile_lora_b64.txt")
            RESULTS["decode_lora_b64"]["floor_ms"] = bytes_floor_ms(engine, 64, args.prompt_len + 32, 64, bandwidth,
                                                                    rank=args.adapter_rank)
            log(f"decode 64 adapters b64: {RESULTS['decode_lora_b64']}")
        save(out)
        if not over_budget():
            engine.scheduler.admission_order = "fcfs"  # as `loraserve serve` admits
            async_engine = AsyncEngine(engine=engine)
            freeze_startup_heap()  # as `loraserve serve` does once started; unfrozen before the engine is dropped

            async def run_online():
                online_batch = batch[:args.online_requests]
                return await online(async_engine, online_batch, [requests[i % 64] for i in range(len(online_batch))],
                                    args.output_len, args.online_rate)

            RESULTS["online_64_adapters"] = asyncio.run(run_online())
            log(f"online: {RESULTS['online_64_adapters']}")
            async_engine.shutdown()
            del async_engine
            gc.unfreeze()
        del engine
        release_gpu_memory()
        save(out)

    # (d) 1000 adapters, Zipf, 32 slots
    if WORKLOAD_ZIPF in args.workloads and not over_budget():
        zipf_engine = dict(enable_lora=True, max_loras=32, max_lora_rank=args.max_lora_rank, max_cpu_loras=128)
        engine = build_engine(model_dir, args, **zipf_engine)
        population = lora_requests(paths)
        picks = zipf_choice(len(batch), len(population), args.zipf_seed)
        picked = set(picks)
        unpicked = [population[i] for i in range(len(population)) if i not in picked] or [None]
        warm_up(engine, batch, unpicked[-8:], args)  # adapters the run never asks for: it reads all its own
        with cpu_profile(out / "profile_d_host.txt" if args.profile_host else None):
            RESULTS["d_1000_zipf"] = offline(engine, batch, [population[i] for i in picks], args.output_len,
                                             timeline_to=out / "timeline_d.json")
        RESULTS["d_1000_zipf"]["distinct_adapters"] = len(set(picks))
        log(f"(d) 1000 zipf: {RESULTS['d_1000_zipf']}")
        default_threads, default_interval = LoRAManager.READER_THREADS, sys.getswitchinterval()
        for threads, interval_ms in args.zipf_reader_variants:
            # the same run with other reader-thread counts and GIL switch intervals: how much the adapter
            # reads' Python work slows the engine thread down
            if over_budget():
                break
            del engine
            release_gpu_memory()
            LoRAManager.READER_THREADS = threads
            sys.setswitchinterval(interval_ms / 1e3)
            engine = build_engine(model_dir, args, **zipf_engine, adapter_reader="threads")
            variant = offline(engine, batch, [population[i] for i in picks], args.output_len)
            RESULTS.setdefault("d_reader_variants", []).append(dict(variant, reader_threads=threads,
                                                                    switch_interval_ms=interval_ms))
            log(f"(d) with {threads} reader threads, {interval_ms} ms GIL switch interval: {variant}")
            LoRAManager.READER_THREADS = default_threads
            sys.setswitchinterval(default_interval)
        del engine
        release_gpu_memory()
        save(out)

    if gpu and not args.skip_baseline and not over_budget():
        RESULTS["transformers_peft"] = transformers_peft_baseline(model_dir, paths, 32, args.prompt_len, 8, vocab)
        log(f"transformers+peft: {RESULTS['transformers_peft']}")
        save(out)
    if args.sweep and not over_budget():
        engine = build_lora_engine(model_dir, args, 64)
        requests = lora_requests(paths[:64])
        RESULTS["sweep"] = {}
        for n in args.sweep:
            if over_budget():
                break
            RESULTS["sweep"][n] = offline(engine, batch, [requests[i % n] for i in range(len(batch))],
                                          args.output_len)
            log(f"sweep {n}: {RESULTS['sweep'][n]['tok_per_s']:.0f} tok/s")
            save(out)
        del engine
        release_gpu_memory()
    log(json.dumps(summary(), indent=1))


def summary() -> dict:
    r = RESULTS
    s = {}
    if "a_base" in r and "c_64_adapters" in r:
        s["c_over_a"] = r["c_64_adapters"]["tok_per_s"] / r["a_base"]["tok_per_s"]
    if "c_64_adapters" in r and "d_1000_zipf" in r:
        s["d_over_c"] = r["d_1000_zipf"]["tok_per_s"] / r["c_64_adapters"]["tok_per_s"]
    for key in ("decode_base_b64", "decode_lora_b64"):
        if key in r:
            s[f"{key}_over_floor"] = r[key]["step_wall_ms"] / r[key]["floor_ms"]
    if "transformers_peft" in r and "c_64_adapters" in r:
        s["c_over_transformers_peft_mixed"] = r["c_64_adapters"]["tok_per_s"] / r["transformers_peft"]["mixed_tok_per_s"]
    RESULTS["summary"] = s
    return s


if __name__ == "__main__":
    main()
