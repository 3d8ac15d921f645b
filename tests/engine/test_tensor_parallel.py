"""Tensor parallelism on the CPU (gloo, 2 ranks): the sharded engine computes what one process computes."""
from __future__ import annotations

import gc

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.parallel.sharding import shard_tensor
from tests.tiny_models import make_peft_adapter, make_tiny_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "r8-all": dict(r=8, lora_alpha=16, target_modules=ALL, seed=21, rank_pattern={"k_proj": 4}),
    "r4-attention": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], seed=22),
    "r16-rslora-mlp": dict(r=16, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"],
                           use_rslora=True, seed=23),
}
PROMPTS = ["Hello world", "The capital of France is", "def add(a, b):", "SELECT name FROM"]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)


def _adapters(model_dir, root, names) -> list[LoRARequest]:
    return [LoRARequest(name, i + 1, str(make_peft_adapter(model_dir, root / name, **ADAPTERS[name])))
            for i, name in enumerate(names)]


def _llm(model_dir, tensor_parallel_size: int, max_loras: int = 2, **kwargs) -> LLM:
    settings = dict(dtype="float32", device="cpu") | kwargs
    return LLM(str(model_dir), enable_lora=True, max_loras=max_loras, max_lora_rank=16,
               tensor_parallel_size=tensor_parallel_size, **settings)


def _mixed(adapters):
    """Every prompt with the base model and with each adapter, interleaved in one batch."""
    choices = [None, *adapters]
    pairs = [(prompt, choices[(i + j) % len(choices)]) for i, prompt in enumerate(PROMPTS)
             for j in range(len(choices))]
    return [p for p, _ in pairs], [lora for _, lora in pairs]


def _tokens_and_logprobs(outputs):
    results = []
    for output in outputs:
        completion = output.outputs[0]
        logprobs = [entry[token].logprob for entry, token in zip(completion.logprobs, completion.token_ids)]
        results.append((completion.token_ids, logprobs))
    return results


def _assert_same(sharded, single, tolerance: float):
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(_tokens_and_logprobs(sharded),
                                                              _tokens_and_logprobs(single)):
        assert tokens == ref_tokens
        assert logprobs == pytest.approx(ref_logprobs, abs=tolerance)


def _check_matches_single_process(llm, model_dir, prompts, loras, params=PARAMS, tolerance: float = 1e-4,
                                  **kwargs):
    sharded = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    single = _llm(model_dir, 1, **kwargs).generate(prompts, params, lora_request=loras, use_tqdm=False)
    _assert_same(sharded, single, tolerance)
    return sharded, single


@pytest.fixture(scope="module")
def llama_adapters(tiny_llama, tmp_path_factory):
    return _adapters(tiny_llama, tmp_path_factory.mktemp("tp-llama-adapters"), list(ADAPTERS))


@pytest.fixture(scope="module")
def llama_tp2(tiny_llama):
    llm = _llm(tiny_llama, 2)
    yield llm
    llm.engine.close()


def test_mixed_adapter_batch_matches_single_process_llama(llama_tp2, tiny_llama, llama_adapters):
    prompts, loras = _mixed(llama_adapters[:2])
    _check_matches_single_process(llama_tp2, tiny_llama, prompts, loras)


def test_more_adapters_than_slots_load_and_evict_in_lockstep(llama_tp2, tiny_llama, llama_adapters):
    prompts, loras = _mixed(llama_adapters)
    _check_matches_single_process(llama_tp2, tiny_llama, prompts, loras)
    assert llama_tp2.engine.lora_manager.slot_usage() == (2, 2)


