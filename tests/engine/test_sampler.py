import array

import pytest
import torch

from engine.logits_processors import process_logits
from engine.logprobs import PromptLogprobs, compute_logprobs
from engine.sampler import Sampler, is_plain_greedy, make_generator
from engine.sampling_params import SamplingParams
from engine.sampling_row import SamplingRow
from engine.sequence import IN_FLIGHT_TOKEN

EOS = 2
VOCAB = 50
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu,
                                              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")])]


def row(params=None, prompt=(), output=(), generator=None, bad_words=(), **kwargs):
    params = params or SamplingParams(**kwargs)
    return SamplingRow(params, list(prompt), list(output), generator, [list(word) for word in bad_words])


def sample(logits, rows, vocab=None):
    return Sampler({EOS}, vocab or logits.shape[-1])(logits, rows)


def random_logits(batch, vocab=VOCAB, seed=0, device="cpu"):
    return (torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3).to(device)


def frequencies(logits_row, params, draws=20000):
    """Empirical distribution of draws from one row of logits (a batch of identical rows)."""
    torch.manual_seed(0)
    logits = logits_row.expand(draws, -1).clone()
    tokens = torch.tensor([t.token_id for t in sample(logits, [row(params) for _ in range(draws)])])
    return torch.bincount(tokens, minlength=logits.shape[-1]).float() / draws


# -- choosing ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_of_each_row(device):
    logits = random_logits(8, device=device)
    tokens = [t.token_id for t in sample(logits, [row(temperature=0.0) for _ in range(8)])]
    assert tokens == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_fast_path_gives_the_general_paths_tokens_and_logprobs(device):
    logits = random_logits(16, vocab=VOCAB + 6, seed=11, device=device).to(torch.bfloat16)
    logits[:, VOCAB:] = 100.0  # padded vocabulary columns: never chosen by either path
    logits[3, 7] = logits[3, 9] = 50.0  # a tie: both paths take the first
    sampler = Sampler({EOS}, VOCAB)
    general = sampler(logits, [row(temperature=0.0) for _ in range(16)])
    fast = sampler.greedy(logits)
    assert [(t.token_id, t.top_logprobs) for t in fast] == [(t.token_id, t.top_logprobs) for t in general]
    # on CUDA the fast path's log-sum-exp is the Triton kernel's: equal up to float32 rounding
    torch.testing.assert_close(torch.tensor([t.logprob for t in fast]), torch.tensor([t.logprob for t in general]),
                               rtol=1e-5, atol=1e-5)
    assert fast[3].token_id == 7


@pytest.mark.parametrize("params, num_output, plain", [
    (SamplingParams(temperature=0.0), 0, True),
    (SamplingParams(temperature=0.0, min_tokens=3), 3, True),
    (SamplingParams(temperature=0.0, min_tokens=3), 2, False),
    (SamplingParams(temperature=0.5), 0, False),
    (SamplingParams(temperature=0.0, logprobs=0), 0, False),
    (SamplingParams(temperature=0.0, logit_bias={1: 1.0}), 0, False),
    (SamplingParams(temperature=0.0, repetition_penalty=1.2), 0, False),
    (SamplingParams(temperature=0.0, frequency_penalty=0.5), 0, False),
    (SamplingParams(temperature=0.0, presence_penalty=0.5), 0, False),
])
def test_plain_greedy_rows_are_those_the_general_path_leaves_at_the_raw_argmax(params, num_output, plain):
    assert is_plain_greedy(params, num_output) is plain


def rows_of_every_kind(device):
    """Greedy, temperature, top-k, min-p and top-p rows, seeded and not, with top logprobs, logit bias, allowed
    tokens, min_tokens, penalties and bad words; fresh generators each call."""
    return [row(temperature=0.0), row(temperature=0.8, generator=make_generator(5, 0, device)),
            row(temperature=1.2, top_k=7, generator=make_generator(5, 1, device)),
            row(temperature=1.0, min_p=0.05, generator=make_generator(9, 0, device)),
            row(temperature=0.9, top_k=3, min_p=0.2, generator=make_generator(9, 1, device)),
            row(temperature=1.1, top_p=0.8, generator=make_generator(3, 0, device)),
            row(temperature=0.0, logprobs=3), row(temperature=0.7, logprobs=1, generator=make_generator(3, 1, device)),
            row(temperature=0.0, logit_bias={7: 4.0, 9: float("inf")}),
            row(temperature=0.9, allowed_token_ids=[3, 4, 11], generator=make_generator(4, 0, device)),
            row(temperature=0.0, min_tokens=4, output=[5]),
            row(temperature=0.8, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3, prompt=[4, 8],
                output=[6, 6, 12], generator=make_generator(4, 1, device)),
            row(temperature=0.0, output=[3, 5], bad_words=[[5, 9], [4]])]


