"""Balanced admission's suspension: with every adapter slot busy, an adapter with little work left yields its slot to
a waiting one with much more, keeping its sequences' KV blocks, and resumes where it stopped."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.sequence import SequenceStatus
from tests.engine.conftest import make_engine, run_to_completion

SHORT = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=72, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(rank4_adapters):
    return rank4_adapters


def one_slot_engine(tiny_llama, adapters, admission_order="balanced", suspend_margin=32, **overrides):
    engine = make_engine(tiny_llama, enable_lora=True, max_lora_rank=4, max_loras=1, max_cpu_loras=len(adapters),
                         admission_order=admission_order, suspend_margin=suspend_margin, **overrides)
    for lora in adapters:
        engine.lora_manager.add(lora)
    return engine


def run_until_short_is_nearly_done(engine, short_id: str) -> None:
    """Steps until the short request has 18 of its 24 tokens: 67 fewer steps left than a new 72-token one."""
    while len(engine.requests[short_id].sequences[0].output_token_ids) < 18:
        engine.step()


def test_an_adapter_with_little_work_left_yields_its_slot_and_keeps_its_kv(tiny_llama, adapters):
    a, b, _ = adapters
    engine = one_slot_engine(tiny_llama, adapters)
    short = engine.add_request("Hello there", SHORT, a)
    run_until_short_is_nearly_done(engine, short)
    engine.add_request("Hello there", LONG, b)
    engine.step()
    engine.step()
    seq = engine.requests[short].sequences[0]
    assert engine.scheduler.num_suspensions == 1
    assert seq.status is SequenceStatus.WAITING and seq.block_table
    assert seq.num_computed_tokens == len(seq.token_ids) - 1  # only its last token is left to compute
    assert [s.request.lora_request.lora_name for s in engine.scheduler.running] == [b.lora_name]
    run_to_completion(engine)


@pytest.mark.parametrize("async_steps", [False, True], ids=["sync", "async"])
def test_suspended_and_resumed_sequences_give_the_same_tokens(tiny_llama, adapters, async_steps):
    """Also with steps left in flight (async scheduling): a suspension waits for the step in flight to be read."""
    a, b, c = adapters

    def generate(suspend_margin):
        engine = one_slot_engine(tiny_llama, adapters, suspend_margin=suspend_margin,
                                 async_scheduling_eager=async_steps)
        first = [engine.add_request("Hello there", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), a),
                 engine.add_request("Hello there", SHORT, a)]
        run_until_short_is_nearly_done(engine, first[1])
        later = [engine.add_request("Hello there", LONG, b), engine.add_request("General Kenobi", LONG, b),
                 engine.add_request("General Kenobi", LONG, c)]
        outputs = run_to_completion(engine)
        return [outputs[i].outputs[0].token_ids for i in [*first, *later]], engine.scheduler.num_suspensions

    suspended, suspensions = generate(32)
    plain, none = generate(None)
    assert suspensions >= 1 and none == 0
    assert suspended == plain


def test_aborting_a_suspended_request_frees_its_blocks(tiny_llama, adapters):
    a, b, _ = adapters
    engine = one_slot_engine(tiny_llama, adapters)
    free_before = engine.allocator.num_free
    short = engine.add_request("Hello there", SHORT, a)
    run_until_short_is_nearly_done(engine, short)
    engine.add_request("Hello there", LONG, b)
    while engine.scheduler.num_suspensions == 0:
        engine.step()
    engine.abort(short)
    run_to_completion(engine)
    assert engine.allocator.num_free == free_before
    assert not engine.lora_manager.pins


def test_no_suspension_when_the_work_left_differs_by_less_than_the_margin(tiny_llama, adapters):
    a, b, _ = adapters
    engine = one_slot_engine(tiny_llama, adapters)
    short = engine.add_request("Hello there", SHORT, a)
    run_until_short_is_nearly_done(engine, short)
    engine.add_request("Hello there", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), b)  # 25 more
    run_to_completion(engine)
    assert engine.scheduler.num_suspensions == 0


def test_the_offline_llm_suspends_by_default(tiny_llama, adapters):
    """`LLM` admits in the balanced order with a margin of 32 steps: the short request's adapter yields its slot."""
    from engine import LLM

    a, b, _ = adapters
    engine = LLM(str(tiny_llama), device="cpu", enable_lora=True, max_lora_rank=4, max_loras=1,
                 max_cpu_loras=len(adapters)).engine
    short = engine.add_request("Hello there", SHORT, a)
    run_until_short_is_nearly_done(engine, short)
    engine.add_request("Hello there", LONG, b)
    run_to_completion(engine)
    assert engine.scheduler.num_suspensions == 1


