"""The engine core in its own process on a GPU (what `loraserve serve` runs there): CUDA graphs and Triton kernels in
the child, the same greedy tokens as the engine in this process."""
from __future__ import annotations

import asyncio

import pytest
import torch

from engine import AsyncEngine, EngineConfig, EngineCoreClient, LoRARequest, SamplingParams, start_async_engine
from tests.tiny_models import make_peft_adapter

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

PROMPTS = ["Hello world", "The capital of France is", "def add(a, b):", "SELECT name FROM"] * 4
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def loras(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("core-cuda-adapters")
    return [LoRARequest(f"a{i}", i + 1, str(make_peft_adapter(tiny_llama, root / f"a{i}", r=8, seed=30 + i)))
            for i in range(3)]


def _generate(engine, loras) -> list[list[int]]:
    async def one(prompt, lora):
        final = None
        async for final in engine.generate(prompt, PARAMS, lora_request=lora):
            pass
        return final.outputs[0].token_ids

    async def main():
        return await asyncio.gather(*(one(p, [None, *loras][i % 4]) for i, p in enumerate(PROMPTS)))

    return asyncio.run(main())


def test_the_engine_process_on_cuda_gives_the_in_process_engines_tokens(tiny_llama, loras):
    config = EngineConfig(model=str(tiny_llama), dtype="float32", device="cuda", enable_lora=True, max_loras=3,
                          max_lora_rank=8, max_num_seqs=16)
    results = []
    for engine in (EngineCoreClient(config), AsyncEngine(config)):
        try:
            results.append(_generate(engine, loras))
        finally:
            engine.shutdown()
    assert results[0] == results[1]


def test_auto_puts_the_engine_core_in_a_process_on_one_gpu(tiny_llama):
    engine = start_async_engine(EngineConfig(model=str(tiny_llama), dtype="float32", device="cuda"), "auto")
    try:
        assert isinstance(engine, EngineCoreClient) and engine.device.type == "cuda"
    finally:
        engine.shutdown()
