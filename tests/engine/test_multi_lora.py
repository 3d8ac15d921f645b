"""Mixed-adapter batches against transformers + peft, and adapter residency (slots, host cache)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from engine import LLM, LoRARequest, SamplingParams
from kernels import lora_tuning
from tests.engine.conftest import run_to_completion
from tests.tiny_models import make_peft_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "r4-attention": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=11),
    "r8-rslora-mlp": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"],
                          use_rslora=True, seed=12),
    "r16-all": dict(r=16, lora_alpha=32, target_modules=ALL, seed=13),
    "r8-alpha-pattern": dict(r=8, lora_alpha=8, target_modules=ALL, seed=14,
                             alpha_pattern={"o_proj": 32, "down_proj": 2}, rank_pattern={"k_proj": 4}),
    "r2-o-down": dict(r=2, lora_alpha=4, target_modules=["o_proj", "down_proj"], seed=15),
}
PROMPTS = ["Hello world", "The capital of France is", "def add(a, b):", "SELECT name FROM", "Ahoy matey, the"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return [LoRARequest(name, i + 1, str(make_peft_adapter(tiny_llama, root / name, **kwargs)))
            for i, (name, kwargs) in enumerate(ADAPTERS.items())]


@pytest.fixture(scope="module")
def reference(tiny_llama, adapters):
    """(tokens, logprobs) per (prompt, adapter) from transformers + peft, one request at a time."""
    import peft

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_llama))
    results = {}
    for lora in [None, *adapters]:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
        if lora is not None:
            model = peft.PeftModel.from_pretrained(model, lora.lora_path)
        model.eval()
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                out = model.generate(input_ids=ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                     pad_token_id=0, output_scores=True, return_dict_in_generate=True)
            tokens = out.sequences[0, ids.shape[1]:].tolist()
            logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
            results[(prompt, lora.lora_name if lora else None)] = (tokens, logprobs)
    return results


def _mixed_batch(adapters):
    """Every prompt with every adapter and with the base model, interleaved in one batch."""
    prompts, loras = [], []
    for i, prompt in enumerate(PROMPTS):
        for j in range(len(adapters) + 1):
            prompts.append(prompt)
            loras.append([None, *adapters][(i + j) % (len(adapters) + 1)])
    return prompts, loras


def _check_against_reference(outputs, loras, reference):
    for output, lora in zip(outputs, loras):
        tokens, logprobs = reference[(output.prompt, lora.lora_name if lora else None)]
        completion = output.outputs[0]
        assert completion.token_ids == tokens, (output.prompt, lora)
        ours = [entry[t].logprob for entry, t in zip(completion.logprobs, completion.token_ids)]
        assert ours == pytest.approx(logprobs, abs=1e-3)


PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def test_mixed_adapter_batch_matches_peft_token_for_token(tiny_llama, adapters, reference, monkeypatch):
    """Each projection's delta added by its expand."""
    monkeypatch.setenv(lora_tuning.FOLD_EXPAND_ENV, "0")
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=4, max_lora_rank=16)
    prompts, loras = _mixed_batch(adapters)
    outputs = llm.generate(prompts, PARAMS, lora_request=loras, use_tqdm=False)
    _check_against_reference(outputs, loras, reference)


def test_expands_folded_into_the_fused_ops_match_peft_token_for_token(tiny_llama, adapters, reference, monkeypatch):
    """Each projection's delta added by the op that consumes it: the rotary + KV write, SiLU·up and the next
    RMSNorm add what the expands would have."""
    monkeypatch.setenv(lora_tuning.FOLD_EXPAND_ENV, "1")
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=4, max_lora_rank=16)
    prompts, loras = _mixed_batch(adapters)
    outputs = llm.generate(prompts, PARAMS, lora_request=loras, use_tqdm=False)
    _check_against_reference(outputs, loras, reference)


def test_adapters_differ_from_the_base_model(reference, adapters):
    for prompt in PROMPTS[:2]:
        base = reference[(prompt, None)][0]
        assert all(reference[(prompt, lora.lora_name)][0] != base for lora in adapters)


