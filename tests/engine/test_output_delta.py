"""Outputs sent across the engine-core pipe as deltas come back as the engine made them, and carry only what changed."""
from __future__ import annotations

import pickle
import random

import pytest

from engine import CompletionOutput, FlatLogprobs, Logprob, RequestOutput
from engine.output_delta import DeltaDecoder, DeltaEncoder


def _position(rng: random.Random) -> dict[int, Logprob]:
    return {rng.randrange(1000): Logprob(-rng.random(), rank, f"t{rank}") for rank in range(1, rng.randint(1, 3) + 1)}


def _growing_outputs(rng: random.Random, request_id: str, *, n: int, flat: bool, steps: int,
                     logprobs: bool = True) -> list[RequestOutput]:
    """The cumulative outputs of one request: tokens, text and logprobs grow each step; some steps add no text (a
    character split over tokens); the last step cuts the text back (a stop string) and finishes."""
    record = FlatLogprobs if flat else list
    texts, tokens, positions = [""] * n, [[] for _ in range(n)], [[] for _ in range(n)]
    prompt_positions = [None] + [_position(rng) for _ in range(4)]
    outputs = []
    for step in range(steps):
        last = step == steps - 1
        completions = []
        for i in range(n):
            tokens[i].append(rng.randrange(1000))
            positions[i].append(_position(rng))
            if rng.random() < 0.7:
                texts[i] += rng.choice(["a", " b", "ç", "\n", "日本"])
            text = texts[i][: max(len(texts[i]) - 2, 0)] if last else texts[i]
            completions.append(CompletionOutput(
                i, text, list(tokens[i]), -rng.random() * step, record(positions[i]) if logprobs else None,
                finish_reason="stop" if last else None, stop_reason="</s>" if last else None))
        outputs.append(RequestOutput(request_id, "the prompt", [1, 2, 3], completions, last,
                                     prompt_logprobs=record(prompt_positions) if logprobs else None,
                                     lora_name="alpha"))
    return outputs


def _round_trip(outputs: list[RequestOutput]) -> list[RequestOutput]:
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    return [decoder.decode(pickle.loads(pickle.dumps(encoder.encode(output)))) for output in outputs]


@pytest.mark.parametrize("flat", [False, True], ids=["lists", "flat"])
@pytest.mark.parametrize("n", [1, 3])
def test_decoded_outputs_equal_the_engine_outputs(flat, n):
    rng = random.Random(n * 10 + flat)
    outputs = _growing_outputs(rng, "r", n=n, flat=flat, steps=12)
    assert _round_trip(outputs) == outputs


def test_outputs_without_logprobs_round_trip():
    outputs = _growing_outputs(random.Random(5), "r", n=2, flat=False, steps=6, logprobs=False)
    decoded = _round_trip(outputs)
    assert decoded == outputs
    assert all(c.logprobs is None for output in decoded for c in output.outputs)


def test_interleaved_requests_keep_apart():
    rng = random.Random(3)
    first = _growing_outputs(rng, "one", n=1, flat=False, steps=5)
    second = _growing_outputs(rng, "two", n=2, flat=True, steps=7)
    order = [first[0], second[0], second[1], first[1], first[2], second[2], first[3], second[3], first[4],
             *second[4:]]
    assert _round_trip(order) == order


def test_a_delta_carries_only_the_new_tokens_and_text():
    outputs = _growing_outputs(random.Random(1), "r", n=1, flat=False, steps=8)
    encoder = DeltaEncoder()
    deltas = [encoder.encode(output) for output in outputs]
    assert deltas[0].first is not None and all(delta.first is None for delta in deltas[1:])
    assert all(len(delta.completions[0].new_token_ids) == 1 for delta in deltas)
    assert all(len(delta.completions[0].new_logprobs) == 1 for delta in deltas)
    assert len(deltas[0].new_prompt_logprobs) == 5 and all(len(d.new_prompt_logprobs) == 0 for d in deltas[1:])
    middle = deltas[1:-1]
    previous_texts = [output.outputs[0].text for output in outputs[:-2]]
    assert [delta.completions[0].text_kept for delta in middle] == [len(text) for text in previous_texts]


def test_earlier_decoded_outputs_do_not_change_as_later_ones_arrive():
    outputs = _growing_outputs(random.Random(2), "r", n=1, flat=False, steps=6)
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    first = decoder.decode(encoder.encode(outputs[0]))
    snapshot = pickle.loads(pickle.dumps(first))
    for output in outputs[1:]:
        decoder.decode(encoder.encode(output))
    assert first == snapshot


def test_finished_and_forgotten_requests_leave_no_state():
    rng = random.Random(4)
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    for output in _growing_outputs(rng, "done", n=1, flat=False, steps=3):
        decoder.decode(encoder.encode(output))
    aborted = _growing_outputs(rng, "aborted", n=1, flat=False, steps=3)[0]
    decoder.decode(encoder.encode(aborted))
    encoder.forget("aborted")
    decoder.forget("aborted")
    assert encoder._sent == {} and decoder._outputs == {}