def test_prompt_logprobs_match_single_process(llama_tp2, tiny_llama, llama_adapters):
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=0, prompt_logprobs=1)
    sharded, single = _check_matches_single_process(llama_tp2, tiny_llama, PROMPTS[:2], llama_adapters[:2],
                                                    params)
    for ours, ref in zip(sharded, single):
        for entry, ref_entry in zip(ours.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert entry.keys() == ref_entry.keys()
            assert [lp.logprob for lp in entry.values()] == pytest.approx([lp.logprob for lp in ref_entry.values()],
                                                                          abs=1e-4)


def test_mixed_adapter_batch_matches_single_process_qwen2_bias(tiny_qwen2, tmp_path_factory):
    adapters = _adapters(tiny_qwen2, tmp_path_factory.mktemp("tp-qwen2-adapters"), ["r8-all", "r4-attention"])
    llm = _llm(tiny_qwen2, 2)
    prompts, loras = _mixed(adapters)
    _check_matches_single_process(llm, tiny_qwen2, prompts, loras)
    llm.engine.close()


def test_tied_embeddings_match_single_process(tmp_path):
    model_dir = make_tiny_model(tmp_path / "tied", "llama", tie_word_embeddings=True)
    adapters = _adapters(model_dir, tmp_path, ["r8-all"])
    llm = _llm(model_dir, 2)
    prompts, loras = _mixed(adapters)
    _check_matches_single_process(llm, model_dir, prompts, loras)
    llm.engine.close()


def test_size_that_does_not_divide_the_heads_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's attention heads"):
        _llm(tiny_llama, 3)


def test_vocabulary_rows_are_padded_to_equal_shards():
    embedding = torch.arange(5.0).unsqueeze(1).expand(5, 2)
    shards = [shard_tensor("model.embed_tokens.weight", embedding, rank, 3) for rank in range(3)]
    assert [s[:, 0].tolist() for s in shards] == [[0.0, 1.0], [2.0, 3.0], [4.0, 0.0]]


def test_close_stops_the_workers(tiny_llama):
    llm = _llm(tiny_llama, 2)
    processes = llm.engine.model.workers.processes
    llm.engine.close()
    assert [p.exitcode for p in processes] == [0]


def test_garbage_collection_stops_the_workers(tiny_llama):
    llm = _llm(tiny_llama, 2)
    processes = llm.engine.model.workers.processes
    del llm
    gc.collect()
    assert [p.exitcode for p in processes] == [0]


def test_a_dead_worker_fails_the_step_with_a_clear_error(tiny_llama):
    llm = _llm(tiny_llama, 2)
    (process,) = llm.engine.model.workers.processes
    process.kill()
    process.join()
    with pytest.raises(RuntimeError, match="tensor-parallel worker failed"):
        llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
    llm.engine.close()


def test_serve_flag_and_tgi_env_reach_the_engine_config(tmp_path):
    from openai_server.config import serve_config_from_args
    from openai_server.launch import engine_config

    flag = serve_config_from_args(["m", "--tensor-parallel-size", "2"], environ={}, cwd=tmp_path)
    env = serve_config_from_args(["m"], environ={"NUM_SHARD": "4"}, cwd=tmp_path)
    assert engine_config(flag).tensor_parallel_size == 2
    assert engine_config(env).tensor_parallel_size == 4


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_bf16_on_two_gpus_matches_one_gpu(tiny_llama, llama_adapters):
    """NCCL, Triton kernels, bf16. Reduction order differs from one GPU, so a near-tie may flip a greedy
    token; the check is teacher-forced: both score the same sequences, position by position."""
    gpu = dict(dtype="bfloat16", device="cuda")
    sharded_llm, single_llm = _llm(tiny_llama, 2, **gpu), _llm(tiny_llama, 1, **gpu)
    prompts, loras = _mixed(llama_adapters[:2])
    sharded = sharded_llm.generate(prompts, PARAMS, lora_request=loras, use_tqdm=False)
    single = single_llm.generate(prompts, PARAMS, lora_request=loras, use_tqdm=False)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(sharded, single))
    assert same >= 0.75 * len(prompts)
    full = [o.prompt_token_ids + o.outputs[0].token_ids for o in sharded]
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    ours = sharded_llm.generate(full, score, lora_request=loras, use_tqdm=False)
    ref = single_llm.generate(full, score, lora_request=loras, use_tqdm=False)
    for a, b, tokens in zip(ours, ref, full):
        got = [entry[t].logprob for entry, t in zip(a.prompt_logprobs[1:], tokens[1:])]
        want = [entry[t].logprob for entry, t in zip(b.prompt_logprobs[1:], tokens[1:])]
        assert got == pytest.approx(want, rel=5e-2, abs=5e-2)  # bf16: about 2^-8 per rounding
    sharded_llm.engine.close()


