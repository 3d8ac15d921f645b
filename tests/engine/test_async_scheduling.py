"""Async scheduling: a greedy decode step is launched before the previous step's tokens are read back.

The engine runs the same code on the CPU with eager steps (`async_scheduling_eager`); every test
compares it with the same engine run synchronously, token for token, and checks that nothing (KV
blocks, requests, adapter pins) is left behind.
"""
from __future__ import annotations

import asyncio

import pytest

from engine import LLM, AsyncEngine, LoRARequest, SamplingParams, llm_engine
from engine.sequence import IN_FLIGHT_TOKEN
from tests.engine.conftest import make_engine
from tests.tiny_models import make_peft_adapter

PROMPTS = ["Hello", "The capital of France is Paris. The capital of Italy is", "def add(a, b):",
           "SELECT name FROM users", "Ahoy matey", "How are you"]
EOS_PROMPT = "Ahoy matey"  # the tiny model's greedy continuation reaches EOS at its 12th token
STOP_STRING = "oday"  # comes up in several of the tiny model's greedy continuations


def greedy(max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **{"ignore_eos": True, **kwargs})


@pytest.fixture(scope="module")
def engines(tiny_llama):
    """(synchronous, async) engines on the tiny Llama, a block size of 4 so decode steps often grow tables."""
    return make_engine(tiny_llama, async_scheduling=False, block_size=4), \
        make_engine(tiny_llama, async_scheduling_eager=True, block_size=4)


class Run:
    """Steps an engine to the end, keeping every output it streams; counts the steps launched with
    their input ids still on the device (the previous step in flight), and notes at each admission
    how far every running sequence had got (async scheduling must admit exactly when sync mode does)."""

    def __init__(self, engine, monkeypatch):
        self.engine = engine
        self.streamed: dict[str, list] = {}
        self.final: dict[str, object] = {}
        self.admissions: list[list[tuple]] = []
        schedule = engine.scheduler.schedule

        def recording():
            plan = schedule()
            if any(item.seq.num_computed_tokens == 0 for item in plan.scheduled):
                self.admissions.append(sorted((tuple(s.request.prompt_token_ids), s.index, s.num_computed_tokens)
                                              for s in engine.scheduler.running))
            return plan

        monkeypatch.setattr(engine.scheduler, "schedule", recording)
        self.overlapped_steps = 0
        self.overlapped_with_waiting = 0  # of those, steps launched while requests waited
        self.overlapped_admissions = 0  # of those, steps computing a prompt from its start
        execute = engine.runner.execute

        self.forwards = 0

        def counting(scheduled, slots, device_tokens=None):
            self.forwards += 1
            overlapped = device_tokens is not None
            self.overlapped_steps += overlapped
            self.overlapped_with_waiting += overlapped and bool(engine.scheduler.waiting)
            self.overlapped_admissions += overlapped and any(item.seq.num_computed_tokens == 0 for item in scheduled)
            return execute(scheduled, slots, device_tokens)

        monkeypatch.setattr(engine.runner, "execute", counting)
        self.drains = 0
        drain = engine.drain

        def counting_drains():
            self.drains += 1
            return drain()

        monkeypatch.setattr(engine, "drain", counting_drains)

    def add(self, prompt, params, lora=None) -> str:
        return self.engine.add_request(prompt, params, lora)

    def step(self) -> None:
        for output in self.engine.step():
            self.keep(output)

    def keep(self, output) -> None:
        self.streamed.setdefault(output.request_id, []).append(output)
        if output.finished:
            self.final[output.request_id] = output

    def to_end(self, max_steps: int = 500) -> Run:
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                return self
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")


def run(engine, monkeypatch, requests) -> tuple[list, Run]:
    """requests: (prompt, params) pairs, or (prompt, params, lora) triples; their final outputs in order."""
    r = Run(engine, monkeypatch)
    ids = [r.add(*request) for request in requests]
    r.to_end()
    return [r.final[i] for i in ids], r


def summary(output) -> tuple:
    """The tokens exactly; the cumulative logprob and prompt logprobs to float32 noise (the rows a step computes
    differ between the engines: a review's fuzz saw 2e-4 over 14 tokens where the async engine computed wasted
    rows, and 1.2e-6 in a prompt logprob of a chunked prefill)."""
    return ([(c.token_ids, c.text, c.finish_reason, c.stop_reason, pytest.approx(c.cumulative_logprob, abs=1e-3))
             for c in output.outputs], _approximate_positions(output.prompt_logprobs))


def _approximate_positions(positions) -> list | None:
    """Per position: token id -> (rank, logprob to float32 noise)."""
    if positions is None:
        return None
    return [position and {token_id: (lp.rank, lp.decoded_token, pytest.approx(lp.logprob, abs=1e-4))
                          for token_id, lp in position.items()} for position in positions]