@pytest.mark.parametrize("device", DEVICES)
def test_pending_draws_what_a_call_draws_and_reports_the_same_logprobs(device):
    logits = random_logits(13, device=device)
    sampler = Sampler({EOS}, VOCAB)
    drawn = sampler.pending(logits, rows_of_every_kind(device)).result()
    called = sampler(logits, rows_of_every_kind(device))
    assert [(t.token_id, t.logprob, t.top_logprobs) for t in drawn] == [(t.token_id, t.logprob, t.top_logprobs)
                                                                        for t in called]
    assert [len(t.top_logprobs or ()) for t in drawn][6:8] in ([3, 1], [3, 2])


@pytest.mark.parametrize("device", DEVICES)
def test_a_penalized_row_finds_its_last_token_among_the_tokens_in_flight(device):
    """Async scheduling: the host holds a placeholder for the token the step in flight drew; the penalties count
    the token itself, taken from that step's tokens on the device."""
    logits = random_logits(2, device=device)
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=1.0, repetition_penalty=1.5)
    in_flight = torch.tensor([31, 12, 40], device=device)
    placeholder = [SamplingRow(params, [4], [6, 12, IN_FLIGHT_TOKEN], in_flight_row=2),
                   SamplingRow(params, [4], [IN_FLIGHT_TOKEN], in_flight_row=0)]
    known = [row(params, prompt=[4], output=[6, 12, 40]), row(params, prompt=[4], output=[31])]
    assert torch.equal(process_logits(logits, placeholder, {EOS}, in_flight), process_logits(logits, known, {EOS}))
    assert not torch.equal(process_logits(logits, known, {EOS}), logits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_flight_token", [8, 9], ids=["completes-the-word", "does-not"])
def test_a_bad_word_waiting_on_the_token_in_flight_is_banned_on_the_device(device, in_flight_token):
    """The output's last token is still in flight: a word whose tokens before it match is banned if, on the device,
    that token is the one the word needs. Single-token words and words already matched on the host are banned as
    before; words whose host tokens do not match are not."""
    logits = random_logits(2, device=device)
    words = [[7, 8, 11], [5, 8, 12], [13], [8, 14], [6, 15], [7, 9, 16]]
    in_flight = torch.tensor([0, in_flight_token], device=device)
    placeholder = [SamplingRow(SamplingParams(), [], [1, 7, IN_FLIGHT_TOKEN], None, words, in_flight_row=1),
                   SamplingRow(SamplingParams(), [], [6, IN_FLIGHT_TOKEN], None, words, in_flight_row=0)]
    known = [row(output=[1, 7, in_flight_token], bad_words=words), row(output=[6, 0], bad_words=words)]
    on_device = process_logits(logits, placeholder, {EOS}, in_flight)
    assert torch.equal(on_device, process_logits(logits, known, {EOS}))
    banned = [(on_device[r] == float("-inf")).nonzero().flatten().tolist() for r in range(2)]
    assert banned == [[11, 13, 14] if in_flight_token == 8 else [13, 16], [13]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("scale", [0.3, 3.0, 30.0], ids=["flat", "spread", "peaked"])
def test_top_p_on_a_gpu_keeps_the_nucleus_the_cpu_keeps(scale):
    from engine.sampler import _top_p

    probs = (scale * torch.randn(6, 5000, generator=torch.Generator().manual_seed(3))).softmax(dim=-1)
    rows = [row(temperature=1.0, top_p=p) for p in (0.5, 0.9, 0.95, 0.99, 1.0, 0.7)]
    on_cpu = _top_p(probs.clone(), rows)
    on_gpu = _top_p(probs.cuda(), rows).cpu()
    assert torch.equal(on_gpu > 0, on_cpu > 0)
    torch.testing.assert_close(on_gpu, on_cpu)


def test_top_k_one_equals_greedy():
    logits = random_logits(16, seed=1)
    tokens = [t.token_id for t in sample(logits, [row(top_k=1, temperature=1.5) for _ in range(16)])]
    assert tokens == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_equals_greedy():
    logits = random_logits(16, seed=2)
    tokens = [t.token_id for t in sample(logits, [row(top_p=1e-6) for _ in range(16)])]
    assert tokens == logits.argmax(dim=-1).tolist()


def test_temperature_one_draws_from_the_softmax():
    probs = torch.tensor([0.5, 0.3, 0.2])
    freq = frequencies(probs.log(), SamplingParams(temperature=1.0))
    assert torch.allclose(freq, probs, atol=0.015)


def test_temperature_flattens_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    freq = frequencies(probs.log(), SamplingParams(temperature=2.0))
    expected = probs.sqrt() / probs.sqrt().sum()
    assert torch.allclose(freq, expected, atol=0.015)


def test_top_k_renormalizes_over_the_k_most_likely():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    freq = frequencies(probs.log(), SamplingParams(top_k=2))
    assert torch.allclose(freq, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]), atol=0.015)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    freq = frequencies(probs.log(), SamplingParams(top_p=0.75))
    assert torch.allclose(freq, torch.tensor([0.0, 0.625, 0.0, 0.375]), atol=0.015)


