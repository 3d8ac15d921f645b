"""Turns one step's logits into one token per sequence, with vLLM's sampling semantics.

Order (as in vLLM's V1 sampler): logprobs are taken from the raw logits; then allowed_token_ids, bad_words,
logit_bias, min_tokens, repetition penalty, frequency/presence penalties; then greedy argmax, or temperature,
min-p, top-k, top-p and a draw. A seeded sequence draws its noise only from its own generator, so its
tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

import array
import itertools
from dataclasses import dataclass, field

import torch

from engine.outputs import Logprob
from engine.sampling_params import SamplingParams
from engine.step_input import host_to_device
from kernels.greedy import greedy
from kernels.top_p import top_p_

_UINT64 = (1 << 64) - 1


@dataclass
class SamplingRow:
    """One sequence to sample for in this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated before this step
    generator: torch.Generator | None = None  # set for seeded requests (see make_generator)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Async scheduling: output_token_ids ends in a placeholder for the token the step in flight drew, which is row
    # in_flight_row of the tokens passed with the rows (-1: every token is on the host).
    in_flight_row: int = -1


@dataclass
class SampledToken:
    token_id: int
    logprob: float  # of token_id under the raw model distribution
    # With params.logprobs = k: the k most likely tokens (most likely first) plus the chosen one.
    top_logprobs: dict[int, Logprob] | None = None


class PendingTokens:
    """One step's tokens drawn on the device (greedy or not): there for the next step's inputs, and on their way
    to page-locked host memory, so reading them waits for this step's work alone (a .tolist() would also wait
    for every step launched after it). With them travel the top logprobs of the rows that asked for some."""

    def __init__(self, token_ids: torch.Tensor, logprobs: torch.Tensor,
                 host: tuple[torch.Tensor, torch.Tensor] | None = None, requested: RequestedLogprobs | None = None):
        """host: page-locked buffers for a GPU's tokens (token ids, logprobs), at least B long."""
        self.token_ids = token_ids  # [B] int64, on the device
        self._event = None
        if token_ids.is_cuda:
            batch = token_ids.shape[0]
            token_ids = host[0][:batch].copy_(token_ids, non_blocking=True)
            logprobs = host[1][:batch].copy_(logprobs, non_blocking=True)
            requested = requested.to_host() if requested is not None else None
            self._event = torch.cuda.Event()
            self._event.record()
        self._host = token_ids, logprobs, requested

    def wait(self) -> None:
        """Until the tokens are on the host (only for the step that sampled them)."""
        if self._event is not None:
            self._event.synchronize()

    def result(self) -> list[SampledToken]:
        self.wait()
        token_ids, logprobs, requested = self._host
        result = [SampledToken(token_id, lp) for token_id, lp in zip(token_ids.tolist(), logprobs.tolist())]
        if requested is not None:
            requested.attach(result)
        return result


