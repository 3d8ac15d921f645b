"""A prefill step on the LoRA segment path with the expands folded into the fused ops' tiled variants decodes
exactly as with the expands run on their own (`LORASERVE_LORA_FOLD=0`), on the Triton kernels.

Without CUDA the Triton kernels run under the interpreter, which Triton picks when it is imported: the test
runs in a fresh interpreter process unless this one can run them already.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from kernels import lora_tuning
from tests.fresh_interpreter import run_pytest_interpreted, triton_interpreted_here
from tests.kernels.lora_cases import record_calls
from tests.tiny_models import make_peft_adapter

TRITON_HERE = triton_interpreted_here()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled Triton kernels take CUDA tensors
# about 50 tokens each: the adapters' prompts share a step of more than SGMV_MIN_TOKENS tokens
PROMPTS = [2 * text for text in [
    "The capital of France is Paris. The capital of Italy is Rome. The capital of ",
    "Hello world! How are you today? I am fine, thank you. Hello world! How are ",
    "SELECT name FROM users WHERE age > 30; SELECT name FROM users WHERE age > ",
    "Ahoy matey, the sea be calm and the rum be sweet. Ahoy matey, the sea be ",
]]
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def _greedy_tokens(model_dir: Path, loras: list[LoRARequest | None]) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32", device=DEVICE, enforce_eager=True, enable_lora=True, max_loras=2,
              max_lora_rank=8)
    outputs = llm.generate(PROMPTS, PARAMS, lora_request=loras, use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


@pytest.mark.skipif(not TRITON_HERE, reason="runs in a fresh interpreter (the next test)")
def test_a_folded_prefill_on_the_segment_path_decodes_as_the_unfolded_one(tiny_llama, tmp_path, monkeypatch):
    from kernels import fused_lora_tiles_triton

    monkeypatch.setenv("LORASERVE_FUSED_BACKEND", "triton")
    monkeypatch.setenv("LORASERVE_LORA_BACKEND", "triton")
    adapters = [LoRARequest(f"a{seed}", seed, str(make_peft_adapter(tiny_llama, tmp_path / f"a{seed}", r=8,
                                                                     seed=seed)))
                for seed in (1, 2)]
    loras = [adapters[0], None, adapters[1], adapters[0]]
    launches = record_calls(monkeypatch, fused_lora_tiles_triton, "_silu_and_mul_tiles_kernel",
                            "_add_rms_norm_tiles_kernel", "_rotary_tiles_kernel")
    monkeypatch.setenv(lora_tuning.FOLD_EXPAND_ENV, "1")
    folded = _greedy_tokens(tiny_llama, loras)
    assert {call.name for call in launches} == {"_silu_and_mul_tiles_kernel", "_rotary_tiles_kernel"}, \
        "a step took the segment path, and o and down expanded there (lora_tuning.FOLDED_OPS)"
    launches.clear()
    monkeypatch.setenv(lora_tuning.FOLD_EXPAND_ENV, "0")
    assert _greedy_tokens(tiny_llama, loras) == folded
    assert not launches


@pytest.mark.skipif(TRITON_HERE, reason="the Triton kernels ran in this process")
def test_in_a_fresh_interpreter():
    assert "1 passed" in run_pytest_interpreted(Path(__file__), "segment_path")
