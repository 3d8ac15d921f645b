"""Serving through HTTP: a real `loraserve serve` process, driven by streaming clients in other processes.

`serving.py` drives the engine inside its own process. This drives the server a user starts, so the HTTP layer,
the SSE streams and the event loop are part of what it measures, with the engine core in a process of its own (the
default on a GPU) or on a thread of the server's process, sharing its GIL with the event loop (`--engine-cores`).

    python3 benchmarks/http_serving.py --shape llama3-8b --out $OUT        # on the H200
    python benchmarks/http_serving.py --shape small --device cpu --num-requests 16 --output-len 8 \\
        --online-requests 8 --adapters 4                                    # a smoke run of the code

The model has random weights at the real shapes (`--load-format dummy`) and a tokenizer with a word for every id
(`serving.make_word_tokenizer`: every output token is text to stream); the adapters are random peft directories
(`serving.make_adapters`), all registered at start-up with `--lora-modules`. Runs, each streamed
to `/v1/completions` (greedy, `ignore_eos`, token-id prompts):
- (a) every request on the base model and (c) spread over the adapters, all sent at once
  (`--num-requests` × (`--prompt-len` + `--output-len`));
- online: Poisson arrivals at `--online-rate` on the adapters.
Each reports output tok/s, time to first token and per output token (p50, p99), and SSE events per token.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.serving import SHAPES, make_adapters, make_model_dir, offline, prompts  # noqa: E402

BASE_NAME = "base"


@dataclass
class Job:
    at: float  # seconds after the run's start
    model: str
    prompt: list[int]


@dataclass
class Record:
    sent: float
    first: float | None  # the first event with text
    last: float | None
    tokens: int  # from the final usage event
    events: int
    error: str | None


def ready(_: object) -> None:
    """Nothing: mapped once over the client processes so that they are up before a run's clock starts."""


async def _one(client: httpx.AsyncClient, job: Job, start: float, max_tokens: int) -> Record:
    await asyncio.sleep(max(0.0, start + job.at - time.time()))
    body = {"model": job.model, "prompt": job.prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent, first, last, tokens, events = time.time(), None, None, 0, 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return Record(sent, None, None, 0, 0, (await response.aread()).decode()[:300])
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                if '"choices":[]' in data:  # the usage event
                    tokens = json.loads(data)["usage"]["completion_tokens"]
                    continue
                now = time.time()
                first = first or now
                last = now
                events += 1
    except httpx.HTTPError as exc:
        return Record(sent, first, last, tokens, events, repr(exc))
    return Record(sent, first, last, tokens, events, None)


async def _drive(url: str, jobs: list[Job], start: float, max_tokens: int) -> list[Record]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits) as client:
        return await asyncio.gather(*(_one(client, job, start, max_tokens) for job in jobs))


def drive(url: str, jobs: list[Job], start: float, max_tokens: int) -> list[Record]:
    """One client process's share of a run (its own event loop and GIL, so the client is not the bottleneck)."""
    return asyncio.run(_drive(url, jobs, start, max_tokens))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(records: list[Record]) -> dict:
    done = [r for r in records if r.error is None and r.last is not None]
    errors = [r.error for r in records if r.error is not None]
    tokens = sum(r.tokens for r in done)
    seconds = max(r.last for r in done) - min(r.sent for r in records) if done else 0.0
    ttft = [1e3 * (r.first - r.sent) for r in done]
    tpot = [1e3 * (r.last - r.first) / (r.tokens - 1) for r in done if r.tokens > 1]
    return {
        "requests": len(records), "errors": len(errors), "first_error": errors[0] if errors else None,
        "seconds": seconds, "output_tokens": tokens, "tok_per_s": tokens / seconds if seconds else None,
        "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p99_ms": percentile(ttft, 0.99),
        "tpot_p50_ms": percentile(tpot, 0.5), "tpot_p99_ms": percentile(tpot, 0.99),
        "events_per_token": sum(r.events for r in done) / tokens if tokens else None,
    }


def run(pool: ProcessPoolExecutor, processes: int, url: str, jobs: list[Job], max_tokens: int) -> dict:
    start = time.time() + 0.5
    futures = [pool.submit(drive, url, jobs[i::processes], start, max_tokens) for i in range(processes)
               if jobs[i::processes]]
    return summarize([record for future in futures for record in future.result()])


# ---- the server ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(args, model_dir: Path, adapters: list[Path], port: int) -> list[str]:
    launcher = ["-m", "openai_server.cli"]
    if args.switch_interval_ms is not None:  # the server process's GIL switch interval, set before it starts
        launcher = ["-c", "import sys; sys.setswitchinterval(float(sys.argv.pop(1)) / 1e3); "
                    "from openai_server.cli import main; sys.exit(main(sys.argv[1:]))", str(args.switch_interval_ms)]
    command = [sys.executable, *launcher, "serve", str(model_dir), "--load-format", "dummy",
               "--device", args.device, "--served-model-name", BASE_NAME, "--port", str(port),
               "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_batched_tokens),
               "--log-level", "warning", *args.server_args]
    if args.device == "cpu":
        command += ["--dtype", "float32"]
    if adapters:
        command += ["--max-loras", str(len(adapters)), "--max-lora-rank", str(args.adapter_rank), "--lora-modules",
                    *(f"adapter-{i}={path}" for i, path in enumerate(adapters))]
    return command


def start_server(command: list[str], log: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    """The server process, once /health answers; its output goes to `log`."""
    port = command[command.index("--port") + 1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}):\n" + log.read_text()[-3000:])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    process.kill()
    raise RuntimeError("the server did not answer /health in time:\n" + log.read_text()[-3000:])


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()