def test_arrival_order_never_suspends(tiny_llama, adapters):
    a, b, _ = adapters
    engine = make_engine(tiny_llama, enable_lora=True, max_lora_rank=4, max_loras=1, admission_order="fcfs",
                         suspend_margin=32)
    short = engine.add_request("Hello there", SHORT, a)
    run_until_short_is_nearly_done(engine, short)
    engine.add_request("Hello there", LONG, b)
    run_to_completion(engine)
    assert engine.scheduler.num_suspensions == 0


def test_a_suspended_sequences_kv_goes_before_a_running_sequence_is_preempted(tiny_llama, adapters):
    """The cache runs short while A is suspended: A gives up its blocks (to recompute them later), and the
    running B is not preempted."""
    a, b, _ = adapters
    engine = one_slot_engine(tiny_llama, adapters, block_size=4, num_kv_blocks=22)
    short = engine.add_request("Hello there", SHORT, a)
    run_until_short_is_nearly_done(engine, short)
    engine.add_request("Hello there", LONG, b)
    while engine.scheduler.num_suspensions == 0:
        engine.step()
    seq = engine.requests[short].sequences[0]
    while seq.block_table:
        engine.step()
    assert seq.num_computed_tokens == 0 and engine.scheduler.num_preemptions == 1
    assert [s.request.lora_request.lora_name for s in engine.scheduler.running] == [b.lora_name]
    run_to_completion(engine)


def test_a_suspended_sequences_kv_goes_for_a_waiting_prompt_when_nothing_runs(tiny_llama, adapters):
    """Nothing else would free it: the engine stalled with the prompt waiting forever."""
    a, b, _ = adapters
    engine = one_slot_engine(tiny_llama, adapters, block_size=4, num_kv_blocks=8, max_num_seqs=4, suspend_margin=1)
    first = engine.add_request([10, 11, 12, 13], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), a)
    engine.step()
    engine.add_request([20, 21, 22, 23], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), b)
    engine.step()
    engine.step()
    assert engine.scheduler.num_suspensions == 1 and engine.requests[first].sequences[0].block_table
    engine.add_request(list(range(30, 60)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # 8 blocks
    outputs = run_to_completion(engine, max_steps=500)
    assert all(output.finished for output in outputs.values()) and len(outputs) == 3
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_adapters_sharing_one_slot_on_a_small_cache_do_not_take_it_from_each_other_forever(tiny_llama, adapters):
    """A sequence computing its prompt, or again the tokens a preemption dropped, is never suspended, and no adapter
    takes a slot when its prompt does not fit beside the suspended sequences' KV: adapters yielding the slot to each
    other kept dropping each other's KV and computed the same tokens over and over, without end."""
    engine = one_slot_engine(tiny_llama, adapters, block_size=4, num_kv_blocks=9, max_num_seqs=6, max_model_len=32,
                             max_num_batched_tokens=2, suspend_margin=1)
    for prompt, max_tokens, lora in [(range(10, 25), 13, adapters[0]), (range(40, 46), 6, adapters[1]),
                                     (range(70, 76), 10, adapters[2])]:
        engine.add_request(list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), lora)
    outputs = run_to_completion(engine, max_steps=600)
    assert sorted(len(output.outputs[0].token_ids) for output in outputs.values()) == [6, 10, 13]
    assert engine.scheduler.num_preemptions <= 2