def test_more_adapters_than_slots_all_finish_correctly(tiny_llama, adapters, reference):
    """Five adapters and the base model through two slots."""
    assert len(adapters) == 5
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16,
              max_cpu_loras=2)
    prompts, loras = _mixed_batch(adapters)
    outputs = llm.generate(prompts, PARAMS, lora_request=loras, use_tqdm=False)
    _check_against_reference(outputs, loras, reference)
    assert llm.engine.lora_manager.slot_usage()[0] <= 2


def test_the_takeable_slot_count_follows_every_pin_load_and_unload(tiny_llama, adapters):
    """The manager counts takeable slots once per change; after every step and unload the count is the
    slots' own: empty, or holding an adapter no running sequence uses."""
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16,
              max_cpu_loras=3)
    engine, manager = llm.engine, llm.engine.lora_manager

    def counted() -> int:
        return sum(owner is None or manager.pins[owner] == 0 for owner in manager.slot_owner)

    prompts, loras = _mixed_batch(adapters)
    for prompt, lora in zip(prompts, loras):
        engine.add_request(prompt, PARAMS, lora)
    removed = False
    while engine.has_unfinished_requests():
        engine.step()
        assert manager.takeable_slots() == counted()
        if not removed and any(manager.pins.values()):
            manager.remove(next(owner for owner in manager.slot_owner if owner and manager.pins[owner]))
            removed = True
            assert manager.takeable_slots() == counted()
    assert removed and manager.takeable_slots() == counted() == 2


def test_host_cache_keeps_at_most_max_cpu_loras(tiny_llama, adapters):
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=1, max_lora_rank=16,
              max_cpu_loras=2)
    llm.generate(PROMPTS, PARAMS, lora_request=adapters, use_tqdm=False)
    status = llm.engine.lora_manager.status()
    assert sum(entry.in_cpu for entry in status.values()) <= 2
    assert sum(entry.slot is not None for entry in status.values()) == 1
    assert all(entry.running == 0 for entry in status.values())


def test_a_waiting_adapter_is_not_starved(tiny_llama, adapters):
    """One slot, a stream of requests for adapter A, one request for B: B still finishes."""
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=1, max_lora_rank=16)
    engine = llm.engine
    first, second = adapters[0], adapters[1]
    engine.add_request("Hello", PARAMS, first)
    starving = engine.add_request("Hello", PARAMS, second)
    finished = {}
    for step in range(400):
        if step % 2 == 0:
            engine.add_request("Hello", PARAMS, first)
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        if starving in finished:
            break
    assert starving in finished
    run_to_completion(engine)


def test_unload_lets_running_requests_finish_then_frees_everything(tiny_llama, adapters, reference):
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16)
    engine, lora = llm.engine, adapters[2]
    request_id = engine.add_request(PROMPTS[0], PARAMS, lora)
    while not engine.scheduler.running:  # its weights are read in the background first
        engine.step()
    engine.lora_manager.remove(lora.lora_int_id)
    residency = engine.lora_manager.status()[lora.lora_int_id]
    assert residency.running == 1 and residency.unloaded
    (output,) = run_to_completion(engine).values()
    assert output.request_id == request_id
    assert output.outputs[0].token_ids == reference[(PROMPTS[0], lora.lora_name)][0]
    assert lora.lora_int_id not in engine.lora_manager.status()
    assert engine.lora_manager.slot_usage()[0] == 0
    with pytest.raises(ValueError, match="unloaded"):
        engine.add_request(PROMPTS[0], PARAMS, lora)


def test_an_unloaded_adapter_stays_in_the_status_while_a_queued_request_uses_it(tiny_llama, adapters):
    """A queued request pins nothing, yet it will run with the adapter: per-adapter views must keep counting it."""
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16,
              max_num_seqs=1)
    engine, lora = llm.engine, adapters[2]
    engine.add_request(PROMPTS[0], PARAMS)  # runs first and fills the batch
    engine.step()
    engine.add_request(PROMPTS[1], PARAMS, lora)
    engine.remove_lora(lora.lora_int_id)
    residency = engine.lora_status()[lora.lora_int_id]
    assert residency.unloaded and residency.running == 0
    run_to_completion(engine)
    assert lora.lora_int_id not in engine.lora_status()


