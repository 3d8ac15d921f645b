"""Async scheduling against the synchronous engine on random workloads: the same final outputs, admissions and
preemptions at the same point (unless a request may end by a token, whose room async scheduling admits into a step
later), and nothing left behind, whatever the engine's limits, the requests' sampling and endings, their arrivals
and aborts."""
from __future__ import annotations

import random

import pytest

from engine import LoRARequest, SamplingParams
from engine.sequence import SequenceStatus
from tests.engine.conftest import make_engine
from tests.engine.test_async_scheduling import assert_nothing_left, summary, top_logprobs
from tests.tiny_models import make_peft_adapter

SEEDS = range(100)
VOCAB = 384  # the tiny models' tokenizer's


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("fuzz-adapters")
    return [LoRARequest(f"f{i}", i + 1, str(make_peft_adapter(tiny_llama, root / f"f{i}", r=rank, seed=50 + i)))
            for i, rank in enumerate([2, 4, 8])]


def random_case(seed: int) -> tuple[dict, list[tuple], list[tuple]]:
    """Engine settings; requests (forward they arrive before, prompt ids, params, adapter index or None); aborts
    (forward, request index). Most requests end by their length alone, the path async scheduling admits over."""
    rng = random.Random(seed)
    max_model_len = rng.choice([24, 32, 48])
    config = dict(block_size=rng.randint(2, 8), max_num_seqs=rng.randint(1, 4), max_model_len=max_model_len,
                  max_num_batched_tokens=rng.choice([2, 3, 5, 8, 16, None]),
                  admission_order=rng.choice(["fcfs", "balanced"]), suspend_margin=rng.choice([None, 1, 4]))
    if rng.random() < 0.5:
        config.update(enable_lora=True, max_loras=rng.randint(1, 2), max_lora_rank=8, max_cpu_loras=3)
    requests, forward = [], 0
    for _ in range(rng.randint(2, 8)):
        forward += rng.choice([0, 0, 1, 3, 6])
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 20))]
        params = dict(temperature=0.0, max_tokens=rng.randint(1, min(16, max_model_len - len(prompt))),
                      ignore_eos=True)
        ending = rng.random()
        if ending < 0.15:
            params["ignore_eos"] = False
        elif ending < 0.25:
            params["stop_token_ids"] = [rng.randrange(3, VOCAB) for _ in range(3)]
        for key, value, chance in [
                ("prompt_logprobs", 1, 0.1), ("logprobs", 2, 0.1), ("n", 2, 0.1), ("repetition_penalty", 1.4, 0.1),
                ("frequency_penalty", 0.7, 0.1), ("presence_penalty", 0.6, 0.1),
                ("logit_bias", {rng.randrange(3, VOCAB): 5.0}, 0.05),
                ("allowed_token_ids", rng.sample(range(VOCAB), 20), 0.05),
                ("min_tokens", min(4, params["max_tokens"]), 0.05), ("bad_words", ["ab", "c"], 0.05)]:
            if rng.random() < chance:
                params[key] = value
        if "logprobs" in params or "prompt_logprobs" in params:  # either record kind, drawing nothing more
            params["flat_logprobs"] = len(prompt) % 2 == 0
        if rng.random() < 0.15:  # a seeded draw
            params.update(temperature=1.0, seed=rng.randrange(1000),
                          **rng.choice([{}, {"top_k": 5}, {"min_p": 0.05}, {"top_p": 0.9}]))
        adapter = rng.randrange(3) if config.get("enable_lora") and rng.random() < 0.75 else None
        requests.append((forward, prompt, params, adapter))
    if rng.random() < 0.4:  # a cache that holds little more than the longest request: preemptions
        longest = max(len(prompt) + params["max_tokens"] for _, prompt, params, _ in requests)
        config["num_kv_blocks"] = -(-longest // config["block_size"]) + rng.randint(0, 2)
    aborts = [(rng.randrange(forward + 10), rng.randrange(len(requests))) for _ in range(rng.randrange(3))]
    return config, requests, aborts


class Replay:
    """Runs a case on one engine. Its clock counts forwards, but not one whose every sequence had ended in the step
    in flight when it was launched (the async engine computes it for nothing), so both engines see each arrival and
    abort at the same point; admissions and preemptions are noted with it."""

    def __init__(self, engine, adapters: list[LoRARequest]):
        self.engine, self.adapters = engine, adapters
        self.clock, self.launched = 0, None
        self.events: list[tuple] = []
        self.streamed: dict[str, list] = {}
        self.final: dict[str, object] = {}
        execute, schedule, read_back = engine.runner.execute, engine.scheduler.schedule, engine._read_back

        def counting(scheduled, slots, device_tokens=None):
            self.launched = [item.seq for item in scheduled]
            return execute(scheduled, slots, device_tokens)

        def recording():
            waiting = set(map(id, engine.scheduler.waiting))
            plan = schedule()
            admitted = sorted((item.seq.request.request_id, item.seq.index) for item in plan.scheduled
                              if id(item.seq) in waiting)
            preempted = sorted((seq.request.request_id, seq.index) for seq in plan.preempted)
            if admitted or preempted:
                self.events.append((self.clock, admitted, preempted))
            return plan

        def settling(step):
            outputs = read_back(step)
            if self.launched is not None:  # launched over `step`: counted once `step` tells which sequences ended
                self.clock += any(seq.status is not SequenceStatus.FINISHED for seq in self.launched)
                self.launched = None
            return outputs

        engine.runner.execute, engine.scheduler.schedule, engine._read_back = counting, recording, settling

    def run(self, requests: list[tuple], aborts: list[tuple]) -> None:
        engine, pending, aborts = self.engine, list(requests), sorted(aborts)
        ids: list[str] = []
        for _ in range(2000):
            while pending and pending[0][0] <= self.clock:
                _, prompt, params, adapter = pending.pop(0)
                lora = self.adapters[adapter] if adapter is not None else None
                ids.append(engine.add_request(prompt, SamplingParams(**params), lora))
            while aborts and aborts[0][0] <= self.clock:
                index = aborts.pop(0)[1]
                if index < len(ids) and engine.abort(ids[index]) is not None:
                    self.final.pop(ids[index], None)
                    self.final[ids[index]] = "aborted"
            if not engine.has_unfinished_requests():
                if not pending:
                    return
                self.clock = pending[0][0]  # idle until the next arrival
                continue
            for output in engine.step():
                self.streamed.setdefault(output.request_id, []).append(output)
                if output.finished and self.final.get(output.request_id) != "aborted":
                    self.final[output.request_id] = output
            if self.launched is not None:  # launched over no step in flight: every row ran
                self.clock += 1
                self.launched = None
            assert not any(seq.status is SequenceStatus.ENDING  # retired sequences end in the step that retired them
                           for request in engine.requests.values() for seq in request.sequences)
        raise AssertionError("the case did not finish in 2000 steps")


@pytest.mark.parametrize("seed", SEEDS)
def test_async_scheduling_matches_the_synchronous_engine(tiny_llama, adapters, seed):
    config, requests, aborts = random_case(seed)
    replays = []
    for engine in (make_engine(tiny_llama, async_scheduling=False, **config),
                   make_engine(tiny_llama, async_scheduling_eager=True, **config)):
        if engine.lora_manager is not None:
            for lora in adapters:
                engine.lora_manager.add(lora)
        replay = Replay(engine, adapters)
        replay.run(requests, aborts)
        replays.append(replay)
        assert_nothing_left(engine)
    expected, got = replays
    if not any(params.get("stop_token_ids") or not params["ignore_eos"] for _, _, params, _ in requests):
        assert got.events == expected.events
    assert set(got.final) == set(expected.final)
    for request_id, output in expected.final.items():
        if "aborted" in (output, got.final[request_id]):  # an abort may find the last token in flight, by design
            continue
        assert summary(got.final[request_id]) == summary(output)
        assert top_logprobs(got.final[request_id]) == top_logprobs(output)
        for streamed in got.streamed[request_id]:  # each a prefix of the final output, without a placeholder
            for completion, final in zip(streamed.outputs, got.final[request_id].outputs):
                assert completion.token_ids == final.token_ids[:len(completion.token_ids)]
