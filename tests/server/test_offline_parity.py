"""Concurrent requests for several adapters and the base give what the offline `LLM.generate` gives."""
from __future__ import annotations

import asyncio

import openai
import pytest

from engine import LLM, LoRARequest, SamplingParams

PROMPTS = ["The capital of France is", "def add(a, b):", "SELECT name FROM users", "Ahoy matey, the sea"]
MODELS = [None, "alpha", "beta", "gamma"]  # None: the base model


@pytest.fixture(scope="module")
def offline_texts(model_dir, adapter_dirs) -> list[str]:
    llm = LLM(str(model_dir), dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_cpu_loras=4)
    requests = [
        None if name is None else LoRARequest(name, i, str(adapter_dirs[name])) for i, name in enumerate(MODELS)
    ]
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), requests,
                           use_tqdm=False)
    return [output.outputs[0].text for output in outputs]


@pytest.mark.anyio
async def test_concurrent_adapters_match_offline_generate(server, offline_texts):
    async with openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:
        responses = await asyncio.gather(*(
            client.completions.create(
                model=name or str(server.model_dir), prompt=prompt, max_tokens=16, temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            for prompt, name in zip(PROMPTS, MODELS)
        ))
    assert [r.choices[0].text for r in responses] == offline_texts
    assert len(set(offline_texts)) == len(offline_texts)