def test_reload_in_place_gives_new_weights_to_new_requests_only(tiny_llama, adapters, reference):
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16)
    engine = llm.engine
    old, replacement = adapters[0], adapters[1]
    running = engine.add_request(PROMPTS[1], PARAMS, old)
    engine.step()
    new = LoRARequest(old.lora_name, 99, replacement.lora_path)
    engine.lora_manager.add(new)
    engine.lora_manager.remove(old.lora_int_id)
    fresh = engine.add_request(PROMPTS[1], PARAMS, new)
    finished = run_to_completion(engine)
    assert finished[running].outputs[0].token_ids == reference[(PROMPTS[1], old.lora_name)][0]
    assert finished[fresh].outputs[0].token_ids == reference[(PROMPTS[1], replacement.lora_name)][0]


def test_a_config_without_architectures_still_accepts_its_family_adapters(tiny_llama, adapters, tmp_path):
    import json
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny_llama, bare)
    config = json.loads((bare / "config.json").read_text())
    config.pop("architectures", None)
    (bare / "config.json").write_text(json.dumps(config))
    llm = LLM(str(bare), dtype="float32", device="cpu", enable_lora=True, max_loras=1, max_lora_rank=16)
    assert llm.engine.model_info.architecture == "LlamaForCausalLM"
    (output,) = llm.generate([PROMPTS[0]], PARAMS, lora_request=adapters[2], use_tqdm=False)
    assert output.outputs[0].finish_reason == "length"


def test_an_adapter_read_from_disk_does_not_stall_the_batch(tiny_llama, adapters, reference, monkeypatch):
    """max_cpu_loras=2: the first adapter is evicted from host memory before its request runs; while it
    is read again (slowly, here) on a background thread, a base-model request runs to completion."""
    import time

    import engine.lora_manager as lora_manager

    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16,
              max_cpu_loras=2)
    engine = llm.engine
    evicted = adapters[0]
    cold = engine.add_request(PROMPTS[0], PARAMS, evicted)
    for lora in adapters[1:3]:
        engine.lora_manager.add(lora)
    assert engine.lora_manager.status()[evicted.lora_int_id].in_cpu is False
    read = lora_manager.load_adapter

    def slow_read(*args, **kwargs):
        time.sleep(1.0)
        return read(*args, **kwargs)

    monkeypatch.setattr(lora_manager, "load_adapter", slow_read)
    base = engine.add_request(PROMPTS[1], PARAMS)
    finished = {}
    order = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
                order.append(output.request_id)
    assert order == [base, cold]
    assert finished[cold].outputs[0].token_ids == reference[(PROMPTS[0], evicted.lora_name)][0]


def test_a_starving_adapter_drains_one_slot_while_the_other_keeps_its_traffic(tiny_llama, adapters):
    """Two slots busy with a steady stream for A and B, one request for C: C is served by draining
    one slot only, so the batch never empties while C waits."""
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16)
    engine = llm.engine
    a, b, c = adapters[:3]
    engine.add_request("Hello", PARAMS, a)
    engine.add_request("Hello", PARAMS, b)
    engine.step()
    starving = engine.add_request("Hello", PARAMS, c)
    running_while_waiting = []
    for _ in range(300):
        engine.add_request("Hello", PARAMS, a)
        engine.add_request("Hello", PARAMS, b)
        engine.step()
        waiting_ids = {seq.request.request_id for seq in engine.scheduler.waiting}
        if starving not in waiting_ids:
            break
        running_while_waiting.append(len(engine.scheduler.running))
    assert starving not in {seq.request.request_id for seq in engine.scheduler.waiting}
    assert running_while_waiting[-1] >= MAX_TOKENS // 2  # one adapter's steady traffic (draining both: 0)
    for request_id in list(engine.requests):
        engine.abort(request_id)


