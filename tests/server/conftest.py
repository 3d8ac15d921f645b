"""Real servers for the tests: a tiny random model and adapters made once, uvicorn on a free loopback port."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from adapters_registry import AdapterRegistry, AdapterSpec
from engine import AsyncEngineBase, EngineConfig, start_async_engine
from openai_server import ServerSettings, build_app
from openai_server.adapters import register_adapter
from tests.tiny_models import make_peft_adapter, make_tiny_model

API_KEY = "test-key"
SERVED_NAMES = ("tiny", "tiny-alias")
ADAPTERS = ("alpha", "beta", "gamma")


@dataclass
class RunningServer:
    base_url: str
    engine: AsyncEngineBase
    registry: AdapterRegistry
    model_dir: Path

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def wait_idle(self, timeout: float = 10.0):
        """Engine stats once nothing runs or waits (requests finish on the engine thread, after the reply)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine.stats()
            if (stats.num_running == 0 and stats.num_waiting == 0) or time.monotonic() > deadline:
                return stats
            time.sleep(0.02)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def adapter_dirs(model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_peft_adapter(model_dir, root / name, seed=i + 1, r=4 + 2 * i, scale=0.5)
        for i, name in enumerate(ADAPTERS)
    }


@pytest.fixture(scope="session")
def allowed_dir(model_dir, tmp_path_factory) -> Path:
    """The directory runtime loads may come from: one good adapter and one corrupt one."""
    root = tmp_path_factory.mktemp("allowed")
    make_peft_adapter(model_dir, root / "delta", seed=7, r=8, scale=0.5)
    corrupt = make_peft_adapter(model_dir, root / "corrupt", seed=8, r=8)
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    return root


def make_engine(model_dir: Path, engine_core: str = "thread", **overrides) -> AsyncEngineBase:
    config = dict(model=str(model_dir), dtype="float32", device="cpu", enable_lora=True, max_loras=2,
                  max_lora_rank=16, max_cpu_loras=4, num_kv_blocks=128)
    config.update(overrides)
    return start_async_engine(EngineConfig(**config), engine_core)


@dataclass
class _Thread:
    server: uvicorn.Server
    thread: threading.Thread


def start_server(app) -> tuple[str, _Thread]:
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    return f"http://127.0.0.1:{port}", _Thread(server, thread)


def stop_server(running: _Thread) -> None:
    running.server.should_exit = True
    running.thread.join(timeout=10)


@pytest.fixture(scope="session")
def server(model_dir, adapter_dirs, allowed_dir) -> Iterator[RunningServer]:
    """The main server: three adapters registered at startup, runtime updating allowed under allowed_dir."""
    engine = make_engine(model_dir)
    registry = AdapterRegistry(engine.model_info)
    for name, path in adapter_dirs.items():
        register_adapter(engine, registry, AdapterSpec(name, str(path)))
    settings = ServerSettings(allow_runtime_lora_updating=True, lora_allowed_dirs=[allowed_dir])
    url, running = start_server(build_app(engine, registry, settings))
    yield RunningServer(url, engine, registry, model_dir)
    stop_server(running)
    engine.shutdown()


@pytest.fixture(scope="session")
def locked_server(model_dir) -> Iterator[RunningServer]:
    """A server with an API key, two names for its base model, and runtime adapter updating left off."""
    engine = make_engine(model_dir, enable_lora=False)
    registry = AdapterRegistry(engine.model_info)
    settings = ServerSettings(api_key=API_KEY, served_model_names=list(SERVED_NAMES))
    url, running = start_server(build_app(engine, registry, settings))
    yield RunningServer(url, engine, registry, model_dir)
    stop_server(running)
    engine.shutdown()


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client
