"""Per-token steps whose rows share few adapters hand the SiLU·up fold to its tiled variant
(`lora_tuning.tiled_decode_ops`): a projection's delta marked tiled takes the tiled kernel on a per-token-sized
step and adds exactly what the unfused expand does, and an engine whose decode steps tile generates the tokens
it generates with `LORASERVE_LORA_DECODE_TILES=0`, on the Triton kernels.

Without CUDA the Triton kernels run under the interpreter, which Triton picks when it is imported: the tests
run in a fresh interpreter process unless this one can run them already. The GPU test replays the tiled decode
graphs with other steps' slots against eager steps.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kernels
from engine import LLM, LoRARequest, SamplingParams
from engine.model import LoRALinear
from engine.step_input import LoRAStep
from kernels import lora_tuning
from tests.engine.recording_graph import record_replays
from tests.fresh_interpreter import run_pytest_interpreted, triton_interpreted_here
from tests.kernels.lora_cases import record_calls, same_op
from tests.tiny_models import make_peft_adapter

TRITON_HERE = triton_interpreted_here()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled Triton kernels take CUDA tensors
FOLD = frozenset({"silu_and_mul"})
# 32 rows: 16 on one adapter, 8 on another, 8 on the base model (12 adapter rows per adapter: tiled); the
# prompts' first tokens come from prefill steps, the second from a decode step of all 32 rows
ROW_ADAPTERS = [0] * 16 + [1] * 8 + [None] * 8
PROMPTS = ["Hello world", "The capital of France is", "def add(a, b):", "SELECT name FROM"] * 8
PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
GPU_PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)  # 7 decode steps a batch


def _exact(gen: torch.Generator, *shape: int, scale: int) -> torch.Tensor:
    """Multiples of 1/scale in [-1, 1]: every float32 sum below is exact, in any order."""
    return torch.randint(-scale, scale + 1, shape, generator=gen).div(scale).to(DEVICE)


def _gate_up_linear(width: int, rank: int) -> LoRALinear:
    gen = torch.Generator().manual_seed(0)
    linear = LoRALinear(16, [width, width], False, ["gate_proj", "up_proj"], "silu_and_mul").to(DEVICE)
    linear.weight.copy_(_exact(gen, 2 * width, 16, scale=4))
    linear.lora_a = [_exact(gen, 2, rank, 16, scale=4) for _ in range(2)]
    linear.lora_b = [_exact(gen, 2, width, rank, scale=8) for _ in range(2)]
    return linear


@pytest.mark.skipif(not TRITON_HERE, reason="runs in a fresh interpreter (test_in_a_fresh_interpreter)")
def test_a_tiled_fold_on_a_per_token_step_equals_the_expand_then_silu(monkeypatch):
    from kernels import fused_lora_tiles_triton, fused_triton

    slots = torch.tensor([1] * 20 + [-1] * 4 + [0] * 8, dtype=torch.int32, device=DEVICE)  # 32 rows: per token
    assert lora_tuning.choose_path(len(slots)) == "bgmv"
    linear = _gate_up_linear(width=40, rank=8)
    x = _exact(torch.Generator().manual_seed(1), len(slots), 16, scale=4)
    meta = kernels.prepare_lora_metadata(slots, 2)
    launches = record_calls(monkeypatch, fused_lora_tiles_triton, "_silu_and_mul_tiles_kernel")
    base, delta = linear(x, LoRAStep(meta, fold_into=FOLD, tiled_folds=FOLD))
    got = fused_triton.silu_and_mul(base, delta)
    assert [call.name for call in launches] == ["_silu_and_mul_tiles_kernel"]
    unfused, _ = linear(x, LoRAStep(meta))
    same_op(got, fused_triton.silu_and_mul(unfused))


def _greedy_tokens(llm: LLM, adapters: list[LoRARequest]) -> list[list[int]]:
    loras = [None if i is None else adapters[i] for i in ROW_ADAPTERS]
    outputs = llm.generate(PROMPTS, PARAMS, lora_request=loras, use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def _adapters(model_dir: Path, root: Path) -> list[LoRARequest]:
    return [LoRARequest(f"a{seed}", seed, str(make_peft_adapter(model_dir, root / f"a{seed}", r=8, seed=seed)))
            for seed in (1, 2)]


def _record_decode_tiles(monkeypatch, llm: LLM) -> list[tuple[int, frozenset[str]]]:
    """The rows and the tiled folds of each decode-only step with adapter rows that the runner builds."""
    seen: list[tuple[int, frozenset[str]]] = []
    build_step = llm.engine.runner.build_step

    def recording(scheduled, adapter_slots):
        step = build_step(scheduled, adapter_slots)
        if step.attention.decode_only and step.lora is not None:
            seen.append((len(adapter_slots), step.lora.tiled_folds))
        return step

    monkeypatch.setattr(llm.engine.runner, "build_step", recording)
    return seen


@pytest.mark.skipif(not TRITON_HERE, reason="runs in a fresh interpreter (test_in_a_fresh_interpreter)")
def test_decode_steps_of_many_rows_on_few_adapters_tile_and_generate_the_untiled_tokens(tiny_llama, tmp_path,
                                                                                      monkeypatch):
    from kernels import fused_lora_tiles_triton

    monkeypatch.setenv("LORASERVE_FUSED_BACKEND", "triton")
    monkeypatch.setenv("LORASERVE_LORA_BACKEND", "triton")
    adapters = _adapters(tiny_llama, tmp_path)
    launches = record_calls(monkeypatch, fused_lora_tiles_triton, "_silu_and_mul_tiles_kernel")
    tokens = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(lora_tuning.DECODE_TILES_ENV, switch)
        llm = LLM(str(tiny_llama), dtype="float32", device=DEVICE, enforce_eager=True, enable_lora=True, max_loras=2,
                  max_lora_rank=8)
        for lora in adapters:  # read now: the first step admits every request, so a decode step holds all rows
            llm.engine.lora_manager.add(lora)
        decode_tiles = _record_decode_tiles(monkeypatch, llm)
        launches.clear()
        tokens[switch] = _greedy_tokens(llm, adapters)
        # a step's tiled SiLU·up runs once per layer; the prefill steps' ones are on the segment path
        decode_launches = [call.args[0].shape[0] for call in launches
                           if lora_tuning.choose_path(call.args[0].shape[0]) == "bgmv"]
        assert decode_tiles and all(rows >= 32 for rows, _ in decode_tiles)
        assert all(tiled == (FOLD if switch == "1" else frozenset()) for _, tiled in decode_tiles)
        layers = llm.engine.model.config.num_hidden_layers
        assert decode_launches == [rows for rows, _ in decode_tiles for _ in range(layers)] * (switch == "1")
    assert tokens["1"] == tokens["0"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tiled_decode_graphs_replay_other_steps_slots_as_untiled_eager_steps_run(tiny_llama, tmp_path, monkeypatch):
    """The tiled graph of the 32-row bucket, captured with padding slots, replayed for two batches whose rows use
    the adapters in other orders, gives the tokens of eager steps on the per-token fold."""
    adapters = _adapters(tiny_llama, tmp_path)
    kwargs = dict(device="cuda", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    monkeypatch.delenv(lora_tuning.DECODE_TILES_ENV, raising=False)
    graphs, eager = LLM(str(tiny_llama), **kwargs), LLM(str(tiny_llama), enforce_eager=True, **kwargs)
    for llm in (graphs, eager):
        for lora in adapters:
            llm.engine.lora_manager.add(lora)
    replayed = record_replays(graphs)
    for rows in (ROW_ADAPTERS, list(reversed(ROW_ADAPTERS))):
        loras = [None if i is None else adapters[i] for i in rows]
        monkeypatch.setenv(lora_tuning.DECODE_TILES_ENV, "1")
        replayed.clear()
        tiled = graphs.generate(PROMPTS, GPU_PARAMS, lora_request=loras, use_tqdm=False)
        assert any(key.tiled_folds == FOLD for key in replayed)
        monkeypatch.setenv(lora_tuning.DECODE_TILES_ENV, "0")
        untiled = eager.generate(PROMPTS, GPU_PARAMS, lora_request=loras, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in tiled] == [o.outputs[0].token_ids for o in untiled]


@pytest.mark.skipif(TRITON_HERE, reason="the Triton kernels ran in this process")
def test_in_a_fresh_interpreter():
    assert "2 passed" in run_pytest_interpreted(Path(__file__), "not fresh_interpreter and not graph")