def assert_same(sync_outputs, async_outputs) -> None:
    assert [summary(o) for o in async_outputs] == [summary(o) for o in sync_outputs]


def assert_streams_consistent(r: Run) -> None:
    """No output ever shows a placeholder or a token the request does not end with, nor part of its prompt
    logprobs (those of a step in flight are recorded when it is read back)."""
    for request_id, outputs in r.streamed.items():
        final = r.final[request_id]
        for output in outputs:
            if output.prompt_logprobs is not None:
                assert len(output.prompt_logprobs) == len(output.prompt_token_ids)
            for completion, last in zip(output.outputs, final.outputs):
                assert IN_FLIGHT_TOKEN not in completion.token_ids
                assert completion.token_ids == last.token_ids[:len(completion.token_ids)]


def assert_nothing_left(engine) -> None:
    assert not engine.has_unfinished_requests()
    assert not engine.requests
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.allocator.num_free == engine.allocator.num_blocks
    if engine.lora_manager is not None:
        assert all(residency.running == 0 for residency in engine.lora_manager.status().values())


def compare(engines, monkeypatch, requests, *, same_admissions: bool = True) -> tuple[list, Run]:
    """The synchronous engine's final outputs, and the async engine's run, checked against them.
    same_admissions=False where admissions depend on timing anyway (adapter reads on other threads)."""
    sync, overlapped = engines
    expected, reference = run(sync, monkeypatch, requests)
    got, r = run(overlapped, monkeypatch, requests)
    assert_same(expected, got)
    if same_admissions:
        assert r.admissions == reference.admissions
    assert_streams_consistent(r)
    assert_nothing_left(sync)
    assert_nothing_left(overlapped)
    return expected, r


def test_async_scheduling_needs_cuda_graphs_unless_forced(tiny_llama, engines):
    assert not make_engine(tiny_llama).async_scheduling  # the CPU has no graphs
    assert not make_engine(tiny_llama, async_scheduling=False, async_scheduling_eager=True).async_scheduling
    assert engines[1].async_scheduling


def test_greedy_decode_steps_overlap_and_give_the_synchronous_tokens(engines, monkeypatch):
    _, r = compare(engines, monkeypatch, [(p, greedy(3 + 2 * i)) for i, p in enumerate(PROMPTS)])
    assert r.overlapped_steps >= 10


def test_the_synchronous_engine_never_overlaps(engines, monkeypatch):
    _, r = run(engines[0], monkeypatch, [(p, greedy()) for p in PROMPTS])
    assert r.overlapped_steps == 0


def test_eos_ends_a_sequence_as_in_sync_mode_and_ignore_eos_runs_past_it(engines, monkeypatch):
    requests = [(EOS_PROMPT, greedy(20, ignore_eos=False)), (EOS_PROMPT, greedy(20)), (PROMPTS[1], greedy(20))]
    expected, _ = compare(engines, monkeypatch, requests)
    assert [o.outputs[0].finish_reason for o in expected] == ["stop", "length", "length"]
    assert len(expected[0].outputs[0].token_ids) < 20


def test_stop_token_ids_end_sequences_as_in_sync_mode(engines, monkeypatch):
    (alone,), _ = run(engines[0], monkeypatch, [(PROMPTS[2], greedy(20))])
    stop_token = alone.outputs[0].token_ids[5]
    requests = [(PROMPTS[2], greedy(20, stop_token_ids=[stop_token])), (PROMPTS[3], greedy(20))]
    expected, _ = compare(engines, monkeypatch, requests)
    assert expected[0].outputs[0].stop_reason == stop_token


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_end_sequences_as_in_sync_mode(engines, monkeypatch, include):
    requests = [(p, greedy(30, stop=[STOP_STRING], include_stop_str_in_output=include)) for p in PROMPTS]
    expected, _ = compare(engines, monkeypatch, requests)
    assert sum(o.outputs[0].stop_reason == STOP_STRING for o in expected) >= 2


def test_n_completions_per_request_match_sync_mode(engines, monkeypatch):
    compare(engines, monkeypatch, [(PROMPTS[0], greedy(9, n=3, prompt_logprobs=1)),
                                   (PROMPTS[4], greedy(14, n=2, ignore_eos=False))])


def _three_steps_in(engines, monkeypatch):
    """Three 16-token requests: their sync-mode outputs, and an async run of them three overlapped steps in."""
    sync, overlapped = engines
    requests = [(p, greedy(16)) for p in PROMPTS[:3]]
    expected, _ = run(sync, monkeypatch, requests)
    r = Run(overlapped, monkeypatch)
    ids = [r.add(*request) for request in requests]
    while r.overlapped_steps < 3:
        r.step()
    return expected, r, ids