def test_a_steps_prefill_plan_reaches_the_workers_as_built():
    from engine.parallel.messages import decode_step, encode_step
    from engine.step_input import AttentionMetadata, StepInput
    from kernels.prefill_attention_triton import PrefillPlan

    plan = PrefillPlan.build([3, 40], [3, 50], "cpu", block_q=16)
    tokens = torch.arange(44)
    step = StepInput(tokens, tokens, AttentionMetadata(
        slot_mapping=tokens, block_tables=torch.zeros(3, 4, dtype=torch.long), context_lens=torch.tensor([9, 3, 50]),
        query_lens=[1, 3, 40], context_lens_list=[9, 3, 50], num_decode=1, prefill=plan), lora=None)
    kv_caches = [(torch.zeros(8, 16, 1, 4), torch.zeros(8, 16, 1, 4))]
    received = decode_step(encode_step(step, kv_caches), torch.device("cpu")).attention.prefill
    assert torch.equal(received.tiles, plan.tiles) and torch.equal(received.sequences, plan.sequences)
    assert received.block_q == plan.block_q


def _lora_as_workers_receive(slots: list[int], segments: bool = False, **choices):
    """A decode step's LoRAStep (slots, in segments or not, and the driver's other `choices`) as a worker decodes it
    from the step message."""
    import kernels
    from engine.parallel.messages import decode_step, encode_step
    from engine.step_input import AttentionMetadata, LoRAStep, StepInput

    n = len(slots)
    tokens = torch.arange(n)
    meta = kernels.prepare_lora_metadata(torch.tensor(slots, dtype=torch.int32), 2)
    lora = LoRAStep(meta.in_segments() if segments else meta, **choices)
    step = StepInput(tokens, tokens, AttentionMetadata(
        slot_mapping=tokens, block_tables=torch.zeros(n, 1, dtype=torch.long),
        context_lens=torch.ones(n, dtype=torch.long), query_lens=[1] * n, context_lens_list=[1] * n, num_decode=n),
        lora=lora)
    kv_caches = [(torch.zeros(8, 16, 1, 4), torch.zeros(8, 16, 1, 4))]
    return decode_step(encode_step(step, kv_caches), torch.device("cpu")).lora


def test_a_steps_fold_choice_reaches_the_workers_as_the_driver_made_it():
    fold_into = frozenset({"silu_and_mul"})
    received = _lora_as_workers_receive([0, -1, 1, 0], fold_into=fold_into)
    assert received.fold_into == fold_into
    assert received.meta.slots[:4].tolist() == [0, -1, 1, 0]


def test_a_steps_tiled_fold_choice_reaches_the_workers_as_the_driver_made_it():
    fold = frozenset({"silu_and_mul", "add_rms_norm"})
    received = _lora_as_workers_receive([0] * 32, fold_into=fold, tiled_folds=frozenset({"silu_and_mul"}))
    assert received.tiled_folds == frozenset({"silu_and_mul"})


@pytest.mark.parametrize(("segments", "path"), [(True, "sgmv"), (False, "bgmv")])
def test_a_steps_choice_of_segments_reaches_the_workers_as_the_driver_made_it(segments, path):
    """A 32-row step is per token by size unless the driver chose segments (`lora_tuning.step_path`)."""
    assert _lora_as_workers_receive([0] * 32, segments=segments).meta.path == path
