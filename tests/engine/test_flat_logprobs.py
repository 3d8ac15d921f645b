"""vLLM's flat logprobs: `SamplingParams(flat_logprobs=True)` records the same positions in a few arrays."""
from __future__ import annotations

import gc

import pytest

from engine import LLM, FlatLogprobs, Logprob, SamplingParams
from tests.engine.conftest import make_engine

POSITIONS = [None, {5: Logprob(-0.25, 1, "a")}, {7: Logprob(-1.5, 3, " b"), 2: Logprob(-0.1, 1, None)},
             {9: Logprob(-2.0, None, "c")}]


def test_a_flat_record_reads_as_the_list_of_positions_it_was_built_from():
    record = FlatLogprobs(POSITIONS[:2])
    record.extend(POSITIONS[2:])
    assert len(record) == len(POSITIONS)
    assert list(record) == POSITIONS and record == POSITIONS
    assert record[0] is None and record[2] == POSITIONS[2] and record[-1] == POSITIONS[-1]
    assert record[1:3] == POSITIONS[1:3] and isinstance(record[1:3], FlatLogprobs)
    assert record[::2] == POSITIONS[::2]
    with pytest.raises(IndexError):
        record[len(POSITIONS)]


def test_a_position_read_from_a_flat_record_is_a_fresh_dict():
    record = FlatLogprobs(POSITIONS)
    record[1][5].logprob = 0.0
    assert record[1] == POSITIONS[1]


def test_a_copy_does_not_grow_with_the_record():
    record = FlatLogprobs(POSITIONS[:2])
    snapshot = record.copy()
    record.append(POSITIONS[2])
    assert snapshot == POSITIONS[:2] and record == POSITIONS[:3]


def test_a_flat_record_adds_a_handful_of_objects_for_the_collector_however_many_positions_it_holds():
    def positions():
        for i in range(2000):
            yield {i: Logprob(-1.0, 1, "x"), i + 1: Logprob(-2.0, 2, "y")}

    before = len(gc.get_objects())
    record = FlatLogprobs(positions())
    flat = len(gc.get_objects()) - before
    listed = list(positions())
    assert len(record) == len(listed) == 2000
    assert flat < 50 and len(gc.get_objects()) - before >= 2000  # room for another thread's objects


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", device="cpu")


def test_flat_logprobs_give_the_positions_of_list_records(llm):
    """Sampled with a seed, two completions each, top logprobs and prompt logprobs: the same positions."""
    prompts = ["Hello world, how", "The capital of France"]
    params = dict(temperature=0.8, seed=3, n=2, max_tokens=6, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    listed = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
    flat = llm.generate(prompts, SamplingParams(**params, flat_logprobs=True), use_tqdm=False)
    for a, b in zip(listed, flat):
        assert isinstance(b.prompt_logprobs, FlatLogprobs) and b.prompt_logprobs == a.prompt_logprobs
        for c, d in zip(a.outputs, b.outputs):
            assert isinstance(d.logprobs, FlatLogprobs) and d.token_ids == c.token_ids and d.logprobs == c.logprobs


def test_flat_records_streamed_by_an_engine_with_steps_in_flight_are_snapshots(tiny_llama):
    """Each output keeps the positions it was built with while the request's record grows; the last one has
    them all, as the synchronous engine gives them."""
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=1, prompt_logprobs=1, ignore_eos=True,
                            flat_logprobs=True)
    finals = []
    for engine in (make_engine(tiny_llama, async_scheduling=False),
                   make_engine(tiny_llama, async_scheduling_eager=True)):
        engine.add_request("Hello world, how", params)
        streamed = []
        while engine.has_unfinished_requests():
            streamed.extend(engine.step())
        assert all(isinstance(o.outputs[0].logprobs, FlatLogprobs) for o in streamed)
        assert [len(o.outputs[0].logprobs) for o in streamed] == [len(o.outputs[0].token_ids) for o in streamed]
        finals.append(streamed[-1])
    sync, overlapped = finals
    assert overlapped.outputs[0].token_ids == sync.outputs[0].token_ids
    assert [p and {t: (lp.rank, lp.decoded_token) for t, lp in p.items()} for p in overlapped.prompt_logprobs] == \
        [p and {t: (lp.rank, lp.decoded_token) for t, lp in p.items()} for p in sync.prompt_logprobs]
    assert len(overlapped.outputs[0].logprobs) == 5