def test_switching_async_scheduling_off_mid_run_drains_and_goes_on_synchronously(engines, monkeypatch):
    overlapped = engines[1]
    expected, r, ids = _three_steps_in(engines, monkeypatch)
    monkeypatch.setattr(overlapped, "async_scheduling", False)
    overlapped_before = r.overlapped_steps
    r.to_end()
    assert r.overlapped_steps == overlapped_before
    assert_same(expected, [r.final[i] for i in ids])
    assert_nothing_left(overlapped)


def _admitting_steps_left_in_flight(engine, monkeypatch) -> list[int]:
    """Records the prompt tokens of every step launched to stay in flight that computes prompts."""
    launched = []
    launch = engine._launch_in_flight

    def recording(scheduled, previous):
        if any(item.num_new_tokens > 1 for item in scheduled):
            launched.append(sum(item.num_new_tokens for item in scheduled if item.num_new_tokens > 1))
        return launch(scheduled, previous)

    monkeypatch.setattr(engine, "_launch_in_flight", recording)
    return launched


def test_an_admitting_step_whose_prompts_all_end_in_it_stays_in_flight(engines, monkeypatch):
    launched = _admitting_steps_left_in_flight(engines[1], monkeypatch)
    _, r = compare(engines, monkeypatch, [(p, greedy(6)) for p in PROMPTS[:3]])
    assert len(launched) == 1  # the one step admitting all three prompts
    # every decode step after it takes its input ids on the device: 5, and a 6th whose tokens are dropped
    assert r.overlapped_steps == 6


def _second_request_mid_run(engines, monkeypatch, first: tuple, steps: int, second: tuple) -> Run:
    """Each engine runs `first` (prompt, params) for `steps` steps, is given `second`, and runs to the end: both
    give the same outputs, streamed consistently, and keep nothing. The overlapping engine's run."""
    finals = []
    for engine in engines:
        r = Run(engine, monkeypatch)
        first_id = r.add(*first)
        for _ in range(steps):
            r.step()
        second_id = r.add(*second)
        r.to_end()
        finals.append([r.final[first_id], r.final[second_id]])
        assert_streams_consistent(r)
        assert_nothing_left(engine)
    assert_same(*finals)
    return r


def test_a_request_arriving_mid_run_is_admitted_in_a_step_that_stays_in_flight(engines, monkeypatch):
    launched = _admitting_steps_left_in_flight(engines[1], monkeypatch)
    _second_request_mid_run(engines, monkeypatch, (PROMPTS[1], greedy(12)), 3, (PROMPTS[4], greedy(6)))
    assert len(launched) == 2


def test_an_admitting_step_recording_prompt_logprobs_stays_in_flight(engines, monkeypatch):
    """The prompt logprobs are computed on the device with the step and recorded when it is read back."""
    launched = _admitting_steps_left_in_flight(engines[1], monkeypatch)
    expected, r = compare(engines, monkeypatch, [(PROMPTS[1], greedy(6, prompt_logprobs=1)), (PROMPTS[2], greedy(6))])
    assert len(launched) == 1
    assert len(expected[0].prompt_logprobs) == len(expected[0].prompt_token_ids)
    assert r.final[min(r.final, key=int)].prompt_logprobs == expected[0].prompt_logprobs
    # every decode step after it: 5, and a 6th whose tokens are dropped
    assert r.overlapped_steps == 6


def test_requests_scoring_their_prompts_overlap_and_end_with_every_prompt_logprob(engines, monkeypatch):
    """One token each and prompt logprobs (how evaluation harnesses score text): each ends in the step that reads
    its first token back, its output built with the prompt logprobs its step computed."""
    launched = _admitting_steps_left_in_flight(engines[1], monkeypatch)
    expected, _ = compare(engines, monkeypatch, [(p, greedy(1, prompt_logprobs=1)) for p in PROMPTS[:3]])
    assert launched and all(len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in expected)


def arrivals_by_forward(engines, monkeypatch, arrivals, *, same_admissions: bool = True) -> Run:
    """Each engine gets each (forward, prompt, params) request before that many forwards, and runs to the end: the
    same outputs, streamed consistently, the same admissions (unless a sequence ending by a token makes room a step
    later in the overlapping engine), and nothing kept. The overlapping engine's run."""
    runs, finals = [], []
    for engine in engines:
        r = Run(engine, monkeypatch)
        pending, ids = list(arrivals), []
        while pending or engine.has_unfinished_requests():
            while pending and pending[0][0] <= r.forwards:
                ids.append(r.add(*pending.pop(0)[1:]))
            r.step()
        runs.append(r)
        finals.append([r.final[i] for i in ids])
        assert_streams_consistent(r)
        assert_nothing_left(engine)
    assert_same(*finals)
    if same_admissions:
        assert runs[1].admissions == runs[0].admissions
    return runs[1]


