"""The server with its engine core in a process of its own (`--engine-core process`, the default on one GPU): the same
answers as the server whose engine steps on a thread, adapters sent to and loaded in the engine process, and a
clear 503 once that process is gone."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from adapters_registry import AdapterRegistry, AdapterSpec
from openai_server import ServerSettings, build_app
from openai_server.adapters import register_adapter
from tests.server.conftest import RunningServer, _free_port, make_engine, start_server, stop_server

GREEDY = {"max_tokens": 12, "temperature": 0}


def _start(model_dir, adapter_dirs, allowed_dir) -> tuple[RunningServer, object]:
    engine = make_engine(model_dir, engine_core="process")
    registry = AdapterRegistry(engine.model_info)
    for name, path in adapter_dirs.items():
        register_adapter(engine, registry, AdapterSpec(name, str(path)))
    settings = ServerSettings(allow_runtime_lora_updating=True, lora_allowed_dirs=[allowed_dir])
    url, running = start_server(build_app(engine, registry, settings))
    return RunningServer(url, engine, registry, model_dir), running


@pytest.fixture(scope="module")
def process_server(model_dir, adapter_dirs, allowed_dir) -> Iterator[RunningServer]:
    running_server, running = _start(model_dir, adapter_dirs, allowed_dir)
    yield running_server
    stop_server(running)
    running_server.engine.shutdown()


def _client(running: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.v1, api_key="unused", max_retries=0)


@pytest.mark.parametrize("model", ["tiny", "alpha", "beta", "gamma"])
def test_streamed_chat_matches_the_thread_engine_server(process_server, server, model):
    base = process_server.engine.model_name
    name = base if model == "tiny" else model
    messages = [{"role": "user", "content": "Where is the treasure?"}]

    def streamed(running: RunningServer) -> str:
        stream = _client(running).chat.completions.create(model=name, messages=messages, stream=True, **GREEDY)
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    def whole(running: RunningServer):
        return _client(running).completions.create(model=name, prompt="Once upon a time", logprobs=2, **GREEDY)

    assert streamed(process_server) == streamed(server)
    got, expected = whole(process_server), whole(server)
    assert got.choices[0].text == expected.choices[0].text and got.usage == expected.usage
    assert got.choices[0].logprobs.tokens == expected.choices[0].logprobs.tokens


def test_an_adapter_loaded_over_rest_serves_from_the_engine_process(process_server, allowed_dir):
    with httpx.Client(base_url=process_server.base_url, timeout=60) as http:
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "delta", "lora_path": str(allowed_dir / "delta")})
        assert loaded.status_code == 200, loaded.text
        listed = {entry["name"]: entry for entry in http.get("/v1/lora_adapters").json()["data"]}
        assert listed["delta"]["residency"] == "host"  # the engine process holds its weights
        reply = http.post("/v1/completions", json={"model": "delta", "prompt": "Hello", **GREEDY})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "delta"}).status_code == 200


def test_a_malformed_request_is_a_400_and_the_engine_process_serves_on(process_server):
    with httpx.Client(base_url=process_server.base_url, timeout=60) as http:
        reply = http.post("/v1/completions", json={"model": "alpha", "prompt": "x", "max_tokens": 100_000})
        assert reply.status_code == 400 and "maximum context length" in reply.json()["error"]["message"]
        assert http.post("/v1/completions", json={"model": "alpha", "prompt": "x", **GREEDY}).status_code == 200
        assert http.get("/health").status_code == 200


def test_a_client_that_leaves_mid_stream_frees_its_blocks(process_server):
    body = {"model": "alpha", "prompt": "Hello", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=process_server.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            next(response.iter_lines())
    stats = process_server.wait_idle()
    assert stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0


def test_metrics_read_the_engine_process(process_server):
    with httpx.Client(base_url=process_server.base_url, timeout=60) as http:
        text = http.get("/metrics").text
    assert "loraserve_kv_blocks_total 128.0" in text and "loraserve_lora_slots_total 2.0" in text


def test_once_the_engine_process_dies_health_and_requests_say_503(model_dir, adapter_dirs, allowed_dir):
    running_server, running = _start(model_dir, {}, allowed_dir)
    try:
        with httpx.Client(base_url=running_server.base_url, timeout=60) as http:
            assert http.get("/health").status_code == 200
            os.kill(running_server.engine._process.pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while running_server.engine.alive and time.monotonic() < deadline:
                time.sleep(0.05)
            assert http.get("/health").status_code == 503
            reply = http.post("/v1/completions", json={"prompt": "Hello", **GREEDY})
            assert reply.status_code == 503
            assert reply.json()["error"]["message"] == "the engine process exited with code -9"
    finally:
        stop_server(running)
        running_server.engine.shutdown()


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not Path(f"/proc/{pid}").exists()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads a process's children from /proc")
def test_ctrl_c_stops_the_cli_server_and_its_engine_process(model_dir, tmp_path):
    """`loraserve serve --engine-core process` as a user starts it: it serves, and a Ctrl-C (SIGINT) ends the server
    cleanly with no engine process left behind."""
    port = _free_port()
    log = tmp_path / "server.log"
    command = [sys.executable, "-m", "openai_server.cli", "serve", str(model_dir), "--dtype", "float32", "--device",
               "cpu", "--engine-core", "process", "--port", str(port), "--log-level", "info"]
    with log.open("w") as out:
        server = subprocess.Popen(command, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        children = _children(server.pid)
        assert children, log.read_text()
        reply = httpx.post(url + "/v1/completions", json={"prompt": "Hello", **GREEDY}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 0, log.read_text()
        assert "Traceback" not in log.read_text(), log.read_text()
        assert all(_gone(child) for child in children), log.read_text()
    finally:
        if server.poll() is None:
            server.kill()
