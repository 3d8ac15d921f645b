"""The engine core in its own process, driven through EngineCoreClient as the server drives AsyncEngine (what both
fronts share is tested on both in test_async_engine.py): mixed adapters, adapter calls, and the process's own ends."""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine import (
    AsyncEngine, EngineConfig, EngineCoreClient, EngineStopped, LoRARequest, SamplingParams, start_async_engine,
)
from tests.engine.conftest import run_to_completion
from tests.tiny_models import make_peft_adapter

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def _config(model_dir, **overrides) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", device="cpu", **overrides)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("core-adapters")
    return [LoRARequest(f"a{i}", i + 1, str(make_peft_adapter(tiny_llama, root / f"a{i}", r=4, seed=i, scale=0.5)))
            for i in range(2)]


@pytest.fixture(scope="module")
def client(tiny_llama, adapters):
    engine = EngineCoreClient(_config(tiny_llama, enable_lora=True, max_loras=2, max_cpu_loras=2))
    for adapter in adapters:
        engine.add_lora(adapter)
    yield engine
    engine.shutdown()


async def _collect(engine, prompt, params=PARAMS, lora_request=None, request_id=None):
    return [o async for o in engine.generate(prompt, params, lora_request=lora_request, request_id=request_id)]


def _idle(engine, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if (stats.num_running == stats.num_waiting == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def test_the_client_reports_the_engine_it_started(client, llama_engine):
    assert client.alive
    assert client.model_name == llama_engine.model_name and client.max_model_len == llama_engine.max_model_len
    assert client.tokenizer("Hello world")["input_ids"] == llama_engine.tokenize("Hello world")
    assert client.model_info.module_shapes == llama_engine.model_info.module_shapes
    assert client.config.max_loras == 2 and client.device.type == "cpu"


def test_concurrent_mixed_adapter_requests_match_the_offline_engine(client, adapters, tiny_llama):
    from tests.engine.conftest import make_engine
    prompts = ["Hello", "The capital of France", "def add(a, b):", "SELECT"]
    loras = [None, adapters[0], adapters[1], adapters[0]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    async def main():
        return await asyncio.gather(*(_collect(client, p, params, lora) for p, lora in zip(prompts, loras)))

    streams = asyncio.run(main())
    offline = make_engine(tiny_llama, enable_lora=True, max_loras=2)
    for prompt, lora, stream in zip(prompts, loras, streams):
        offline.add_request(prompt, params, lora)
        (expected,) = run_to_completion(offline).values()
        final = stream[-1]
        assert final.finished and not any(o.finished for o in stream[:-1])
        assert final.outputs[0].token_ids == expected.outputs[0].token_ids
        assert final.outputs[0].text == expected.outputs[0].text
        _assert_close_logprobs(final.outputs[0].logprobs, expected.outputs[0].logprobs)
        assert final.prompt_token_ids == expected.prompt_token_ids
        assert final.lora_name == (lora.lora_name if lora else None)


def _assert_close_logprobs(got, expected) -> None:
    """The same tokens, ranks and decoded texts at every position; logprobs as close as batching leaves them. Float32
    sums taken in another order (another batch) move a few ill-conditioned positions of the random tiny model by up to
    4.2e-4: "The capital of France" on a0, output position 7, lies 2.1e-4 from the float64 peft reference whether it
    runs alone or beside the others, on opposite sides (elsewhere both stay within 7e-6)."""
    assert len(got) == len(expected)
    for position, want in zip(got, expected):
        assert {t: (lp.rank, lp.decoded_token) for t, lp in position.items()} == {
            t: (lp.rank, lp.decoded_token) for t, lp in want.items()}
        assert all(position[t].logprob == pytest.approx(want[t].logprob, abs=1e-3) for t in want)


def test_an_unknown_adapter_raises_in_the_caller(client):
    with pytest.raises(ValueError):
        asyncio.run(_collect(client, "x", PARAMS, LoRARequest("nowhere", 99, "/does/not/exist")))
    assert client.alive


def test_requests_left_early_leave_nothing_behind_in_the_client_or_the_engine(client):
    async def main():
        async def left_after(outputs: int):
            stream = client.generate("Hello", LONG)
            for _ in range(outputs):
                await stream.__anext__()
            await stream.aclose()

        await asyncio.gather(*(left_after(n) for n in (1, 2, 3)))

    asyncio.run(main())
    stats = _idle(client)
    assert stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0
    assert client._decoder._outputs == {}


def test_adapter_calls_reach_the_engine(client, adapters):
    status = client.lora_status()
    assert set(status) >= {adapter.lora_int_id for adapter in adapters}
    with pytest.raises(ValueError, match="unloaded"):
        async def main():
            stream = client.generate("Hello", LONG, lora_request=adapters[1])
            await stream.__anext__()  # running: its adapter id stays taken after the unload
            client.remove_lora(adapters[1].lora_int_id)
            try:
                client.add_lora(LoRARequest("other", adapters[1].lora_int_id, adapters[0].lora_path))
            finally:
                await stream.aclose()
        asyncio.run(main())
    _idle(client)
    client.add_lora(adapters[1])  # its requests ended: the id may be used again
    final = asyncio.run(_collect(client, "Hello", PARAMS, adapters[1]))[-1]
    assert final.finished


def test_a_failed_start_raises_the_engines_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        EngineCoreClient(_config(tmp_path))


def test_an_engine_process_killed_while_it_starts_is_an_error_in_the_constructor(tiny_llama):
    before = {p.pid for p in multiprocessing.active_children()}
    outcome = {}

    def start():
        try:
            EngineCoreClient(_config(tiny_llama))
        except RuntimeError as exc:
            outcome["error"] = str(exc)

    starter = threading.Thread(target=start)
    starter.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        starting = [p for p in multiprocessing.active_children()
                    if p.name == "loraserve-engine-core" and p.pid not in before]
        if starting:
            break
        time.sleep(0.01)
    os.kill(starting[0].pid, signal.SIGKILL)  # it is still importing torch: seconds before it could be ready
    starter.join(timeout=60)
    assert outcome["error"].startswith("the engine process exited with code -9 before it was ready")


def test_a_dead_engine_process_fails_its_streams_and_calls(tiny_llama):
    engine = EngineCoreClient(_config(tiny_llama))
    try:
        async def main():
            stream = engine.generate("Hello", LONG)
            await stream.__anext__()
            os.kill(engine._process.pid, signal.SIGKILL)
            with pytest.raises(EngineStopped, match="exited with code -9"):
                async for _ in stream:
                    pass

        asyncio.run(main())
        assert not engine.alive
        with pytest.raises(EngineStopped):
            engine.stats()
        with pytest.raises(EngineStopped):
            asyncio.run(_collect(engine, "Hello"))
    finally:
        engine.shutdown()


def test_a_terminated_engine_process_stops_cleanly(tiny_llama):
    """SIGTERM (a service manager stopping the whole group) ends the engine process with exit code 0: the client
    reports a shutdown, not a crash."""
    engine = EngineCoreClient(_config(tiny_llama))
    try:
        async def main():
            stream = engine.generate("Hello", LONG)
            await stream.__anext__()
            engine._process.terminate()
            with pytest.raises(EngineStopped, match="the engine has been shut down"):
                async for _ in stream:
                    pass

        asyncio.run(main())
        assert not engine.alive and engine._process.exitcode == 0
    finally:
        engine.shutdown()


def test_a_client_never_shut_down_stops_its_engine_process_at_exit_without_calling_it_a_crash(tiny_llama):
    """A script that fails after starting the engine (a server whose adapter is refused) and exits: its engine process
    is stopped, and the exit is not reported as the engine dying."""
    script = ("from engine import EngineConfig, EngineCoreClient\n"
              "def main():\n"
              f"    client = EngineCoreClient(EngineConfig(model={str(tiny_llama)!r}, dtype='float32', device='cpu'))\n"
              "    print(client._process.pid, flush=True)\n"
              "    raise ValueError('a bad adapter')\n"
              "main()\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "ValueError: a bad adapter" in result.stderr, result.stderr
    pid = int(result.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists()
    assert "exited with code" not in result.stderr, result.stderr


def test_shutdown_ends_the_process_and_fails_running_streams(tiny_llama):
    engine = EngineCoreClient(_config(tiny_llama))

    async def main():
        stream = asyncio.create_task(_collect(engine, "Hello", LONG))
        await asyncio.sleep(0.3)
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        with pytest.raises(EngineStopped, match="shut down"):
            await asyncio.wait_for(stream, 30)

    asyncio.run(main())
    assert not engine.alive and engine._process.exitcode == 0


def test_auto_runs_the_engine_on_a_thread_on_the_cpu(tiny_llama):
    engine = start_async_engine(_config(tiny_llama), "auto")
    try:
        assert isinstance(engine, AsyncEngine)
    finally:
        engine.shutdown()


def test_an_unknown_engine_core_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="engine_core must be one of auto, process, thread"):
        start_async_engine(_config(tiny_llama), "fiber")