def test_top_p_nucleus_wider_than_the_candidate_search_is_exact():
    # 700 nearly equal tokens: the nucleus for top_p=0.5 holds about 330, more than the candidates searched first.
    logits = -torch.arange(700, dtype=torch.float32) * 5e-4
    probs = torch.softmax(logits.double(), dim=-1)
    nucleus = int((probs.cumsum(dim=-1) - probs < 0.5).sum())
    freq = frequencies(logits, SamplingParams(top_p=0.5))
    assert nucleus > 256
    assert freq[nucleus:].sum() == 0
    assert freq[nucleus - 20 : nucleus].sum() > 0
    assert torch.allclose(freq[:nucleus], (probs[:nucleus] / probs[:nucleus].sum()).float(), atol=0.002)


def test_min_p_drops_tokens_below_a_fraction_of_the_most_likely():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    freq = frequencies(probs.log(), SamplingParams(min_p=0.5))
    assert set(freq.nonzero().flatten().tolist()) == {0, 1}
    assert torch.allclose(freq[:2], torch.tensor([4 / 7, 3 / 7]), atol=0.015)


def test_min_p_applies_before_top_p_as_in_vllms_v1_sampler():
    """0.5/0.3/0.2: min_p 0.5 (a threshold of 0.25) keeps the first two, renormalised to 0.625/0.375, of which top_p
    0.6 keeps the first alone. Top-p first would keep the first two (0.5 < 0.6), and min-p then both."""
    probs = torch.tensor([0.5, 0.3, 0.2])
    freq = frequencies(probs.log(), SamplingParams(min_p=0.5, top_p=0.6))
    assert freq.tolist() == [1.0, 0.0, 0.0]


def test_greedy_rows_are_unaffected_by_random_rows_in_the_batch():
    logits = random_logits(6, seed=3)
    rows = [row(temperature=0.0) if i % 2 == 0 else row(temperature=1.0) for i in range(6)]
    tokens = [t.token_id for t in sample(logits, rows)]
    assert tokens[::2] == logits[::2].argmax(dim=-1).tolist()


def test_padded_vocabulary_columns_are_never_chosen():
    logits = torch.zeros(4, 12)
    logits[:, 10:] = 100.0  # columns past the real vocabulary
    tokens = [t.token_id for t in sample(logits, [row(temperature=0.0)] * 2 + [row()] * 2, vocab=10)]
    assert all(t < 10 for t in tokens)


# -- seeds ---------------------------------------------------------------------------------