@pytest.mark.parametrize("prompt_logprobs", [None, 2], ids=["plain", "recording-prompt-logprobs"])
def test_every_prompt_chunk_stays_in_flight(tiny_llama, monkeypatch, prompt_logprobs):
    engines = (make_engine(tiny_llama, async_scheduling=False, block_size=4, max_num_batched_tokens=5),
               make_engine(tiny_llama, async_scheduling_eager=True, block_size=4, max_num_batched_tokens=5))
    launched = _admitting_steps_left_in_flight(engines[1], monkeypatch)
    compare(engines, monkeypatch, [(PROMPTS[1], greedy(6, prompt_logprobs=prompt_logprobs))])
    num_prompt = len(engines[1].tokenize(PROMPTS[1]))
    assert launched == [5] * (num_prompt // 5) + [num_prompt % 5] * bool(num_prompt % 5)


@pytest.mark.parametrize("budget", [1, 2])
def test_one_token_prompt_chunks_record_their_prompt_logprobs(tiny_llama, monkeypatch, budget):
    """Chunks of one token beside decode rows record their prompt logprobs in flight, each read back after the
    next chunk is launched."""
    engines = (make_engine(tiny_llama, async_scheduling=False, block_size=4, max_num_batched_tokens=budget),
               make_engine(tiny_llama, async_scheduling_eager=True, block_size=4, max_num_batched_tokens=budget))
    launches = []
    launch = engines[1]._launch_in_flight
    monkeypatch.setattr(engines[1], "_launch_in_flight",
                        lambda scheduled, previous: launches.append(previous) or launch(scheduled, previous))
    r = arrivals_by_forward(engines, monkeypatch, [(0, [7], greedy(5)),
                                                   (2, list(range(100, 110)), greedy(2, prompt_logprobs=0))])
    assert len(r.final[max(r.final, key=int)].prompt_logprobs) == 10
    assert r.drains == 0 and len(launches) == r.forwards


def test_prompts_chunked_beside_a_sequence_ending_by_eos_give_the_synchronous_tokens(tiny_llama, monkeypatch):
    """The EOS ending a sequence in the step in flight is not known when the next step is scheduled: that step
    computes a row for it (so the prompt chunked beside it gets a token fewer) and a later request takes its room a
    step late, as in vLLM; the steps never wait for the one in flight."""
    engines = (make_engine(tiny_llama, async_scheduling=False, block_size=4, max_num_seqs=2, max_num_batched_tokens=4),
               make_engine(tiny_llama, async_scheduling_eager=True, block_size=4, max_num_seqs=2,
                           max_num_batched_tokens=4))
    r = arrivals_by_forward(engines, monkeypatch, [(0, EOS_PROMPT, greedy(20, ignore_eos=False)),
                                                   (9, list(range(100, 120)), greedy(4)), (14, [5, 6], greedy(8)),
                                                   (14, [8, 9], greedy(3))], same_admissions=False)
    assert r.final[min(r.final, key=int)].outputs[0].finish_reason == "stop"
    assert r.drains == 0


@pytest.fixture(scope="module")
def full_engines(tiny_llama):
    """Engines running at most two sequences, so requests wait while the batch is full."""
    return make_engine(tiny_llama, async_scheduling=False, block_size=4, max_num_seqs=2), \
        make_engine(tiny_llama, async_scheduling_eager=True, block_size=4, max_num_seqs=2)


def test_a_full_batch_that_stays_full_overlaps_while_requests_wait(full_engines, monkeypatch):
    _, r = compare(full_engines, monkeypatch, [(p, greedy(4 + 3 * i)) for i, p in enumerate(PROMPTS)])
    assert r.overlapped_with_waiting >= 5


def test_a_sequence_ending_by_its_length_makes_room_for_a_waiting_one_without_draining(full_engines, monkeypatch):
    _, r = compare(full_engines, monkeypatch, [(p, greedy(4 + 3 * i)) for i, p in enumerate(PROMPTS)])
    assert r.overlapped_admissions == len(PROMPTS) - 2  # all but the first two, admitted at once
    assert r.drains == 0


def test_a_sequence_ending_at_the_context_end_makes_room_without_draining(tiny_llama, monkeypatch):
    engines = (make_engine(tiny_llama, async_scheduling=False, block_size=4, max_num_seqs=1, max_model_len=24),
               make_engine(tiny_llama, async_scheduling_eager=True, block_size=4, max_num_seqs=1, max_model_len=24))
    expected, r = compare(engines, monkeypatch, [(PROMPTS[3], greedy(None)), (PROMPTS[0], greedy(5))])
    assert len(expected[0].prompt_token_ids) + len(expected[0].outputs[0].token_ids) == 24
    assert (r.overlapped_admissions, r.drains) == (1, 0)


@pytest.mark.parametrize("may_end", [{"ignore_eos": False}, {"stop": [STOP_STRING]}, {"stop_token_ids": [7]}],
                         ids=["eos", "stop-string", "stop-token"])
def test_a_full_batch_that_may_end_any_step_overlaps_while_requests_wait(full_engines, monkeypatch, may_end):
    """Sequences that may end by a token, or by a stop string, do not make the engine wait for the step in flight
    before it admits: a request takes the room of one ending by a token a step later than in sync mode."""
    _, r = compare(full_engines, monkeypatch, [(p, greedy(4 + 3 * i, **may_end)) for i, p in enumerate(PROMPTS)],
                   same_admissions=False)
    assert r.overlapped_with_waiting >= 5 and r.overlapped_admissions == len(PROMPTS) - 2
    assert r.drains == 0


def test_a_request_takes_the_room_of_a_sequence_ended_by_eos_a_step_late(full_engines, monkeypatch):
    """The one place the overlapping engine differs from sync mode: the EOS is read after the next step is launched
    (with a row for the ended sequence, its token dropped), so the waiting request is admitted one forward later."""
    requests = [(EOS_PROMPT, greedy(20, ignore_eos=False)), (PROMPTS[1], greedy(20)), (PROMPTS[2], greedy(3))]
    beside = tuple(full_engines[0].tokenize(PROMPTS[1]))
    progress = []  # how far the sequence running beside had got when the waiting request was admitted
    for engine in full_engines:
        outputs, r = run(engine, monkeypatch, requests)
        assert outputs[0].outputs[0].finish_reason == "stop" and len(outputs[0].outputs[0].token_ids) < 20
        progress.append(next(computed for prompt, _, computed in r.admissions[-1] if prompt == beside))
    assert progress[1] == progress[0] + 1


def test_a_bad_word_completed_by_the_token_in_flight_is_banned_as_in_sync_mode(engines, monkeypatch):
    """The word's middle token is drawn by the step in flight: the next step bans its last token on the device, so
    the engines overlap and give the same, changed, tokens. (The word is three tokens of the free run's output,
    given as token ids: the tiny tokenizer's byte tokens do not decode and encode back to themselves.)"""
    (free,), _ = run(engines[0], monkeypatch, [(PROMPTS[1], greedy(16))])
    tokens = free.outputs[0].token_ids
    monkeypatch.setattr(llm_engine, "bad_words_token_ids", lambda words, tokenizer: [tokens[4:7]] if words else [])
    expected, r = compare(engines, monkeypatch, [(PROMPTS[0], greedy()), (PROMPTS[1], greedy(16, bad_words=["w"]))])
    banned = expected[1].outputs[0].token_ids
    assert banned[:6] == tokens[:6] and banned[6] != tokens[6]
    assert r.overlapped_steps >= 12 and r.drains == 0


PENALTIES = dict(repetition_penalty=1.5, frequency_penalty=0.8, presence_penalty=0.5)


@pytest.mark.parametrize("params", [
    dict(temperature=0.8), dict(temperature=1.2, top_k=20), dict(temperature=1.0, min_p=0.05),
    dict(temperature=1.0, top_p=0.9), dict(temperature=0.0, **PENALTIES), dict(temperature=0.9, **PENALTIES),
    dict(temperature=0.0, logit_bias={5: 3.0, 40: -2.0}), dict(temperature=1.0, allowed_token_ids=[5, 9, 40, 77]),
    dict(temperature=0.0, min_tokens=9, ignore_eos=False), dict(temperature=0.9, bad_words=["ab", "the"]),
], ids=["temperature", "top-k", "min-p", "top-p", "greedy-penalties", "sampled-penalties", "logit-bias",
        "allowed-tokens", "min-tokens", "bad-words"])
def test_steps_drawing_tokens_on_the_device_overlap_and_give_the_synchronous_tokens(engines, monkeypatch, params):
    """No sampling parameter needs anything from the host after the logits: such steps stay in flight as greedy
    ones do, penalties and bad words taking the step in flight's token on the device, each seeded sequence drawing
    from its own generator in both engines (an unseeded one shares the global RNG, so it is not compared)."""
    requests = [(PROMPTS[0], greedy()), (PROMPTS[1], SamplingParams(seed=7, max_tokens=16, **params)),
                (PROMPTS[2], SamplingParams(seed=11, max_tokens=10, n=2, **params))]
    _, r = compare(engines, monkeypatch, requests)
    assert r.overlapped_steps >= 12 and r.drains == 0


def top_logprobs(output) -> list:
    """Each completion's per-token top logprobs: token ids and ranks exactly, values to float32 noise."""
    return [_approximate_positions(c.logprobs) for c in output.outputs]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "with-a-sampled-row"])
