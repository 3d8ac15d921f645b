"""Adapters over REST: vLLM's load/unload endpoints, /v1/models and /v1/lora_adapters."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

GREEDY = {"prompt": "Hello world!", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _model_ids(http) -> list[str]:
    return [card["id"] for card in http.get("/v1/models").json()["data"]]


def _adapter(http, name: str) -> dict | None:
    return next((a for a in http.get("/v1/lora_adapters").json()["data"] if a["name"] == name), None)


def _running_requests_gauge(http) -> dict[str, float]:
    return {
        sample.labels["adapter"]: sample.value
        for family in text_string_to_metric_families(http.get("/metrics").text)
        for sample in family.samples if sample.name == "loraserve_adapter_running_requests"
    }


@contextmanager
def _engine_held_once_a_token_is_out(engine) -> Iterator[None]:
    """The engine takes no more steps once a step has put out a token (it still runs commands: loads, status
    reads, aborts), so a running request stays running for as long as a test looks at it."""
    held = threading.Event()
    step, unfinished = engine.step, engine.has_unfinished_requests

    def step_then_hold():
        outputs = step()
        if any(output.outputs[0].token_ids for output in outputs):
            held.set()
        return outputs

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "step", step_then_hold)
        patch.setattr(engine, "has_unfinished_requests", lambda: unfinished() and not held.is_set())
        yield


def _load_delta(http, allowed_dir, name: str, **extra) -> None:
    body = {"lora_name": name, "lora_path": str(allowed_dir / "delta"), **extra}
    assert http.post("/v1/load_lora_adapter", json=body).status_code == 200


@contextmanager
def _a_request_running(http, server, allowed_dir, name: str) -> Iterator[None]:
    """Load an adapter and start a streamed request for it, which runs until the client goes on exit."""
    _load_delta(http, allowed_dir, name)
    body = {"model": name, "prompt": "Hello", "max_tokens": 8, "logprobs": 0, "stream": True}  # an event a token
    with _engine_held_once_a_token_is_out(server.engine.engine):
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()  # kept: closing it would close the connection
                next(line for line in lines if line.startswith("data:"))
                yield
        server.wait_idle()


def test_models_lists_base_then_adapters_with_parent(http, server, adapter_dirs):
    cards = http.get("/v1/models").json()["data"]
    base, *adapters = cards
    assert base["id"] == str(server.model_dir) and base["parent"] is None and base["max_model_len"] == 512
    by_id = {card["id"]: card for card in adapters}
    assert {"alpha", "beta", "gamma"} <= set(by_id)
    assert by_id["alpha"]["root"] == str(adapter_dirs["alpha"])
    assert by_id["alpha"]["parent"] == base["id"]
    assert all(set(card) == {"id", "object", "created", "owned_by", "root", "parent", "max_model_len"} for card in cards)


def test_lora_adapters_reports_rank_modules_residency_and_load_time(http):
    http.post("/v1/completions", json={"model": "beta", **GREEDY})
    beta = _adapter(http, "beta")
    assert beta["rank"] == 6
    assert set(beta["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert beta["residency"] == "slot"  # it just ran: its slot still holds it (not "gpu": this server has none)
    assert beta["running_requests"] == 0 and beta["unloaded"] is False
    assert beta["load_seconds"] >= 0 and beta["loaded_at"] > 0


def test_load_use_unload_cycle(http, server, allowed_dir):
    path = str(allowed_dir / "delta")
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "delta", "lora_path": path})
    assert response.status_code == 200
    assert response.text == "Success: LoRA adapter 'delta' added successfully."
    assert "delta" in _model_ids(http)
    entry = _adapter(http, "delta")
    assert entry["rank"] == 8

    used = http.post("/v1/completions", json={"model": "delta", **GREEDY})
    assert used.status_code == 200 and used.json()["model"] == "delta"
    server.wait_idle()

    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "delta"})
    assert response.status_code == 200
    assert response.text == "Success: LoRA adapter 'delta' removed successfully."
    assert "delta" not in _model_ids(http)
    assert http.post("/v1/completions", json={"model": "delta", **GREEDY}).status_code == 404
    assert entry["id"] not in server.engine.lora_status()  # slot and host copy freed, not just the name


def test_an_adapter_unloaded_while_its_request_runs_is_listed_as_unloaded_until_the_request_ends(
        http, server, allowed_dir):
    with _a_request_running(http, server, allowed_dir, "zeta"):
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "zeta"}).status_code == 200
        zeta = _adapter(http, "zeta")
        assert zeta["unloaded"] is True and zeta["running_requests"] == 1 and zeta["residency"] == "slot"
    assert _adapter(http, "zeta") is None


def test_running_requests_gauge_counts_an_unloaded_adapter_until_its_request_ends(http, server, allowed_dir):
    with _a_request_running(http, server, allowed_dir, "eta"):
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "eta"}).status_code == 200
        assert _running_requests_gauge(http)["eta"] == 1
    assert "eta" not in _running_requests_gauge(http)


def test_an_adapter_replaced_in_place_while_its_request_runs_is_listed_twice_and_counted_once(
        http, server, allowed_dir):
    """The old version stays listed, as unloaded, beside the new one; the gauge counts both under the one name."""
    with _a_request_running(http, server, allowed_dir, "theta"):
        _load_delta(http, allowed_dir, "theta", load_inplace=True)
        listed = [a for a in http.get("/v1/lora_adapters").json()["data"] if a["name"] == "theta"]
        assert [(a["unloaded"], a["running_requests"]) for a in listed] == [(False, 0), (True, 1)]
        assert _running_requests_gauge(http)["theta"] == 1
    assert [a["unloaded"] for a in http.get("/v1/lora_adapters").json()["data"] if a["name"] == "theta"] == [False]
    http.post("/v1/unload_lora_adapter", json={"lora_name": "theta"})


def test_unload_unknown_adapter_is_404(http):
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "The lora adapter 'never-loaded' cannot be found."


def test_duplicate_load_without_inplace_is_400(http, adapter_dirs):
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "alpha", "lora_path": str(adapter_dirs["beta"])})
    assert response.status_code == 400
    assert "already been loaded" in response.json()["error"]["message"]


def test_inplace_reload_serves_the_new_weights(http, server, allowed_dir):
    path = str(allowed_dir / "delta")
    http.post("/v1/load_lora_adapter", json={"lora_name": "epsilon", "lora_path": path})
    old_id = _adapter(http, "epsilon")["id"]
    before = http.post("/v1/completions", json={"model": "epsilon", **GREEDY}).json()["choices"][0]["text"]
    server.wait_idle()
    other = server.registry.lookup("gamma").path  # gamma lives outside the allowed dir: copy its files in
    replacement = allowed_dir / "gamma-copy"
    replacement.mkdir(exist_ok=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (replacement / name).write_bytes((Path(other) / name).read_bytes())
    response = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "epsilon", "lora_path": str(replacement), "load_inplace": True}
    )
    assert response.status_code == 200
    after = http.post("/v1/completions", json={"model": "epsilon", **GREEDY}).json()["choices"][0]["text"]
    gamma = http.post("/v1/completions", json={"model": "gamma", **GREEDY}).json()["choices"][0]["text"]
    assert after == gamma != before
    server.wait_idle()
    assert old_id not in server.engine.lora_status()
    http.post("/v1/unload_lora_adapter", json={"lora_name": "epsilon"})


@pytest.mark.parametrize("body", [{"lora_name": "x"}, {"lora_path": "/tmp"}, {}], ids=["no_path", "no_name", "empty"])
def test_load_without_name_and_path_is_400(http, body):
    response = http.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."


def test_load_outside_allowed_dirs_is_forbidden(http, adapter_dirs, allowed_dir):
    outside = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapter_dirs["alpha"])})
    escape = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(allowed_dir / ".." / "x")})
    assert outside.status_code == escape.status_code == 403
    assert "outside the allowed directories" in outside.json()["error"]["message"]
    assert "x" not in _model_ids(http)


def test_load_missing_path_is_404(http, allowed_dir):
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(allowed_dir / "missing")})
    assert response.status_code == 404


def test_corrupt_adapter_is_400_and_server_keeps_serving(http, allowed_dir):
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(allowed_dir / "corrupt")})
    assert response.status_code == 400
    assert "safetensors" in response.json()["error"]["message"].lower()
    assert "bad" not in _model_ids(http)
    assert http.post("/v1/completions", json={"model": "alpha", **GREEDY}).status_code == 200
