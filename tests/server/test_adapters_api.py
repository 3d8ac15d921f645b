"""Adapters over REST: vLLM's load/unload endpoints, /v1/models and /v1/lora_adapters."""
from __future__ import annotations

from pathlib import Path

import pytest

GREEDY = {"prompt": "Hello world!", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _model_ids(http) -> list[str]:
    return [card["id"] for card in http.get("/v1/models").json()["data"]]


def _adapter(http, name: str) -> dict | None:
    return next((a for a in http.get("/v1/lora_adapters").json()["data"] if a["name"] == name), None)


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
    assert beta["running_requests"] == 0
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