def test_steps_reporting_top_logprobs_overlap_and_give_the_synchronous_logprobs(engines, monkeypatch, sampled):
    """Top logprobs are computed on the device and copied back with the tokens, so asking for them keeps a step
    in flight, greedy or sampled."""
    third = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=14, logprobs=0) if sampled else \
        greedy(14, logprobs=0)
    requests = [(PROMPTS[0], greedy(logprobs=3)), (PROMPTS[1], greedy()), (PROMPTS[2], third)]
    sync, overlapped = engines
    expected, _ = run(sync, monkeypatch, requests)
    got, r = run(overlapped, monkeypatch, requests)
    assert_same(expected, got)
    assert [top_logprobs(o) for o in got] == [top_logprobs(o) for o in expected]
    assert [len(position) for position in expected[0].outputs[0].logprobs] == [3] * 12  # the greedy token among them
    assert [len(position) for position in expected[2].outputs[0].logprobs] == [1] * 14  # the chosen token alone
    assert r.overlapped_steps >= 12 and r.drains == 0


def test_steps_overlap_once_min_tokens_are_out(engines, monkeypatch):
    _, r = compare(engines, monkeypatch, [(EOS_PROMPT, greedy(20, ignore_eos=False, min_tokens=14)),
                                       (PROMPTS[0], greedy(20))])
    assert r.overlapped_steps > 0


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, seed=3, max_tokens=6), greedy(6, logprobs=2),
                                    greedy(6, prompt_logprobs=2)], ids=["seeded", "logprobs", "prompt-logprobs"])
