"""Turns one step's logits into one token per sequence, with vLLM's sampling semantics.

Order (as in vLLM): logprobs are taken from the raw logits; then logit_bias, min_tokens,
repetition penalty, frequency/presence penalties; then greedy argmax, or temperature, top-k,
top-p, min-p and a draw. A seeded sequence draws its noise only from its own generator, so its
tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams

_UINT64 = (1 << 64) - 1


@dataclass
class SamplingRow:
    """One sequence to sample for in this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated before this step
    generator: torch.Generator | None = None  # set for seeded requests (see make_generator)


@dataclass
class SampledToken:
    token_id: int
    logprob: float  # of token_id under the raw model distribution
    # With params.logprobs = k: the k most likely tokens (most likely first) plus the chosen one.
    top_logprobs: dict[int, float] | None = None


def make_generator(seed: int, index: int, device: torch.device | str) -> torch.Generator:
    """The generator for completion `index` of a request with `seed` (vLLM seeds child i with seed + i)."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed + index) & _UINT64)
    return generator


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the vocabulary in float32, whatever the model's dtype."""
    return logits.float().log_softmax(dim=-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: list[int], num_top: int) -> list[dict[int, float]]:
    """Per row of logprobs [N, V]: the num_top most likely tokens plus token_ids[row], as vLLM reports them.

    The engine uses this for prompt_logprobs (row i holds the distribution that predicted token_ids[i]).
    """
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logprobs.device)[:, None]).squeeze(1).tolist()
    num_top = min(num_top, logprobs.shape[-1])
    if num_top == 0:
        return [{token_id: lp} for token_id, lp in zip(token_ids, chosen)]
    values, indices = logprobs.topk(num_top, dim=-1)
    result = []
    for token_id, lp, top_ids, top_values in zip(token_ids, chosen, indices.tolist(), values.tolist()):
        entry = dict(zip(top_ids, top_values))
        entry.setdefault(token_id, lp)
        result.append(entry)
    return result


class Sampler:
    def __init__(self, eos_token_ids: set[int], vocab_size: int):
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = vocab_size

    def validate(self, params: SamplingParams) -> None:
        """Checks what needs the vocabulary; call when a request arrives, so it fails before it runs."""
        if params.logit_bias:
            bad = sorted(t for t in params.logit_bias if t >= self.vocab_size)
            if bad:
                raise ValueError(
                    f"logit_bias contains out-of-vocabulary token ids {bad}; the vocabulary size is {self.vocab_size}."
                )

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        if logits.shape[0] != len(rows):
            raise ValueError(f"got logits for {logits.shape[0]} sequences but {len(rows)} sampling rows")
        raw = logits[:, : self.vocab_size].float()
        processed = self.process_logits(raw, rows)
        token_ids = self._choose(processed, rows)
        return self._report(raw, token_ids, rows)

    # -- logits processing ---------------------------------------------------------------

    def process_logits(self, raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Float32 logits after logit_bias, min_tokens and penalties (before temperature and truncation).

        Works on a copy; returns raw itself when nothing applies.
        """
        bias_rows = [i for i, r in enumerate(rows) if r.params.logit_bias]
        min_rows = [i for i, r in enumerate(rows) if len(r.output_token_ids) < r.params.min_tokens]
        penalty_rows = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
        if not (bias_rows or min_rows or penalty_rows):
            return raw
        logits = raw.clone()
        if bias_rows:
            self._apply_logit_bias(logits, [rows[i] for i in bias_rows], bias_rows)
        if min_rows:
            self._apply_min_tokens(logits, [rows[i] for i in min_rows], min_rows)
        if penalty_rows:
            self._apply_penalties(logits, [rows[i] for i in penalty_rows], penalty_rows)
        return logits

    def _apply_logit_bias(self, logits: torch.Tensor, rows: list[SamplingRow], indices: list[int]) -> None:
        row_idx, col_idx, values = [], [], []
        for i, row in zip(indices, rows):
            for token_id, bias in row.params.logit_bias.items():
                row_idx.append(i)
                col_idx.append(token_id)
                values.append(bias)
        device = logits.device
        logits.index_put_(
            (torch.tensor(row_idx, device=device), torch.tensor(col_idx, device=device)),
            torch.tensor(values, dtype=logits.dtype, device=device),
            accumulate=True,
        )

    def _apply_min_tokens(self, logits: torch.Tensor, rows: list[SamplingRow], indices: list[int]) -> None:
        """Until min_tokens are out, the tokens that would end the sequence cannot be drawn."""
        row_idx, col_idx = [], []
        for i, row in zip(indices, rows):
            banned = set(row.params.stop_token_ids)
            if not row.params.ignore_eos:
                banned |= self.eos_token_ids
            for token_id in banned:
                if token_id < self.vocab_size:
                    row_idx.append(i)
                    col_idx.append(token_id)
        if row_idx:
            device = logits.device
            logits[torch.tensor(row_idx, device=device), torch.tensor(col_idx, device=device)] = float("-inf")

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow], indices: list[int]) -> None:
        device, vocab = logits.device, self.vocab_size
        sub = logits[indices]
        repetition = torch.tensor([r.params.repetition_penalty for r in rows], device=device)[:, None]
        frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=device)[:, None]
        presence = torch.tensor([r.params.presence_penalty for r in rows], device=device)[:, None]
        # Padding points at an extra column that is dropped, so ragged rows need no masking.
        output_ids = _padded([r.output_token_ids for r in rows], vocab, device)
        counts = torch.zeros(len(rows), vocab + 1, device=device)
        counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=counts.dtype))
        counts = counts[:, :vocab]
        if any(r.params.repetition_penalty != 1.0 for r in rows):
            seen_ids = _padded([r.prompt_token_ids + r.output_token_ids for r in rows], vocab, device)
            seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)
            seen.scatter_(1, seen_ids, True)
            penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
            sub = torch.where(seen[:, :vocab], penalized, sub)
        sub = sub - frequency * counts - presence * (counts > 0).to(sub.dtype)
        logits[indices] = sub

    # -- choosing ------------------------------------------------------------------------

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        token_ids = logits.argmax(dim=-1)
        if not random_rows:
            return token_ids
        sampled = self._sample(logits[random_rows], [rows[i] for i in random_rows])
        token_ids[torch.tensor(random_rows, device=logits.device)] = sampled
        return token_ids

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([r.params.temperature for r in rows], device=device)[:, None]
        logits = logits / temperature
        logits = _top_k_top_p(logits, rows, self.vocab_size)
        probs = logits.softmax(dim=-1)
        if any(r.params.min_p > 0 for r in rows):
            min_p = torch.tensor([r.params.min_p for r in rows], device=device)[:, None]
            threshold = min_p * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return _exponential_race(probs, [r.generator for r in rows])

    # -- reporting -----------------------------------------------------------------------

    def _report(self, raw: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        chosen = raw.gather(1, token_ids[:, None]).squeeze(1) - torch.logsumexp(raw, dim=-1)
        ids, logprobs = token_ids.tolist(), chosen.tolist()
        result = [SampledToken(token_id, lp) for token_id, lp in zip(ids, logprobs)]
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if wanted:
            num_top = max(rows[i].params.logprobs for i in wanted)
            tops = gather_logprobs(compute_logprobs(raw[wanted]), [ids[i] for i in wanted], num_top)
            for i, top in zip(wanted, tops):
                k = rows[i].params.logprobs
                entry = dict(list(top.items())[:k])
                entry.setdefault(ids[i], top[ids[i]])
                result[i].top_logprobs = entry
                result[i].logprob = entry[ids[i]]
        return result


def _has_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def _padded(sequences: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(s) for s in sequences))
    return torch.tensor([s + [pad] * (width - len(s)) for s in sequences], dtype=torch.long, device=device)


def _top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow], vocab: int) -> torch.Tensor:
    """Masks to -inf what top-k and top-p exclude; the kept values are unchanged bit for bit."""
    ks = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    use_top_k = any(k < vocab for k in ks)
    use_top_p = any(r.params.top_p < 1.0 for r in rows)
    device = logits.device
    if not use_top_p:
        if not use_top_k:
            return logits
        k = torch.tensor(ks, device=device)[:, None]
        top = logits.topk(max(ks), dim=-1).values
        kth = top.gather(1, (k - 1).clamp(max=top.shape[-1] - 1))
        kth = torch.where(k >= vocab, torch.full_like(kth, float("-inf")), kth)
        return logits.masked_fill(logits < kth, float("-inf"))
    ordered, order = logits.sort(dim=-1)  # ascending
    if use_top_k:
        kth = ordered.gather(1, vocab - torch.tensor(ks, device=device)[:, None])
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    top_p = torch.tensor([r.params.top_p for r in rows], device=device)[:, None]
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1.0 - top_p
    drop[:, -1] = False  # always keep the most likely token
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(ordered).scatter_(1, order, ordered)


def _exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """argmax(p / E) with E ~ Exponential(1) draws token i with probability p_i.

    Each seeded row draws its noise from its own generator; unseeded rows share the global RNG.
    """
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        noise.exponential_()
    else:
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[-1], device=probs.device).exponential_()
        for i, generator in enumerate(generators):
            if generator is not None:
                noise[i].exponential_(generator=generator)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)
