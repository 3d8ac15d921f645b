"""An adapter of a lower rank than the slots' max rank is served without reading its slot's zero padding: the
Triton kernels stop at each slot's rank (`LoRAManager.slot_ranks`; B's columns at the rank rounded up to whole
vectors), so padding past that poisoned with NaN after every slot write changes no token, in eager steps and in
CUDA-graph replays captured before any adapter was loaded.

Without CUDA the Triton kernels run under the interpreter, which Triton picks when it is imported: the tests
run in a fresh interpreter process unless this one can run them already.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.lora_layout import SlotLayout
from tests.engine.recording_graph import record_replays
from tests.fresh_interpreter import run_pytest_interpreted, triton_interpreted_here
from tests.kernels.lora_cases import b_columns_read
from tests.tiny_models import make_peft_adapter

TRITON_HERE = triton_interpreted_here()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_RANK = 16
PROMPTS = ["Hello world", "The capital of France is", "def add(a, b):", "SELECT name FROM"] * 2
PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)  # a prefill step, then a decode step


def _poisoning_padding(write):
    """SlotLayout.write, then NaN in every A row past the row's rank and every B column past those the kernels
    read (`b_columns_read`)."""

    def poisoned(layout: SlotLayout, adapter, row: torch.Tensor) -> int:
        rank = write(layout, adapter, row)
        r_max = layout.max_rank
        [columns] = b_columns_read([rank], r_max)
        for slices in layout.regions:
            for p in slices:
                row[p.a_offset:p.a_offset + r_max * p.in_features].view(r_max, p.in_features)[rank:] = float("nan")
                row[p.b_offset:p.b_offset + p.out_features * r_max].view(p.out_features, r_max)[:, columns:] = \
                    float("nan")
        return rank

    return poisoned


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("ranked")
    return [LoRARequest(f"r{r}", i + 1, str(make_peft_adapter(tiny_llama, root / f"r{r}", r=r, lora_alpha=2 * r,
                                                              seed=40 + i)))
            for i, r in enumerate((4, 8, 5))]


def _tokens(llm: LLM, adapters: list[LoRARequest]) -> list[list[int]]:
    loras = [None if i % 4 == 3 else adapters[i % 3] for i in range(len(PROMPTS))]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, lora_request=loras, use_tqdm=False)]


def _llm(model_dir: Path, **kwargs) -> LLM:
    kwargs = dict(max_lora_rank=MAX_RANK) | kwargs
    return LLM(str(model_dir), dtype="float32", device=DEVICE, enable_lora=True, max_loras=3, adapter_reader="threads",
               **kwargs)


@pytest.mark.skipif(not TRITON_HERE, reason="runs in a fresh interpreter (test_in_a_fresh_interpreter)")
def test_poisoned_padding_past_each_slots_rank_changes_no_token_of_eager_steps(tiny_llama, adapters, monkeypatch):
    monkeypatch.setenv("LORASERVE_FUSED_BACKEND", "triton")
    monkeypatch.setenv("LORASERVE_LORA_BACKEND", "triton")
    clean = _tokens(_llm(tiny_llama, enforce_eager=True), adapters)
    monkeypatch.setattr(SlotLayout, "write", _poisoning_padding(SlotLayout.write))
    llm = _llm(tiny_llama, enforce_eager=True)
    assert _tokens(llm, adapters) == clean
    assert sorted(llm.engine.lora_manager.slot_ranks.on_device.tolist()) == [4, 5, 8]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_graphs_read_the_ranks_of_adapters_loaded_after_capture(tiny_llama, adapters, monkeypatch):
    clean = _tokens(_llm(tiny_llama, enforce_eager=True), adapters)
    monkeypatch.setattr(SlotLayout, "write", _poisoning_padding(SlotLayout.write))
    assert _tokens(_llm(tiny_llama), adapters) == clean


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_steps_of_adapters_that_fit_rank_16_replay_the_graphs_that_read_16_ranks_of_wider_slots(
        tiny_llama, adapters, tmp_path, monkeypatch):
    """Slots of rank 32: steps on ranks 4, 8 and 5 replay the rank-16 graphs and give the eager steps' tokens
    (NaN past the columns the kernels read); steps with a rank-20 adapter replay graphs of the whole width (its
    requests wait for its read, so the other rows may decode without it first)."""
    wide = LoRARequest("r20", 9, str(make_peft_adapter(tiny_llama, tmp_path / "r20", r=20, lora_alpha=40, seed=49)))
    kwargs = dict(max_lora_rank=32)
    clean = _tokens(_llm(tiny_llama, enforce_eager=True, **kwargs), adapters)
    clean_wide = _tokens(_llm(tiny_llama, enforce_eager=True, **kwargs), [adapters[0], wide, adapters[2]])
    monkeypatch.setattr(SlotLayout, "write", _poisoning_padding(SlotLayout.write))
    llm = _llm(tiny_llama, **kwargs)
    replayed = record_replays(llm)
    assert _tokens(llm, adapters) == clean
    assert {key.rank_width for key in replayed if key.with_lora} == {16}
    replayed.clear()
    assert _tokens(llm, [adapters[0], wide, adapters[2]]) == clean_wide
    assert None in {key.rank_width for key in replayed if key.with_lora}


@pytest.mark.skipif(TRITON_HERE, reason="the Triton kernels ran in this process")
def test_in_a_fresh_interpreter():
    assert "1 passed" in run_pytest_interpreted(Path(__file__), "not fresh_interpreter")