def engine_baseline(args, model_dir: Path, adapters: list[Path], batch: list[list[int]]) -> dict:
    """(a) and (c) on the same engine settings without the server: `LLMEngine.step` in a loop, in this process."""
    from engine import EngineConfig, LLMEngine, LoRARequest

    engine = LLMEngine(EngineConfig(
        model=str(model_dir), load_format="dummy", device=args.device,
        dtype="float32" if args.device == "cpu" else "auto", max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens, enable_lora=True, max_loras=len(adapters),
        max_lora_rank=args.adapter_rank, admission_order="fcfs"))
    loras = [LoRARequest(f"adapter-{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    offline(engine, batch[:args.max_num_seqs], [None, *loras] * args.max_num_seqs, min(16, args.output_len))
    keys = ("tok_per_s", "seconds", "steps", "median_decode_step_ms")
    runs = {"a_base": [None] * len(batch), "c_adapters": [loras[i % len(loras)] for i in range(len(batch))]}
    results = {}
    for name, run_loras in runs.items():
        result = offline(engine, batch, run_loras, args.output_len)
        results[name] = {key: result[key] for key in keys}
        print(f"engine alone, {name}", json.dumps(results[name]), flush=True)
    return results


# ---- workloads ------------------------------------------------------------------------------------
def burst(batch: list[list[int]], models: list[str]) -> list[Job]:
    return [Job(0.0, models[i % len(models)], prompt) for i, prompt in enumerate(batch)]


def poisson(batch: list[list[int]], models: list[str], rate: float, seed: int = 0) -> list[Job]:
    rng = random.Random(seed)
    jobs, at = [], 0.0
    for i, prompt in enumerate(batch):
        jobs.append(Job(at, models[i % len(models)], prompt))
        at += rng.expovariate(rate)
    return jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    parser.add_argument("--adapters", type=int, default=64)
    parser.add_argument("--adapter-rank", type=int, default=16)
    parser.add_argument("--online-rate", type=float, default=8.0)
    parser.add_argument("--online-requests", type=int, default=96)
    parser.add_argument("--client-processes", type=int, default=4)
    parser.add_argument("--start-timeout", type=float, default=900)
    parser.add_argument("--switch-interval-ms", type=float,
                        help="the server process's GIL switch interval (Python's default: 5 ms)")
    parser.add_argument("--engine-cores", nargs="+", default=["process"], choices=("process", "thread"),
                        help="run the server once for each, its engine core in a process of its own or on a thread "
                        "of the server's process (`loraserve serve --engine-core`)")
    parser.add_argument("--engine-baseline", action="store_true",
                        help="then run (a) and (c) on an engine in this process, without the server")
    parser.add_argument("--server-args", nargs="*", default=[], help="more `loraserve serve` flags, e.g. "
                        "--no-async-scheduling (write them as --server-args=--flag)")
    parser.add_argument("--work", default="/tmp/loraserve-bench")
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = make_model_dir(work, args.shape, word_tokenizer=True)
    adapters = make_adapters(work / "adapters", model_dir, args.shape, args.adapters, min(16, args.adapters),
                             args.adapter_rank)
    batch = prompts(args.num_requests, args.prompt_len, SHAPES[args.shape]["vocab_size"])
    results: dict = {"config": vars(args)}
    for engine_core in args.engine_cores:
        results[engine_core] = serve_runs(args, engine_core, model_dir, adapters, batch, out)
    if args.engine_baseline:
        results["engine_alone"] = engine_baseline(args, model_dir, adapters, batch)
    (out / "http_serving.json").write_text(json.dumps(results, indent=1, default=str))


def serve_runs(args, engine_core: str, model_dir: Path, adapters: list[Path], batch: list[list[int]],
               out: Path) -> dict:
    """One server, with its engine core where `engine_core` says: the burst runs (a) and (c), then the online run."""
    vocab = SHAPES[args.shape]["vocab_size"]
    adapter_names = [f"adapter-{i}" for i in range(len(adapters))]
    command = server_command(args, model_dir, adapters, free_port()) + ["--engine-core", engine_core]
    started = time.monotonic()
    process, url = start_server(command, out / f"server_{engine_core}.log", args.start_timeout)
    results: dict = {"server_start_s": time.monotonic() - started}
    print(f"server ({engine_core} engine core) up in {results['server_start_s']:.1f} s", flush=True)
    try:
        with ProcessPoolExecutor(args.client_processes) as pool:
            list(pool.map(ready, [None] * args.client_processes))
            warm = burst(batch[:args.max_num_seqs], [BASE_NAME, *adapter_names])
            run(pool, args.client_processes, url, warm, min(16, args.output_len))
            runs = {
                "a_base_burst": (burst(batch, [BASE_NAME]), args.output_len),
                "c_adapters_burst": (burst(batch, adapter_names), args.output_len),
                "online_adapters": (poisson(prompts(args.online_requests, args.prompt_len, vocab, seed=1),
                                            adapter_names, args.online_rate), args.output_len),
            }
            for name, (jobs, max_tokens) in runs.items():
                results[name] = run(pool, args.client_processes, url, jobs, max_tokens)
                print(engine_core, name, json.dumps(results[name]), flush=True)
            results["metrics"] = httpx.get(url + "/metrics", timeout=10).text
    finally:
        stop_server(process)
    a, c = results["a_base_burst"]["tok_per_s"], results["c_adapters_burst"]["tok_per_s"]
    if a and c:
        print(f"{engine_core} engine core: (c)/(a) through HTTP: {c / a:.3f}", flush=True)
    return results


if __name__ == "__main__":
    main()