@dataclass
class TopLogprobs:
    """Per row: the chosen token's log-probability and rank, and the num_top most likely tokens' (on the device
    where they were computed, until `to_host`)."""

    chosen: torch.Tensor  # [N] float32
    ranks: torch.Tensor  # [N] int64, 1 for the most likely token
    values: torch.Tensor  # [N, num_top] float32, most likely first
    ids: torch.Tensor  # [N, num_top] int64

    @classmethod
    def compute(cls, logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> TopLogprobs:
        """From logprobs [N, V] and each row's chosen token id [N]; nothing is read back."""
        chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
        ranks = (logprobs > chosen[:, None]).sum(dim=-1).add_(1)
        values, ids = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
        return cls(chosen, ranks, values, ids)

    def to_host(self) -> TopLogprobs:
        """Copies started to (page-locked) host memory, not waited for."""
        return TopLogprobs(*(t.to("cpu", non_blocking=True) for t in (self.chosen, self.ranks, self.values,
                                                                        self.ids)))

    def entries(self, token_ids: list[int], counts: list[int] | None = None) -> list[dict[int, Logprob]]:
        """Per row: its counts[row] (default num_top) most likely tokens plus token_ids[row], with their ranks, as
        vLLM reports them (decoded_token is left to the caller, which has the tokenizer). A chosen token outside
        its row's count keeps its own rank, whatever other rows asked for (ties could rank it otherwise)."""
        counts = counts or [self.ids.shape[-1]] * len(token_ids)
        result = []
        for token_id, lp, rank, top_ids, top_values, count in zip(
                token_ids, self.chosen.tolist(), self.ranks.tolist(), self.ids.tolist(), self.values.tolist(), counts):
            entry = {top_id: Logprob(value, r)
                     for r, (top_id, value) in enumerate(zip(top_ids[:count], top_values[:count]), 1)}
            entry.setdefault(token_id, Logprob(lp, rank))
            result.append(entry)
        return result


@dataclass
class RequestedLogprobs:
    """The top logprobs the rows asking for them (`rows`, each wanting `counts[i]`) get with their tokens."""

    rows: list[int]
    counts: list[int]
    top: TopLogprobs

    def to_host(self) -> RequestedLogprobs:
        return RequestedLogprobs(self.rows, self.counts, self.top.to_host())

    def attach(self, sampled: list[SampledToken]) -> None:
        """Sets each asking row's top_logprobs (its k most likely tokens plus the chosen one) and its logprob
        from the same log-softmax."""
        for i, entry in zip(self.rows, self.top.entries([sampled[i].token_id for i in self.rows], self.counts)):
            sampled[i].top_logprobs = entry
            sampled[i].logprob = entry[sampled[i].token_id].logprob


class _HostBuffers:
    """Two pairs of page-locked (token id, logprob) buffers used in turn, grown to the largest batch
    seen, so steps allocate no page-locked memory. A pair is reused by the pending tokens after next:
    the engine reads each step's tokens before it launches the step after the next."""

    def __init__(self):
        self._pairs: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
        self._turn = 0

    def take(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        pair = self._pairs[self._turn]
        if pair is None or pair[0].shape[0] < batch:
            pair = self._pairs[self._turn] = (torch.empty(batch, dtype=torch.long, pin_memory=True),
                                              torch.empty(batch, dtype=torch.float32, pin_memory=True))
        self._turn ^= 1
        return pair


def make_generator(seed: int, index: int, device: torch.device | str) -> torch.Generator:
    """The generator for completion `index` of a request with `seed` (vLLM seeds child i with seed + i)."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed + index) & _UINT64)
    return generator


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the vocabulary in float32, whatever the model's dtype."""
    return logits.float().log_softmax(dim=-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: list[int], num_top: int) -> list[dict[int, Logprob]]:
    """Per row of logprobs [N, V]: the num_top most likely tokens plus token_ids[row], with their ranks, as
    vLLM reports them. The engine uses this for prompt_logprobs (row i holds the distribution that predicted
    token_ids[i])."""
    chosen = torch.tensor(token_ids, device=logprobs.device)
    return TopLogprobs.compute(logprobs, chosen, num_top).entries(token_ids)


class Sampler:
    def __init__(self, eos_token_ids: set[int], vocab_size: int):
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = vocab_size
        self._host_buffers = _HostBuffers()

    def validate(self, params: SamplingParams, bad_words_token_ids: list[list[int]] = ()) -> None:
        """Checks what needs the vocabulary; call when a request arrives, so it fails before it runs."""
        for name, token_ids in (("logit_bias", params.logit_bias or ()),
                                ("allowed_token_ids", params.allowed_token_ids or ()),
                                ("bad_words", [t for word in bad_words_token_ids for t in word])):
            bad = sorted(set(t for t in token_ids if t >= self.vocab_size))
            if bad:
                raise ValueError(
                    f"{name} contains out-of-vocabulary token ids {bad}; the vocabulary size is {self.vocab_size}."
                )

    @torch.no_grad()
    def greedy(self, logits: torch.Tensor) -> list[SampledToken]:
        """What __call__ returns when every row is_plain_greedy, without looking at the rows: the same
        tokens; on CUDA the log-probabilities may differ from __call__'s in the last float32 bits (the
        Triton kernel's online log-sum-exp)."""
        token_ids, logprobs = greedy(logits, self.vocab_size)
        return [SampledToken(token_id, lp) for token_id, lp in zip(token_ids.tolist(), logprobs.tolist())]

    @torch.no_grad()
    def greedy_pending(self, logits: torch.Tensor) -> PendingTokens:
        """greedy's tokens left on the device, their copy to the host started but not waited for. Read
        each one's result() before asking for the one after next (they share host buffers)."""
        return self._left_on_device(*greedy(logits, self.vocab_size))

    @torch.no_grad()
    def pending(self, logits: torch.Tensor, rows: list[SamplingRow],
                in_flight_tokens: torch.Tensor | None = None) -> PendingTokens:
        """__call__'s tokens and logprobs left on the device like greedy_pending's: nothing here waits for the
        device, so a step can stay in flight (host lists reach the device from page-locked memory; top-p runs in
        `kernels.top_p`; top logprobs travel with the tokens). in_flight_tokens: the step in flight's tokens,
        where rows with an in_flight_row find their last output token (penalties, bad words)."""
        raw = logits[:, : self.vocab_size].float()
        token_ids = self._choose(self.process_logits(raw, rows, in_flight_tokens), rows)
        return self._left_on_device(token_ids, _chosen_logprobs(raw, token_ids),
                                    _requested_logprobs(raw, token_ids, rows))

    def _left_on_device(self, token_ids: torch.Tensor, logprobs: torch.Tensor,
                        requested: RequestedLogprobs | None = None) -> PendingTokens:
        host = self._host_buffers.take(token_ids.shape[0]) if token_ids.is_cuda else None
        return PendingTokens(token_ids, logprobs, host, requested)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        if logits.shape[0] != len(rows):
            raise ValueError(f"got logits for {logits.shape[0]} sequences but {len(rows)} sampling rows")
        raw = logits[:, : self.vocab_size].float()
        processed = self.process_logits(raw, rows)
        token_ids = self._choose(processed, rows)
        return self._report(raw, token_ids, rows)

    # -- logits processing ---------------------------------------------------------------

    def process_logits(self, raw: torch.Tensor, rows: list[SamplingRow],
                       in_flight_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits after allowed_token_ids, bad_words, logit_bias, min_tokens and penalties (before
        temperature and truncation), in vLLM's order.

        Works on a copy; returns raw itself when nothing applies.
        """
        allowed_rows = [i for i, r in enumerate(rows) if r.params.allowed_token_ids]
        bad_word_rows = [i for i, r in enumerate(rows) if r.bad_words_token_ids]
        bias_rows = [i for i, r in enumerate(rows) if r.params.logit_bias]
        min_rows = [i for i, r in enumerate(rows) if len(r.output_token_ids) < r.params.min_tokens]
        penalty_rows = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
        if not (allowed_rows or bad_word_rows or bias_rows or min_rows or penalty_rows):
            return raw
        logits = raw.clone()
        if allowed_rows:
            self._apply_allowed_tokens(logits, [rows[i] for i in allowed_rows], allowed_rows)
        if bad_word_rows:
            self._apply_bad_words(logits, [rows[i] for i in bad_word_rows], bad_word_rows, in_flight_tokens)
        if bias_rows:
            self._apply_logit_bias(logits, [rows[i] for i in bias_rows], bias_rows)
        if min_rows:
            self._apply_min_tokens(logits, [rows[i] for i in min_rows], min_rows)
        if penalty_rows:
            self._apply_penalties(logits, [rows[i] for i in penalty_rows], penalty_rows, in_flight_tokens)
        return logits

    def _apply_bad_words(self, logits: torch.Tensor, rows: list[SamplingRow], indices: list[int],
                         in_flight_tokens: torch.Tensor | None) -> None:
        """vLLM's rule: a bad word's last token is banned once the output ends in the rest of the word. Where the
        output's last token is still in flight, a word whose other tokens match is banned on the device, if that
        token is the one it needs."""
        banned, if_in_flight = [], []
        for i, row in zip(indices, rows):
            for token_id, needed in _bad_word_ends(row):
                if needed is None:
                    banned.append((i, token_id))
                else:
                    if_in_flight.append((i, token_id, row.in_flight_row, needed))
        _ban(logits, banned)
        if if_in_flight:
            cells = host_to_device(if_in_flight, logits.device).T
            hit = in_flight_tokens.index_select(0, cells[2]) == cells[3]
            # adding 0 or -inf: repeated cells agree whatever order they are written in
            logits.index_put_((cells[0], cells[1]), torch.where(hit, float("-inf"), 0.0).to(logits.dtype),
                              accumulate=True)

    def _apply_logit_bias(self, logits: torch.Tensor, rows: list[SamplingRow], indices: list[int]) -> None:
        cells = [(i, token_id) for i, row in zip(indices, rows) for token_id in row.params.logit_bias]
        biases = [bias for row in rows for bias in row.params.logit_bias.values()]
        device = logits.device
        cell_index = host_to_device(cells, device).T
        logits.index_put_((cell_index[0], cell_index[1]), host_to_device(biases, device, logits.dtype), accumulate=True)
        # A bias of +inf forces its token: the row keeps only such tokens, at equal odds (softmax of +inf is NaN). A
        # token already out (-inf: not allowed, banned) stays out whatever its bias (-inf + inf is NaN).
        index = host_to_device(indices, device)
        biased = logits.index_select(0, index)
        biased.masked_fill_(biased.isnan(), float("-inf"))
        forced = biased.isposinf()
        logits.index_copy_(0, index, torch.where(forced.any(dim=-1, keepdim=True),
                                                 torch.where(forced, 0.0, float("-inf")), biased))

    def _apply_allowed_tokens(self, logits: torch.Tensor, rows: list[SamplingRow], indices: list[int]) -> None:
        device = logits.device
        cells = host_to_device([(j, token_id) for j, row in enumerate(rows)
                                for token_id in row.params.allowed_token_ids], device).T
        allowed = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool, device=device)
        allowed[cells[0], cells[1]] = True
        index = host_to_device(indices, device)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill(~allowed, float("-inf")))

    def _apply_min_tokens(self, logits: torch.Tensor, rows: list[SamplingRow], indices: list[int]) -> None:
        """Until min_tokens are out, the tokens that would end the sequence cannot be drawn: the stop tokens, and the
        end-of-sequence ones even under ignore_eos (as vLLM bans them)."""
        banned = []
        for i, row in zip(indices, rows):
            ending = set(row.params.stop_token_ids) | self.eos_token_ids
            banned.extend((i, token_id) for token_id in ending if token_id < self.vocab_size)
        _ban(logits, banned)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow], indices: list[int],
                         in_flight_tokens: torch.Tensor | None) -> None:
        device, vocab = logits.device, logits.shape[-1]
        index = host_to_device(indices, device)
        sub = logits.index_select(0, index)
        repetition, frequency, presence = host_to_device(
            [[r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty] for r in rows],
            device, sub.dtype).T[:, :, None]
        output_cells = _token_cells([(r.output_token_ids,) for r in rows], rows, vocab, device, in_flight_tokens)
        counts = torch.zeros(len(rows), vocab, device=device)
        counts.view(-1).index_add_(0, output_cells, torch.ones_like(output_cells, dtype=counts.dtype))
        if any(r.params.repetition_penalty != 1.0 for r in rows):
            seen_cells = _token_cells([(r.prompt_token_ids, r.output_token_ids) for r in rows], rows, vocab, device,
                                      in_flight_tokens)
            seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
            seen.view(-1)[seen_cells] = True
            penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
            sub = torch.where(seen, penalized, sub)
        sub = sub - frequency * counts - presence * (counts > 0).to(sub.dtype)
        logits.index_copy_(0, index, sub)

    # -- choosing ------------------------------------------------------------------------

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Host lists reach the device through `host_to_device`, here and below, so that a draw does not wait
        for the device (on the CPU, top-p's candidate search does: `kernels.top_p`)."""
        random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        token_ids = logits.argmax(dim=-1)
        if not random_rows:
            return token_ids
        index = host_to_device(random_rows, logits.device)
        sampled = self._sample(logits.index_select(0, index), [rows[i] for i in random_rows])
        return token_ids.index_copy_(0, index, sampled)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        device = logits.device
        temperature = host_to_device([r.params.temperature for r in rows], device, torch.float32)[:, None]
        logits = logits / temperature
        if any(r.params.min_p > 0 for r in rows):  # before top-k and top-p, as in vLLM's V1 sampler
            min_p = host_to_device([r.params.min_p for r in rows], device, torch.float32)[:, None]
            probs = logits.softmax(dim=-1)
            logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
        logits = _top_k(logits, rows, logits.shape[-1])
        probs = _top_p(logits.softmax(dim=-1), rows)
        return _exponential_race(probs, [r.generator for r in rows])

    # -- reporting -----------------------------------------------------------------------

    def _report(self, raw: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        ids, logprobs = token_ids.tolist(), _chosen_logprobs(raw, token_ids).tolist()
        result = [SampledToken(token_id, lp) for token_id, lp in zip(ids, logprobs)]
        requested = _requested_logprobs(raw, token_ids, rows)
        if requested is not None:
            requested.attach(result)
        return result


def _requested_logprobs(raw: torch.Tensor, token_ids: torch.Tensor,
                        rows: list[SamplingRow]) -> RequestedLogprobs | None:
    """The top logprobs of the rows with params.logprobs set, under the raw logits; computed on the device."""
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not wanted:
        return None
    counts = [rows[i].params.logprobs for i in wanted]
    index = host_to_device(wanted, raw.device)
    top = TopLogprobs.compute(compute_logprobs(raw.index_select(0, index)), token_ids.index_select(0, index),
                              max(counts))
    return RequestedLogprobs(wanted, counts, top)


def is_plain_greedy(params: SamplingParams, num_output_tokens: int) -> bool:
    """True when a row's token is the raw argmax and only its raw logprob is reported: greedy, and no
    allowed_token_ids, bad_words, logit_bias, min_tokens masking, penalty or top logprobs apply (then
    Sampler.greedy serves it)."""
    return (params.is_greedy and params.logprobs is None and not params.logit_bias and not params.allowed_token_ids
            and not params.bad_words and num_output_tokens >= params.min_tokens and not _has_penalty(params))


def _chosen_logprobs(raw: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Each row's chosen token's log-probability under the raw logits (float32)."""
    return raw.gather(1, token_ids[:, None]).squeeze(1) - torch.logsumexp(raw, dim=-1)


def _bad_word_ends(row: SamplingRow) -> list[tuple[int, int | None]]:
    """(token, needed) for each bad word of the row whose last token the output so far may complete: needed is
    None when the output ends in the rest of the word, or the token the output's last, still in flight
    (`in_flight_row`), must be for it to, when the tokens before that one match."""
    output = row.output_token_ids
    in_flight = row.in_flight_row >= 0
    ends = []
    for word in row.bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) > len(output):
            continue
        tail = output[len(output) - len(prefix):]
        if not prefix or not in_flight:
            if tail == prefix:
                ends.append((word[-1], None))
        elif tail[:-1] == prefix[:-1]:
            ends.append((word[-1], prefix[-1]))
    return ends


def _ban(logits: torch.Tensor, cells: list[tuple[int, int]]) -> None:
    """Sets logits[row, token] to -inf for each (row, token)."""
    if cells:
        index = host_to_device(cells, logits.device).T
        logits[index[0], index[1]] = float("-inf")


def _has_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def _token_cells(sequences: list[tuple[list[int], ...]], rows: list[SamplingRow], vocab: int, device: torch.device,
                 in_flight_tokens: torch.Tensor | None) -> torch.Tensor:
    """Where each token of each row's sequence (given in parts) falls in an [N, vocab] table, flattened: the index
    row * vocab + token, on the device. A sequence whose row has an in_flight_row ends in a placeholder, replaced by
    that row of in_flight_tokens (nothing is read back). The ids are gathered in an array, not a padded nested list:
    about 5x less host time for 128 rows of 576 tokens."""
    ids = array.array("q")
    lengths = []
    for parts, row in zip(sequences, rows):
        for part in parts:
            ids.extend(part)
        lengths.append(sum(len(part) for part in parts))
        if row.in_flight_row < 0 and lengths[-1] and ids[-1] < 0:
            raise ValueError("a sequence ends in an in-flight placeholder but its row has no in_flight_row")
    if not ids:
        return torch.empty(0, dtype=torch.long, device=device)
    tokens = host_to_device(torch.frombuffer(ids, dtype=torch.int64), device)
    ends = list(itertools.accumulate(lengths))
    placeholders = [(ends[j] - 1, r.in_flight_row) for j, r in enumerate(rows) if r.in_flight_row >= 0]
    if placeholders:
        cells = host_to_device(placeholders, device).T
        tokens[cells[0]] = in_flight_tokens.index_select(0, cells[1])
    # each row's index on its tokens: a cumulative sum of ones where rows start (repeat_interleave is slow on a CPU)
    starts = [end for end in ends[:-1] if end < len(ids)]
    row_of = torch.zeros(len(ids), dtype=torch.long, device=device)
    if starts:
        row_of.index_add_(0, host_to_device(starts, device), torch.ones(len(starts), dtype=torch.long, device=device))
    return row_of.cumsum_(0) * vocab + tokens


def _top_k(logits: torch.Tensor, rows: list[SamplingRow], vocab: int) -> torch.Tensor:
    """Masks to -inf all but each row's top_k logits (ties with the k-th are kept), in place."""
    ks = [r.params.top_k for r in rows]
    selected = [i for i, k in enumerate(ks) if 0 < k < vocab]
    if not selected:
        return logits
    k = host_to_device([ks[i] for i in selected], logits.device)[:, None]
    index = host_to_device(selected, logits.device)
    sub = logits.index_select(0, index)
    kth = sub.topk(max(ks[i] for i in selected), dim=-1).values.gather(1, k - 1)
    return logits.index_copy_(0, index, sub.masked_fill(sub < kth, float("-inf")))


def _top_p(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Zeroes, in place, the tokens outside each row's top-p nucleus (`kernels.top_p`: on a GPU nothing is read
    back, so a step drawing with top-p can stay in flight)."""
    selected = [i for i, r in enumerate(rows) if r.params.top_p < 1.0]
    if not selected:
        return probs
    top_p = host_to_device([rows[i].params.top_p for i in selected], probs.device, torch.float32)
    return top_p_(probs, host_to_device(selected, probs.device), top_p)


def _exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """argmax(p / E) with E = -log(U) ~ Exponential(1) draws token i with probability p_i.

    Each seeded row draws its noise from its own generator; unseeded rows share the global RNG.
    (-log of a uniform is several times faster than exponential_ on the CPU.)
    """
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        noise.uniform_()
    else:
        if unseeded:
            noise.index_copy_(0, host_to_device(unseeded, probs.device),
                              torch.rand(len(unseeded), probs.shape[-1], device=probs.device))
        for i, generator in enumerate(generators):
            if generator is not None:
                noise[i].uniform_(generator=generator)
    return (probs / noise.log_().neg_()).argmax(dim=-1)
