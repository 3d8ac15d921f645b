"""A client that goes away mid-stream leaves nothing behind in the engine."""
from __future__ import annotations

import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


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
