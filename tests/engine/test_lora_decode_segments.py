"""Per-token-sized steps whose rows share few adapters of rank 64 (from 32 rows) or 32 (from 64) run the LoRA kernels
in segments (`lora_tuning.step_path`, `LoRAMetadata.in_segments`): an engine whose 32-row decode steps take the SGMV
kernels at rank 64 generates the tokens it generates with `LORASERVE_LORA_DECODE_SEGMENTS=0`, on the per-token ones.

Without CUDA the Triton kernels run under the interpreter, which Triton picks when it is imported: the test runs in
a fresh interpreter process unless this one can run it already. The GPU tests replay the decode graphs captured in
segments, for rows that share few adapters (32 rows) and for rows spread over many (96 rows), with other steps' slots
against eager steps on the per-token path.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from kernels import lora_tuning
from tests.engine.recording_graph import record_replays
from tests.fresh_interpreter import run_pytest_interpreted, triton_interpreted_here
from tests.kernels.lora_cases import record_calls
from tests.tiny_models import make_peft_adapter

TRITON_HERE = triton_interpreted_here()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled Triton kernels take CUDA tensors
# 32 rows: 16 on one adapter, 8 on another, 8 on the base model (12 adapter rows per adapter: few adapters); the
# prompts' first tokens come from prefill steps, the second from a decode step of all 32 rows
ROW_ADAPTERS = [0] * 16 + [1] * 8 + [None] * 8
# 96 rows over 16 adapters (6 rows each: spread), from 80 rows in segments at rank 64
SPREAD_ROW_ADAPTERS = [i % 16 for i in range(96)]
PROMPTS = ["Hello world", "The capital of France is", "def add(a, b):", "SELECT name FROM"] * 8
PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
GPU_PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)  # 7 decode steps a batch
RANK = 64


def _adapters(model_dir: Path, root: Path, count: int = 2) -> list[LoRARequest]:
    return [LoRARequest(f"a{seed}", seed, str(make_peft_adapter(model_dir, root / f"a{seed}", r=RANK, seed=seed)))
            for seed in range(1, count + 1)]


def _loras(adapters: list[LoRARequest], rows: list[int | None]) -> list[LoRARequest | None]:
    return [None if i is None else adapters[i] for i in rows]


def _record_decode_paths(monkeypatch, llm: LLM) -> list[tuple[int, str]]:
    """The rows and the LoRA path of each decode-only step with adapter rows that the runner builds."""
    seen: list[tuple[int, str]] = []
    build_step = llm.engine.runner.build_step

    def recording(scheduled, adapter_slots):
        step = build_step(scheduled, adapter_slots)
        if step.attention.decode_only and step.lora is not None:
            seen.append((len(adapter_slots), step.lora.meta.path))
        return step

    monkeypatch.setattr(llm.engine.runner, "build_step", recording)
    return seen


@pytest.mark.skipif(not TRITON_HERE, reason="runs in a fresh interpreter (test_in_a_fresh_interpreter)")
def test_decode_steps_of_many_rows_on_few_adapters_run_in_segments_and_generate_the_per_token_tokens(
        tiny_llama, tmp_path, monkeypatch):
    from kernels import lora_triton

    monkeypatch.setenv("LORASERVE_FUSED_BACKEND", "triton")
    monkeypatch.setenv("LORASERVE_LORA_BACKEND", "triton")
    adapters = _adapters(tiny_llama, tmp_path)
    launches = record_calls(monkeypatch, lora_triton, "_shrink_sgmv_kernel", "_shrink_bgmv_kernel")
    tokens = {}
    for switch, path in (("1", "sgmv"), ("0", "bgmv")):
        monkeypatch.setenv(lora_tuning.DECODE_SEGMENTS_ENV, switch)
        llm = LLM(str(tiny_llama), dtype="float32", device=DEVICE, enforce_eager=True, enable_lora=True, max_loras=2,
                  max_lora_rank=RANK)
        for lora in adapters:  # read now: the first step admits every request, so a decode step holds all rows
            llm.engine.lora_manager.add(lora)
        decode_paths = _record_decode_paths(monkeypatch, llm)
        launches.clear()
        tokens[switch] = [o.outputs[0].token_ids for o in
                          llm.generate(PROMPTS, PARAMS, lora_request=_loras(adapters, ROW_ADAPTERS), use_tqdm=False)]
        assert decode_paths == [(32, path)]
        # a decode step's 4 shrinks a layer (qkv, o, gate/up, down) of 32 rows; the prefill steps' are fewer rows
        layers = llm.engine.model.config.num_hidden_layers
        decode_shrinks = [call.name for call in launches if call.args[0].shape[0] == 32]
        assert decode_shrinks == [f"_shrink_{path}_kernel"] * (4 * layers)
    assert tokens["1"] == tokens["0"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [ROW_ADAPTERS, SPREAD_ROW_ADAPTERS], ids=["shared", "spread"])
def test_segment_decode_graphs_replay_other_steps_slots_as_per_token_eager_steps_run(tiny_llama, tmp_path,
                                                                                    monkeypatch, rows):
    """The segment graph of the rows' bucket, captured with padding slots, replayed for two batches whose rows use
    the adapters in other orders, gives the tokens of eager steps on the per-token path."""
    count = max(i for i in rows if i is not None) + 1
    adapters = _adapters(tiny_llama, tmp_path, count)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(rows))]
    # every row in one decode batch (max_num_seqs defaults to 64)
    kwargs = dict(device="cuda", dtype="float32", enable_lora=True, max_loras=count, max_lora_rank=RANK,
                  max_num_seqs=len(rows))
    monkeypatch.delenv(lora_tuning.DECODE_SEGMENTS_ENV, raising=False)
    graphs = LLM(str(tiny_llama), **kwargs)
    monkeypatch.setenv(lora_tuning.DECODE_SEGMENTS_ENV, "0")
    eager = LLM(str(tiny_llama), enforce_eager=True, **kwargs)
    for llm in (graphs, eager):
        for lora in adapters:
            llm.engine.lora_manager.add(lora)
    replayed = record_replays(graphs)
    for order in (rows, list(reversed(rows))):
        replayed.clear()
        segments = graphs.generate(prompts, GPU_PARAMS, lora_request=_loras(adapters, order), use_tqdm=False)
        assert any(key.segments for key in replayed)
        per_token = eager.generate(prompts, GPU_PARAMS, lora_request=_loras(adapters, order), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in segments] == [o.outputs[0].token_ids for o in per_token]


@pytest.mark.skipif(TRITON_HERE, reason="the Triton kernels ran in this process")
def test_in_a_fresh_interpreter():
    assert "1 passed" in run_pytest_interpreted(Path(__file__), "not fresh_interpreter and not graph")