def test_a_request_needing_the_full_sampler_is_launched_over_the_step_in_flight(engines, monkeypatch, params):
    """Its step starts before the step in flight is read back, and is sampled once it is."""
    r = _second_request_mid_run(engines, monkeypatch, (PROMPTS[1], greedy(12)), 3, (PROMPTS[4], params))
    assert r.overlapped_admissions == 1


def test_a_one_token_prompt_is_admitted_beside_decode_rows_that_take_their_ids_on_the_device(engines, monkeypatch):
    token = engines[0].tokenize(PROMPTS[0])[-1]
    r = _second_request_mid_run(engines, monkeypatch, (PROMPTS[1], greedy(12)), 3, ([token], greedy(6)))
    assert r.overlapped_admissions == 1


def test_requests_added_while_a_step_is_in_flight_match_sync_mode(engines, monkeypatch):
    r = _second_request_mid_run(engines, monkeypatch, (PROMPTS[1], greedy(16)), 4, (PROMPTS[2], greedy(8)))
    assert r.overlapped_steps > 0


def test_aborting_a_request_in_flight_drops_its_token_and_frees_it(engines, monkeypatch):
    overlapped = engines[1]
    expected, r, ids = _three_steps_in(engines, monkeypatch)
    aborted = overlapped.abort(ids[1])
    r.keep(aborted)
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    r.to_end()
    assert_streams_consistent(r)
    tokens = aborted.outputs[0].token_ids
    assert 0 < len(tokens) < 16 and tokens == expected[1].outputs[0].token_ids[:len(tokens)]
    assert r.streamed[ids[1]][-1] is aborted  # nothing streamed after the abort
    assert_same([expected[0], expected[2]], [r.final[ids[0]], r.final[ids[2]]])
    assert_nothing_left(overlapped)


def test_aborting_everything_in_flight_leaves_nothing_behind(engines, monkeypatch):
    overlapped = engines[1]
    r = Run(overlapped, monkeypatch)
    ids = [r.add(p, greedy(16)) for p in PROMPTS]
    while r.overlapped_steps < 2:
        r.step()
    for request_id in ids:
        overlapped.abort(request_id)
    assert overlapped.has_unfinished_requests()  # a step is still in flight
    assert r.engine.step() == []
    assert_nothing_left(overlapped)


def test_aborting_a_request_while_its_prompt_logprobs_are_in_flight_frees_it(tiny_llama, monkeypatch):
    engines = (make_engine(tiny_llama, async_scheduling=False, block_size=4, max_num_batched_tokens=5),
               make_engine(tiny_llama, async_scheduling_eager=True, block_size=4, max_num_batched_tokens=5))
    expected, _ = run(engines[0], monkeypatch, [(PROMPTS[0], greedy(8))])
    overlapped = engines[1]
    r = Run(overlapped, monkeypatch)
    kept = r.add(PROMPTS[0], greedy(8))
    scored = r.add(PROMPTS[1], greedy(4, prompt_logprobs=2))
    while not (overlapped._in_flight and overlapped._in_flight.prompt_logprobs):
        r.step()
    r.keep(overlapped.abort(scored))
    r.to_end()
    assert r.final[scored].outputs[0].finish_reason == "abort"
    assert_same(expected, [r.final[kept]])
    assert_nothing_left(overlapped)