def run_steps(device, batch_of_step, steps=30):
    """Samples `steps` tokens; batch_of_step(step, logits_for_target) gives (logits, rows, target_index)."""
    tokens = []
    for step in range(steps):
        target_logits = random_logits(1, seed=100 + step, device=device)
        logits, rows, index = batch_of_step(step, target_logits)
        tokens.append(sample(logits, rows)[index].token_id)
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_gives_the_same_tokens_whatever_else_is_in_the_batch(device):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=20, seed=1234)

    def alone(step, target):
        return target, [row(params, generator=alone_gen)], 0

    def crowded(step, target):
        others = random_logits(5, seed=step, device=device)
        logits = torch.cat([others[:3], target, others[3:]])
        rows = [
            row(temperature=1.0),
            row(SamplingParams(temperature=0.5, top_p=0.5, seed=99), generator=other_gen),
            row(temperature=0.0),
            row(params, generator=crowded_gen),
            row(min_p=0.1),
            row(temperature=1.3, top_k=5),
        ]
        return logits, rows, 3

    alone_gen = make_generator(1234, 0, device)
    crowded_gen = make_generator(1234, 0, device)
    other_gen = make_generator(99, 0, device)
    assert run_steps(device, alone) == run_steps(device, crowded)


def test_different_seeds_give_different_tokens():
    params = SamplingParams(temperature=1.0)
    gens = [make_generator(1, 0, "cpu"), make_generator(2, 0, "cpu")]
    runs = [run_steps("cpu", lambda step, target, g=g: (target, [row(params, generator=g)], 0)) for g in gens]
    assert runs[0] != runs[1]


def test_generator_streams_differ_by_completion_index():
    a, b, again = make_generator(7, 0, "cpu"), make_generator(7, 1, "cpu"), make_generator(7, 0, "cpu")
    first = torch.rand(8, generator=a)
    assert not torch.equal(first, torch.rand(8, generator=b))
    assert torch.equal(first, torch.rand(8, generator=again))


# -- logits processing ---------------------------------------------------------------------


def processed(logits, rows):
    return process_logits(logits, rows, {EOS})


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]])
    out = processed(logits, [row(prompt=[0], output=[1, 4], repetition_penalty=2.0)])
    assert torch.equal(out, torch.tensor([[1.0, -2.0, 0.5, 3.0, -1.0]]))


def test_repetition_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[2.0, 1.5]])
    assert sample(logits, [row(prompt=[0], temperature=0.0, repetition_penalty=1.5)])[0].token_id == 1
    assert sample(logits, [row(prompt=[0], temperature=0.0, repetition_penalty=1.2)])[0].token_id == 0


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 5)
    out = processed(logits, [row(prompt=[3, 3], output=[1, 1, 2], frequency_penalty=0.5, presence_penalty=0.25)])
    assert torch.equal(out, torch.tensor([[0.0, -1.25, -0.75, 0.0, 0.0]]))


def test_penalties_apply_per_row():
    logits = torch.ones(3, 4)
    rows = [
        row(output=[0], frequency_penalty=1.0),
        row(output=[0]),
        row(prompt=[1], output=[2], repetition_penalty=4.0),
    ]
    out = processed(logits, rows)
    expected = torch.tensor([[0.0, 1, 1, 1], [1, 1, 1, 1], [1, 0.25, 0.25, 1]])
    assert torch.equal(out, expected)


def test_penalties_count_rows_with_empty_outputs_and_prompts_between_others():
    logits = torch.ones(5, 6)
    rows = [row(prompt=[], output=[], presence_penalty=1.0, repetition_penalty=2.0),
            row(prompt=[5], output=[3, 3], frequency_penalty=0.25, repetition_penalty=2.0),
            row(prompt=[], output=[], frequency_penalty=1.0),
            row(prompt=[0, 1], output=[], repetition_penalty=4.0),
            row(prompt=[], output=[4], presence_penalty=0.5)]
    out = processed(logits, rows)
    expected = torch.tensor([[1.0] * 6, [1, 1, 1, 0, 1, 0.5], [1.0] * 6, [0.25, 0.25, 1, 1, 1, 1],
                             [1, 1, 1, 1, 0.5, 1]])
    assert torch.equal(out, expected)


def test_penalties_of_rows_with_no_tokens_yet_leave_the_logits_as_they_are():
    """A first step: nothing generated, and an empty prompt (the repetition penalty has nothing to look at)."""
    logits = torch.randn(2, 6)
    rows = [row(output=[], frequency_penalty=1.0, presence_penalty=0.5), row(repetition_penalty=2.0)]
    assert torch.equal(processed(logits, rows), logits)


def penalized_in_float64(logits, rows):
    """vLLM's penalties as dense tables, row by row, in float64: the reference."""
    out = logits.double().clone()
    for i, r in enumerate(rows):
        seen = torch.zeros(logits.shape[-1], dtype=torch.bool)
        seen[list(r.prompt_token_ids) + list(r.output_token_ids)] = True
        rep = r.params.repetition_penalty
        out[i] = torch.where(seen, torch.where(out[i] > 0, out[i] / rep, out[i] * rep), out[i])
        counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.long), minlength=logits.shape[-1])
        out[i] -= r.params.frequency_penalty * counts + r.params.presence_penalty * (counts > 0)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(3))
def test_penalties_of_random_rows_match_dense_float64_tables(device, seed):
    """Rows with repeated tokens, empty prompts or outputs, each penalty on or off, and an int64-array prompt as the
    engine passes it: the cells the penalties touch are the dense tables' cells."""
    gen = torch.Generator().manual_seed(seed)
    vocab, rows = 97, []
    for i in range(24):
        prompt = torch.randint(vocab, (int(torch.randint(0, 40, (1,), generator=gen)),), generator=gen).tolist()
        output = torch.randint(20, (int(torch.randint(0, 30, (1,), generator=gen)),), generator=gen).tolist()
        on = torch.rand(3, generator=gen) < 0.6
        rows.append(row(prompt=prompt, output=output, temperature=0.8, repetition_penalty=1.3 if on[0] else 1.0,
                        frequency_penalty=0.4 if on[1] else 0.0, presence_penalty=0.7 if on[2] else 0.0))
        if i % 2:
            rows[-1].prompt_token_ids = array.array("q", prompt)
    logits = torch.randn(24, vocab, generator=gen) * 3
    out = processed(logits.to(device), rows).cpu()
    torch.testing.assert_close(out.double(), penalized_in_float64(logits, rows), rtol=1e-6, atol=1e-6)


def test_a_disallowed_token_stays_out_whatever_its_bias():
    logits = torch.zeros(1, 6)
    out = processed(logits, [row(allowed_token_ids=[1, 2], logit_bias={4: float("inf"), 2: 1.0})])
    assert out.tolist() == [[float("-inf"), 0.0, 1.0, float("-inf"), float("-inf"), float("-inf")]]


def test_a_sequence_ending_in_a_placeholder_needs_its_in_flight_row():
    with pytest.raises(ValueError, match="in_flight_row"):
        processed(torch.zeros(1, 6), [row(output=[3, IN_FLIGHT_TOKEN], frequency_penalty=1.0)])


def test_a_chosen_tokens_rank_does_not_depend_on_what_other_rows_ask_for():
    """Tied logits: the chosen token's rank counts the tokens strictly more likely, unless it is among the row's own
    top logprobs, whichever top logprobs another row of the batch wants."""
    logits = torch.tensor([[5.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * 2)
    alone = sample(logits[:1], [row(temperature=0.0, logprobs=1, allowed_token_ids=[1])])[0]
    beside = sample(logits, [row(temperature=0.0, logprobs=1, allowed_token_ids=[1]),
                             row(temperature=0.0, logprobs=6)])[0]
    assert alone.token_id == beside.token_id == 1
    assert alone.top_logprobs[1].rank == beside.top_logprobs[1].rank == 2
    assert alone.top_logprobs == beside.top_logprobs


def test_processing_leaves_the_callers_logits_alone():
    logits = torch.ones(1, 4)
    processed(logits, [row(output=[0], presence_penalty=1.0, logit_bias={1: 2.0})])
    assert torch.equal(logits, torch.ones(1, 4))


def test_logit_bias_is_added_to_the_logits():
    logits = torch.zeros(2, 4)
    out = processed(logits, [row(logit_bias={1: 5.0, 3: -2.5}), row()])
    assert torch.equal(out, torch.tensor([[0.0, 5.0, 0.0, -2.5], [0.0, 0.0, 0.0, 0.0]]))


def test_logit_bias_can_force_a_token():
    logits = random_logits(1)
    assert sample(logits, [row(logit_bias={7: 100.0})])[0].token_id == 7


def test_an_infinite_logit_bias_forces_its_token_when_sampling_too():
    logits = random_logits(1)
    for seed in range(5):
        params = dict(temperature=1.0, seed=seed)
        assert sample(logits, [row(logit_bias={7: float("inf")}, **params)])[0].token_id == 7
        assert sample(logits, [row(logit_bias={3: float("inf"), 4: float("inf")}, **params)])[0].token_id in {3, 4}


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached_even_under_ignore_eos():
    """As vLLM: ignore_eos lets EOS be drawn without ending the sequence, but not before min_tokens."""
    logits = torch.zeros(3, 6)
    rows = [
        row(output=[4], min_tokens=2, stop_token_ids=[5]),
        row(output=[4, 4], min_tokens=2, stop_token_ids=[5]),
        row(output=[4], min_tokens=2, stop_token_ids=[5], ignore_eos=True),
    ]
    out = processed(logits, rows)
    inf = float("-inf")
    assert torch.equal(out[0], torch.tensor([0, 0, inf, 0, 0, inf]))
    assert torch.equal(out[1], torch.zeros(6))
    assert torch.equal(out[2], torch.tensor([0, 0, inf, 0, 0, inf]))


def test_min_tokens_keeps_greedy_off_eos():
    logits = torch.tensor([[0.0, 1.0, 9.0]])
    assert sample(logits, [row(temperature=0.0, min_tokens=1)])[0].token_id == 1


def test_out_of_vocabulary_logit_bias_is_rejected_up_front():
    with pytest.raises(ValueError, match="logit_bias"):
        Sampler({EOS}, VOCAB).validate(SamplingParams(logit_bias={VOCAB: 1.0}))


# -- logprobs ------------------------------------------------------------------------------


def test_logprob_is_the_raw_log_softmax_of_the_chosen_token():
    logits = random_logits(4, seed=5)
    rows = [
        row(temperature=0.0),
        row(temperature=0.7, presence_penalty=1.0, output=[1, 2]),
        row(top_k=3, repetition_penalty=1.3, prompt=[0]),
        row(logit_bias={9: 50.0}),
    ]
    expected = torch.log_softmax(logits, dim=-1)
    for i, token in enumerate(sample(logits, rows)):
        assert token.logprob == pytest.approx(expected[i, token.token_id].item(), abs=1e-5)
        assert token.top_logprobs is None


def test_top_logprobs_are_the_k_most_likely_raw_tokens_plus_the_chosen_one():
    logits = random_logits(1, seed=6)
    expected = torch.log_softmax(logits[0], dim=-1)
    least_likely = int(expected.argmin())
    [token] = sample(logits, [row(temperature=0.0, logprobs=3, logit_bias={least_likely: 1000.0})])
    assert token.token_id == least_likely
    top3 = expected.topk(3).indices.tolist()
    assert list(token.top_logprobs) == top3 + [least_likely]
    for token_id, lp in token.top_logprobs.items():
        assert lp.logprob == pytest.approx(expected[token_id].item(), abs=1e-6)


def test_top_logprobs_hold_k_entries_when_the_chosen_token_is_among_them():
    logits = random_logits(2, seed=7)
    tokens = sample(logits, [row(temperature=0.0, logprobs=4), row(temperature=0.0, logprobs=1)])
    assert len(tokens[0].top_logprobs) == 4 and len(tokens[1].top_logprobs) == 1
    assert list(tokens[1].top_logprobs) == [tokens[1].token_id]
    assert tokens[1].top_logprobs[tokens[1].token_id].logprob == pytest.approx(tokens[1].logprob)


def test_zero_logprobs_reports_only_the_chosen_token():
    logits = random_logits(1, seed=8)
    [token] = sample(logits, [row(logprobs=0)])
    assert list(token.top_logprobs) == [token.token_id]


def test_compute_logprobs_is_float32_log_softmax():
    logits = random_logits(3).to(torch.bfloat16)
    out = compute_logprobs(logits)
    assert out.dtype == torch.float32
    assert torch.allclose(out, torch.log_softmax(logits.float(), dim=-1))


def prompt_entries(logprobs, targets, num_top):
    """What PromptLogprobs appends to a record (after the first prompt token's None)."""
    record = [None]
    PromptLogprobs(record, logprobs, targets, num_top).attach(lambda position: position)
    return record[1:]


@pytest.mark.parametrize("device", DEVICES)
def test_prompt_logprobs_report_prompt_tokens_with_their_top_alternatives(device):
    logprobs = compute_logprobs(random_logits(3, seed=9, device=device))
    targets = [int(logprobs[0].argmin()), int(logprobs[1].argmax()), 4]
    entries = prompt_entries(logprobs, targets, 2)
    for entry, lp_row, target in zip(entries, logprobs, targets):
        assert set(entry) == set(lp_row.topk(2).indices.tolist()) | {target}
        assert entry[target].logprob == pytest.approx(lp_row[target].item())


@pytest.mark.parametrize("device", DEVICES)
def test_prompt_logprobs_reach_the_record_only_when_attached(device):
    """A step in flight computes them; the host appends them when it reads the step back."""
    record = [None, {}]
    computed = PromptLogprobs(record, compute_logprobs(random_logits(2, seed=11, device=device)), [3, 5], 1)
    assert record == [None, {}]
    computed.attach(lambda position: position)
    assert len(record) == 4 and 3 in record[2] and 5 in record[3]


def test_logprob_ranks_count_the_more_likely_tokens():
    logprobs = compute_logprobs(random_logits(3, seed=10))
    targets = [int(logprobs[0].argmin()), int(logprobs[1].argmax()), 4]
    for entry, lp_row, target in zip(prompt_entries(logprobs, targets, 3), logprobs, targets):
        top = lp_row.topk(3).indices.tolist()
        assert [entry[t].rank for t in top] == [1, 2, 3]
        assert entry[target].rank == 1 + int((lp_row > lp_row[target]).sum())


# -- allowed tokens and bad words ----------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_only_allowed_tokens_are_drawn(temperature):
    logits = random_logits(64, seed=11)
    allowed = [3, 17, 40]
    tokens = sample(logits, [row(temperature=temperature, seed=i, allowed_token_ids=allowed) for i in range(64)])
    assert {t.token_id for t in tokens} <= set(allowed)
    if temperature == 0.0:
        assert [t.token_id for t in tokens] == [allowed[int(logits[i, allowed].argmax())] for i in range(64)]


def test_allowed_tokens_leave_the_reported_logprob_raw():
    logits = random_logits(1, seed=12)
    [token] = sample(logits, [row(temperature=0.0, allowed_token_ids=[5])])
    assert token.token_id == 5
    assert token.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[5].item(), abs=1e-5)


def test_a_one_token_bad_word_is_never_drawn():
    logits = random_logits(1, seed=13)
    best = int(logits[0].argmax())
    [token] = sample(logits, [row(temperature=0.0, bad_words=[[best]])])
    assert token.token_id == int(logits[0].topk(2).indices[1])


def test_a_bad_words_last_token_is_banned_only_after_the_rest_of_the_word():
    logits = torch.zeros(2, VOCAB)
    logits[:, 9] = 5.0
    word = [7, 8, 9]
    after_prefix, elsewhere = sample(logits, [row(temperature=0.0, output=[1, 7, 8], bad_words=[word]),
                                              row(temperature=0.0, output=[7, 1, 8], bad_words=[word])])
    assert after_prefix.token_id != 9
    assert elsewhere.token_id == 9


def test_allowed_tokens_and_bad_words_leave_the_fast_greedy_path():
    assert is_plain_greedy(SamplingParams(temperature=0), 0)
    assert not is_plain_greedy(SamplingParams(temperature=0, allowed_token_ids=[1]), 0)
    assert not is_plain_greedy(SamplingParams(temperature=0, bad_words=["x"]), 0)


def test_out_of_vocabulary_allowed_tokens_are_refused():
    with pytest.raises(ValueError, match=r"allowed_token_ids contains out-of-vocabulary token ids \[50\]"):
        Sampler({EOS}, VOCAB).validate(SamplingParams(allowed_token_ids=[3, 50]))