def test_a_bad_adapter_in_a_batch_fails_before_anything_runs(tiny_llama, adapters, tmp_path):
    import shutil

    from adapters_registry import AdapterError

    broken = tmp_path / "broken"
    shutil.copytree(adapters[0].lora_path, broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16)
    loras = [adapters[1], LoRARequest("broken", 42, str(broken)), adapters[2]]
    with pytest.raises(AdapterError, match="adapter_model.safetensors"):
        llm.generate(PROMPTS[:3], PARAMS, lora_request=loras, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert 42 not in llm.engine.lora_manager.status()


def _count_reads(monkeypatch) -> list[str]:
    """Paths the LoRA manager reads adapter weights from, in order."""
    import engine.lora_manager as lora_manager

    reads, read = [], lora_manager.load_adapter

    def counting_read(path, *args, **kwargs):
        reads.append(path)
        return read(path, *args, **kwargs)

    monkeypatch.setattr(lora_manager, "load_adapter", counting_read)
    return reads


def test_a_request_is_queued_after_checking_its_adapter_without_reading_the_weights(tiny_llama, adapters, reference,
                                                                                     monkeypatch):
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=1, max_lora_rank=16)
    reads = _count_reads(monkeypatch)
    request_id = llm.engine.add_request(PROMPTS[0], PARAMS, adapters[2])
    assert reads == []
    (output,) = run_to_completion(llm.engine).values()
    assert reads == [adapters[2].lora_path]
    assert output.request_id == request_id
    assert output.outputs[0].token_ids == reference[(PROMPTS[0], adapters[2].lora_name)][0]


def test_reading_ahead_never_evicts_an_adapter_before_it_runs(tiny_llama, adapters, reference, monkeypatch):
    """One slot and one host copy, four adapters queued: each adapter's weights are read exactly once."""
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=1, max_lora_rank=16)
    reads = _count_reads(monkeypatch)
    ids = {llm.engine.add_request(PROMPTS[i], PARAMS, lora): (PROMPTS[i], lora.lora_name)
           for i, lora in enumerate(adapters[:4])}
    finished = run_to_completion(llm.engine)
    assert sorted(reads) == sorted(lora.lora_path for lora in adapters[:4])
    stats = llm.engine.stats()
    assert (stats.lora_disk_reads, stats.lora_slot_loads) == (4, 4)
    for request_id, key in ids.items():
        assert finished[request_id].outputs[0].token_ids == reference[key][0]


def _break_weights(lora: LoRARequest, tmp_path) -> LoRARequest:
    """A copy of the adapter whose weight file is broken after its header was checked (replaced on disk)."""
    import shutil

    copy = tmp_path / lora.lora_name
    shutil.copytree(lora.lora_path, copy)
    return LoRARequest(f"{lora.lora_name}-broken", 50, str(copy))


def test_an_adapter_whose_weights_cannot_be_read_fails_only_its_requests(tiny_llama, adapters, reference, tmp_path):
    from adapters_registry import AdapterError

    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16)
    engine = llm.engine
    broken = _break_weights(adapters[1], tmp_path)
    good = engine.add_request(PROMPTS[0], PARAMS, adapters[0])
    doomed = [engine.add_request(PROMPTS[i], PARAMS, broken) for i in (1, 2)]
    (Path(broken.lora_path) / "adapter_model.safetensors").write_bytes(b"gone")
    finished = run_to_completion(engine)
    errors = engine.take_errors()
    assert set(errors) == set(doomed)
    assert all(isinstance(e, AdapterError) and "corrupt or truncated" in str(e) for e in errors.values())
    assert finished[good].outputs[0].token_ids == reference[(PROMPTS[0], adapters[0].lora_name)][0]
    assert engine.allocator.num_free == engine.allocator.num_blocks
    assert engine.lora_manager.slot_usage()[0] == 1  # only the good adapter was ever loaded


def test_offline_generate_raises_the_read_error_and_leaves_nothing_behind(tiny_llama, adapters, tmp_path):
    from adapters_registry import AdapterError

    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16)
    broken = _break_weights(adapters[1], tmp_path)
    llm.engine.lora_manager.ensure_loaded([broken])
    (Path(broken.lora_path) / "adapter_model.safetensors").write_bytes(b"gone")
    with pytest.raises(AdapterError, match="corrupt or truncated"):
        llm.generate([PROMPTS[0], PROMPTS[1]], PARAMS, lora_request=[adapters[0], broken], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks
