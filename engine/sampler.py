"""Turns one step's logits into one token per sequence, with vLLM's sampling semantics.

Order (as in vLLM's V1 sampler): logprobs are taken from the raw logits (`engine.logprobs`); then the logits
processors (`engine.logits_processors`); then greedy argmax, or temperature, min-p, top-k, top-p and a draw. A
seeded sequence draws its noise only from its own generator, so its tokens do not depend on what else is in the
batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.logits_processors import has_penalty, process_logits
from engine.logprobs import RequestedLogprobs, chosen_logprobs, requested_logprobs
from engine.outputs import Logprob
from engine.sampling_params import SamplingParams
from engine.sampling_row import SamplingRow
from engine.step_input import host_to_device
from kernels.greedy import greedy
from kernels.top_p import top_p_

_UINT64 = (1 << 64) - 1


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
        token_ids = self._choose(process_logits(raw, rows, self.eos_token_ids, in_flight_tokens), rows)
        return self._left_on_device(token_ids, chosen_logprobs(raw, token_ids),
                                    requested_logprobs(raw, token_ids, rows))

    def _left_on_device(self, token_ids: torch.Tensor, logprobs: torch.Tensor,
                        requested: RequestedLogprobs | None = None) -> PendingTokens:
        host = self._host_buffers.take(token_ids.shape[0]) if token_ids.is_cuda else None
        return PendingTokens(token_ids, logprobs, host, requested)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        if logits.shape[0] != len(rows):
            raise ValueError(f"got logits for {logits.shape[0]} sequences but {len(rows)} sampling rows")
        raw = logits[:, : self.vocab_size].float()
        processed = process_logits(raw, rows, self.eos_token_ids)
        token_ids = self._choose(processed, rows)
        return self._report(raw, token_ids, rows)

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

    def _report(self, raw: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        ids, logprobs = token_ids.tolist(), chosen_logprobs(raw, token_ids).tolist()
        result = [SampledToken(token_id, lp) for token_id, lp in zip(ids, logprobs)]
        requested = requested_logprobs(raw, token_ids, rows)
        if requested is not None:
            requested.attach(result)
        return result


def is_plain_greedy(params: SamplingParams, num_output_tokens: int) -> bool:
    """True when a row's token is the raw argmax and only its raw logprob is reported: greedy, and no
    allowed_token_ids, bad_words, logit_bias, min_tokens masking, penalty or top logprobs apply (then
    Sampler.greedy serves it)."""
    return (params.is_greedy and params.logprobs is None and not params.logit_bias and not params.allowed_token_ids
            and not params.bad_words and num_output_tokens >= params.min_tokens and not has_penalty(params))


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