def test_preemption_under_a_tiny_kv_cache_gives_the_synchronous_tokens(tiny_llama, monkeypatch):
    engines = (make_engine(tiny_llama, async_scheduling=False, block_size=4, num_kv_blocks=24),
               make_engine(tiny_llama, async_scheduling_eager=True, block_size=4, num_kv_blocks=24))
    requests = [(p, greedy(24, prompt_logprobs=2 if i % 2 else None)) for i, p in enumerate(PROMPTS)]
    _, r = compare(engines, monkeypatch, requests)
    assert engines[1].scheduler.num_preemptions > 0
    assert r.overlapped_steps > 0


def test_a_sequence_may_end_at_max_model_len(tiny_llama, monkeypatch):
    """The step in flight when it ends computes one token more: its last position must still fit."""
    engines = (make_engine(tiny_llama, async_scheduling=False, max_model_len=24, block_size=4),
               make_engine(tiny_llama, async_scheduling_eager=True, max_model_len=24, block_size=4))
    prompt = engines[0].tokenize(PROMPTS[3])
    compare(engines, monkeypatch, [(prompt, greedy(24 - len(prompt))), (PROMPTS[0], greedy(None))])


@pytest.fixture(scope="module")
def lora_engines(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("async-adapters")
    adapters = [LoRARequest(f"a{i}", i + 1, str(make_peft_adapter(tiny_llama, root / f"a{i}", seed=20 + i)))
                for i in range(3)]
    kwargs = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "block_size": 4}
    return adapters, (make_engine(tiny_llama, async_scheduling=False, **kwargs),
                      make_engine(tiny_llama, async_scheduling_eager=True, **kwargs))


def test_mixed_adapters_match_sync_mode_and_release_their_pins(lora_engines, monkeypatch):
    adapters, engines = lora_engines
    loras = [None, *adapters]
    _, r = compare(engines, monkeypatch, [(p, greedy(6 + i), loras[i % 4]) for i, p in enumerate(PROMPTS)],
                   same_admissions=False)
    assert r.overlapped_steps > 0


def test_offline_generate_matches_sync_mode_and_leaves_no_step_in_flight(tiny_llama):
    params = [greedy(10), greedy(20, ignore_eos=False), greedy(5, n=2)]
    prompts = [PROMPTS[0], EOS_PROMPT, PROMPTS[2]]
    llms = [LLM(str(tiny_llama), device="cpu", dtype="float32", **kwargs)
            for kwargs in ({"async_scheduling": False}, {"async_scheduling_eager": True})]
    assert_same(*(llm.generate(prompts, params, use_tqdm=False) for llm in llms))
    assert_nothing_left(llms[1].engine)


def test_the_async_front_streams_the_synchronous_tokens(engines, monkeypatch):
    sync, overlapped = engines
    expected, _ = run(sync, monkeypatch, [(p, greedy()) for p in PROMPTS])
    front = AsyncEngine(engine=overlapped)

    async def collect(prompt):
        return [o async for o in front.generate(prompt, greedy())]

    async def main():
        return await asyncio.gather(*(collect(p) for p in PROMPTS))

    try:
        streams = asyncio.run(main())
    finally:
        front.shutdown()
    assert_same(expected, [stream[-1] for stream in streams])
    assert not any(o.finished for stream in streams for o in stream[:-1])
    while overlapped.has_unfinished_requests():  # the front may stop before reading back the last step
        assert overlapped.step() == []
    assert_nothing_left(overlapped)


def test_drain_reads_back_the_step_in_flight(engines, monkeypatch):
    sync, overlapped = engines
    expected, _ = run(sync, monkeypatch, [(PROMPTS[1], greedy(16))])
    r = Run(overlapped, monkeypatch)
    request_id = r.add(PROMPTS[1], greedy(16))
    while r.overlapped_steps < 2:
        r.step()
    for output in overlapped.drain():
        r.keep(output)
    (seq,) = overlapped.requests[request_id].sequences
    assert IN_FLIGHT_TOKEN not in seq.token_ids and seq.num_computed_tokens == len(seq.token_ids) - 1
    assert overlapped.drain() == []
    r.to_end()
    assert_same(expected, [r.final[request_id]])
    assert_streams_consistent(r)
    assert_nothing_left(overlapped)


