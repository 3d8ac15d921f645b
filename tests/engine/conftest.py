from __future__ import annotations

import pytest
import torch
import transformers

from engine import LLMEngine, EngineConfig


def make_engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu", **overrides))


@pytest.fixture(scope="session")
def llama_engine(tiny_llama):
    return make_engine(tiny_llama)


@pytest.fixture(scope="session")
def hf_llama(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()


def run_to_completion(engine: LLMEngine) -> dict:
    """Step until every request finishes; request id -> final RequestOutput."""
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished
