from __future__ import annotations

import pytest
import torch
import transformers

from engine import LLMEngine, EngineConfig, LoRARequest
from tests.tiny_models import make_peft_adapter


def make_engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu", **overrides))


@pytest.fixture(scope="session")
def rank4_adapters(tiny_llama, tmp_path_factory) -> list[LoRARequest]:
    """Three rank-4 adapters of the tiny Llama, ids 1 to 3."""
    root = tmp_path_factory.mktemp("rank4-adapters")
    return [LoRARequest(f"adapter-{i}", i + 1, str(make_peft_adapter(tiny_llama, root / f"adapter-{i}", r=4, seed=i)))
            for i in range(3)]


@pytest.fixture(scope="session")
def llama_engine(tiny_llama):
    return make_engine(tiny_llama)


@pytest.fixture(scope="session")
def hf_llama(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict:
    """Step until every request finishes; request id -> final RequestOutput."""
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    raise AssertionError(f"requests still unfinished after {max_steps} steps")