def test_an_adapter_read_error_while_a_step_is_in_flight_fails_only_its_request(lora_engines, monkeypatch, tmp_path):
    import shutil

    adapters, engines = lora_engines
    expected, _ = run(engines[0], monkeypatch, [(PROMPTS[1], greedy(16), adapters[0])])
    overlapped = engines[1]
    broken = LoRARequest("broken", 50, str(shutil.copytree(adapters[1].lora_path, tmp_path / "broken")))
    r = Run(overlapped, monkeypatch)
    good = r.add(PROMPTS[1], greedy(16), adapters[0])
    while r.overlapped_steps < 2:
        r.step()
    doomed = r.add(PROMPTS[2], greedy(16), broken)
    (tmp_path / "broken" / "adapter_model.safetensors").write_bytes(b"gone")
    r.to_end()
    assert set(overlapped.take_errors()) == {doomed}
    assert_same(expected, [r.final[good]])
    assert_streams_consistent(r)
    assert_nothing_left(overlapped)
    overlapped.lora_manager.remove(broken.lora_int_id)


def test_steps_overlap_while_requests_wait_for_an_adapter_slot(lora_engines, monkeypatch):
    adapters, engines = lora_engines
    first, second, third = adapters  # two slots: the third adapter's requests wait for one to free
    requests = [(PROMPTS[0], greedy(10), first), (PROMPTS[1], greedy(16), second), (PROMPTS[2], greedy(12), first),
                (PROMPTS[3], greedy(6), third), (PROMPTS[4], greedy(5), third)]
    _, r = compare(engines, monkeypatch, requests, same_admissions=False)
    assert r.overlapped_with_waiting > 0


def test_a_read_error_for_a_request_waiting_on_a_slot_fails_it_while_steps_overlap(tiny_llama, lora_engines,
                                                                                     monkeypatch, tmp_path):
    """Room for a third adapter in host memory, so its read starts while both slots are held; the read fails
    in a decode step launched with the previous one in flight, which fails that request alone."""
    import shutil

    adapters, (sync, _) = lora_engines
    first, second, third = adapters
    good_requests = [(PROMPTS[1], greedy(16), first), (PROMPTS[2], greedy(16), second)]
    expected, _ = run(sync, monkeypatch, good_requests)
    overlapped = make_engine(tiny_llama, async_scheduling_eager=True, enable_lora=True, max_loras=2, max_cpu_loras=3,
                             max_lora_rank=8, block_size=4)
    broken = LoRARequest("broken-waiting", 51, str(shutil.copytree(third.lora_path, tmp_path / "broken")))
    r = Run(overlapped, monkeypatch)
    good = [r.add(*request) for request in good_requests]
    while r.overlapped_steps < 2:
        r.step()
    doomed = r.add(PROMPTS[3], greedy(4), broken)  # its header is checked here; its weights are read later
    (tmp_path / "broken" / "adapter_model.safetensors").write_bytes(b"gone")
    r.to_end()
    assert set(overlapped.take_errors()) == {doomed}
    assert r.overlapped_with_waiting > 0
    assert_same(expected, [r.final[i] for i in good])
    assert_nothing_left(overlapped)


def test_blocked_admission_counts_skips_and_drains_as_in_sync_mode(tiny_llama, lora_engines, monkeypatch):
    """Every adapter already in host memory, so admissions do not depend on background reads; a low skip
    limit, so the starvation guard drains a slot during the run. At every forward, the waiting sequences'
    skip counts and the adapter being drained are those of the synchronous engine."""
    adapters, _ = lora_engines
    first, second, third = adapters
    kwargs = {"enable_lora": True, "max_loras": 2, "max_cpu_loras": 3, "max_lora_rank": 8, "block_size": 4}
    engines = (make_engine(tiny_llama, async_scheduling=False, **kwargs),
               make_engine(tiny_llama, async_scheduling_eager=True, **kwargs))
    seen = []
    for engine in engines:
        for lora in adapters:
            engine.lora_manager.add(lora)
        engine.scheduler.max_skips = 2
        states, execute = [], engine.runner.execute

        def recording(*args, engine=engine, states=states, execute=execute):
            if engine.scheduler.waiting:
                states.append((sorted(s.skipped_steps for s in engine.scheduler.waiting), engine.scheduler.draining))
            return execute(*args)

        monkeypatch.setattr(engine.runner, "execute", recording)
        seen.append(states)
    requests = [(PROMPTS[0], greedy(10), first), (PROMPTS[1], greedy(16), second), (PROMPTS[2], greedy(12), first),
                (PROMPTS[3], greedy(6), third), (PROMPTS[4], greedy(5), third), (PROMPTS[5], greedy(9), second)]
    _, r = compare(engines, monkeypatch, requests)
    assert r.overlapped_with_waiting > 0
    assert any(draining is not None for _, draining in seen[0])
    assert seen[1] == seen[0]
