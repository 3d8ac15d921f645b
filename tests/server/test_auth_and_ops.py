"""API keys, the runtime-updating gate, and the operational routes (/health, /metrics, /version)."""
from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import LoRARequest
from openai_server.metrics import ServerMetrics

from .conftest import API_KEY, SERVED_NAMES


@pytest.fixture(scope="module")
def locked(locked_server):
    with httpx.Client(base_url=locked_server.base_url, timeout=60) as client:
        yield client


def test_missing_key_is_authentication_error(locked_server):
    client = openai.OpenAI(base_url=locked_server.v1, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        client.models.list()
    assert set(caught.value.body) == {"message", "type", "param", "code"}


def test_right_key_is_served(locked_server):
    client = openai.OpenAI(base_url=locked_server.v1, api_key=API_KEY, max_retries=0)
    response = client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
    assert response.usage.completion_tokens >= 1


def test_every_served_name_is_listed_and_reaches_the_base(locked_server):
    client = openai.OpenAI(base_url=locked_server.v1, api_key=API_KEY, max_retries=0)
    assert [model.id for model in client.models.list()] == list(SERVED_NAMES)
    response = client.completions.create(model=SERVED_NAMES[1], prompt="Hello", max_tokens=3)
    assert response.model == SERVED_NAMES[1]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate", "/generate_stream",
                                  "/tokenize", "/detokenize"])
def test_api_routes_need_the_key(locked, path):
    assert locked.post(path, json={}).status_code == 401


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version"])
def test_operational_routes_stay_open(locked, path):
    assert locked.get(path).status_code == 200


def test_runtime_updating_disabled_refuses_load_and_unload(locked):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    load = locked.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"}, headers=auth)
    unload = locked.post("/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=auth)
    assert load.status_code == unload.status_code == 404
    assert "--allow-runtime-lora-updating" in load.json()["error"]["message"]


def test_version_reports_the_package_version(http):
    assert http.get("/version").json()["version"] == "0.1.0"


def test_unknown_route_is_404_in_openai_shape(http):
    response = http.get("/v1/nothing-here")
    assert response.status_code == 404
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def _samples(http) -> dict[tuple[str, tuple], float]:
    text = http.get("/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_count_requests_and_tokens_per_adapter(http, server):
    before = _samples(http)
    http.post("/v1/completions", json={"model": "gamma", "prompt": "Hi", "max_tokens": 5, "ignore_eos": True})
    server.wait_idle()
    after = _samples(http)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("loraserve_requests_total", endpoint="completions", adapter="gamma") == 1
    assert delta("loraserve_generation_tokens_total", adapter="gamma") == 5
    assert delta("loraserve_requests_finished_total", adapter="gamma", finish_reason="length") == 1
    assert delta("loraserve_time_to_first_token_seconds_count", adapter="gamma") == 1
    assert delta("loraserve_time_per_output_token_seconds_count", adapter="gamma") == 1


def test_base_model_requests_are_labelled_with_the_served_name(http, server):
    """Not `base`, which an adapter may be called too."""
    before = _samples(http)
    http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    server.wait_idle()
    served_name = http.get("/v1/models").json()["data"][0]["id"]
    key = ("loraserve_requests_finished_total", (("adapter", served_name), ("finish_reason", "length")))
    assert _samples(http).get(key, 0.0) - before.get(key, 0.0) == 1


def test_metrics_expose_engine_gauges(http):
    samples = {name for name, _ in _samples(http)}
    assert {
        "loraserve_num_requests_running", "loraserve_num_requests_waiting", "loraserve_kv_blocks_used",
        "loraserve_kv_blocks_total", "loraserve_lora_slots_used", "loraserve_lora_slots_total",
        "loraserve_adapter_running_requests", "loraserve_num_preemptions_total", "loraserve_lora_slot_loads_total",
        "loraserve_lora_disk_reads_total",
    } <= samples


def test_time_per_output_token_of_n_choices_divides_by_the_longest_choice():
    """The n choices of a request decode side by side: 8 s after the first tokens, 4 choices of 5 tokens each
    took 2 s a token, not 8 / 19."""
    metrics = ServerMetrics(engine=None, adapters=list, base_label="tiny")
    tracker = metrics.tracker(LoRARequest("a", 1, "/a"))
    tracker.first_token = time.perf_counter() - 8.0
    tracker.finish("length", prompt_tokens=3, generated_tokens=4 * 5, longest_choice=5)
    (family,) = metrics.tpot.collect()
    (total,) = [s.value for s in family.samples if s.name.endswith("_sum") and s.labels == {"adapter": "a"}]
    assert total == pytest.approx(2.0, abs=0.05)
