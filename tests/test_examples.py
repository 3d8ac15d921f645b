"""The scripts in examples/ run as the README tells a new user to run them: against the server `make serve` starts
(the repository's config.yaml: the embedded model with the pirate and sql adapters, runtime loading allowed under
examples/demo_adapters), here on a free loopback port, and the offline one on its own."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from openai_server.config import serve_config_from_args
from openai_server.launch import build_server
from tests.server.conftest import start_server, stop_server

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


@pytest.fixture(scope="module")
def demo_server():
    built = build_server(serve_config_from_args([], environ={}, cwd=REPO))
    url, running = start_server(built.app)
    yield url
    stop_server(running)
    built.engine.shutdown()


def run_example(*command: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_openai_client_streams_the_base_model_and_each_adapter(demo_server):
    out = run_example(sys.executable, str(EXAMPLES / "openai_client.py"), "--base-url", f"{demo_server}/v1",
                      "--max-tokens", "24")
    assert out.startswith("served models: HuggingFaceTB/SmolLM2-135M-Instruct, pirate, sql")
    assert "--- pirate --- What is the capital of France?" in out and "--- sql --- " in out
    assert out.count(" generated tokens]") == 4


def test_tgi_generate_answers_with_and_without_an_adapter_and_streams(demo_server):
    out = run_example(sys.executable, str(EXAMPLES / "tgi_generate.py"), "--url", demo_server)
    assert "--- /generate adapter_id=None" in out and "--- /generate adapter_id=pirate" in out
    assert "--- /generate_stream adapter_id=pirate" in out
    assert " tokens, " in out.rsplit("--- /generate_stream", 1)[1]


@pytest.mark.skipif(shutil.which("curl") is None, reason="the script drives the server with curl")
def test_hot_load_adapter_loads_uses_and_unloads_an_adapter(demo_server):
    out = run_example("bash", str(EXAMPLES / "hot_load_adapter.sh"), env={"URL": demo_server})
    assert "Success: LoRA adapter 'pirate-live' added successfully." in out
    assert '"name":"pirate-live"' in out.replace(" ", "")
    assert "Success: LoRA adapter 'pirate-live' removed successfully." in out
    assert "a request for it now answers HTTP 404" in out


def test_offline_generate_mixes_the_base_model_and_two_adapters_in_one_batch():
    out = run_example(sys.executable, str(EXAMPLES / "offline_generate.py"))
    assert [line.split("]")[0] + "]" for line in out.splitlines() if line.startswith("[")] == [
        "[base]", "[pirate]", "[sql]"]
    assert "SELECT" in out.split("[sql]", 1)[1]
