"""A client that goes away mid-stream leaves nothing behind in the engine."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from adapters_registry import AdapterRegistry
from engine import SamplingParams
from openai_server import ServerSettings, build_app

from .conftest import RunningServer, make_engine, start_server, stop_server


def _aborted(http, adapter: str) -> float:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "loraserve_requests_finished_total" and sample.labels == {
                "adapter": adapter, "finish_reason": "abort"
            }:
                return sample.value
    return 0.0


def _wait_for_abort_recorded(http, server, adapter: str, count: float, timeout: float = 10.0):
    """Engine stats once the server has recorded the abort (the server notices a disconnect asynchronously)."""
    deadline = time.monotonic() + timeout
    while _aborted(http, adapter) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return server.wait_idle()


def test_disconnect_mid_stream_aborts_and_frees_kv_blocks(server, http):
    before = _aborted(http, "alpha")
    body = {"model": "alpha", "prompt": "Hello", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data:"))[len("data:"):])
            assert first["choices"][0]["finish_reason"] is None
    stats = _wait_for_abort_recorded(http, server, "alpha", before + 1)
    assert _aborted(http, "alpha") == before + 1
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert server.engine.lora_status()[server.registry.lookup("alpha").int_id].running == 0


def test_disconnect_during_whole_response_aborts(server, http):
    before = _aborted(http, "beta")
    body = {"model": "beta", "prompt": "Hello", "max_tokens": 480, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(60, read=0.05)) as client:
        try:
            client.post("/v1/completions", json=body)
        except httpx.ReadTimeout:
            pass
    stats = _wait_for_abort_recorded(http, server, "beta", before + 1)
    assert _aborted(http, "beta") == before + 1
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)


@pytest.fixture(scope="module")
def one_seq_server(model_dir):
    """A server that runs one sequence at a time, so a second request waits in the queue."""
    engine = make_engine(model_dir, enable_lora=False, max_num_seqs=1)
    url, running = start_server(build_app(engine, AdapterRegistry(engine.model_info), ServerSettings()))
    yield RunningServer(url, engine, None, model_dir)
    stop_server(running)
    engine.shutdown()


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 8}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 8, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}),
    ("/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 8}}),
], ids=["completions", "completions-stream", "chat", "tgi"])
def test_a_client_gone_while_its_request_is_queued_is_aborted_at_once(one_seq_server, route, body):
    """vLLM cancels a request whose client goes while it waits; it must not be prefilled later for nobody."""
    engine = one_seq_server.engine
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    queued = [engine.call(lambda: engine.engine.add_request("Hi", long)) for _ in range(20)]  # seconds of work
    try:
        with httpx.Client(base_url=one_seq_server.base_url, timeout=httpx.Timeout(60, read=0.3)) as impatient:
            with pytest.raises(httpx.ReadTimeout):
                impatient.post(route, json=body)
        deadline = time.monotonic() + 10
        while set(engine.call(lambda: list(engine.engine.requests))) - set(queued) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert set(engine.call(lambda: list(engine.engine.requests))) <= set(queued)
    finally:
        engine.call(lambda: [engine.engine.abort(request_id) for request_id in queued])
    one_seq_server.wait_idle()
