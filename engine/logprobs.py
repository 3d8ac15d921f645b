"""Log-probabilities as vLLM reports them: each chosen token's, and the top ones a request asks for, computed on
the device and read on the host with the tokens."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from engine.flat_logprobs import LogprobRecord
from engine.outputs import Logprob, PositionLogprobs
from engine.sampling_row import SamplingRow
from engine.step_input import host_to_device

if TYPE_CHECKING:
    from engine.sampler import SampledToken


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


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the vocabulary in float32, whatever the model's dtype."""
    return logits.float().log_softmax(dim=-1)


class PromptLogprobs:
    """The prompt logprobs one step computed for one request: per row of logprobs [N, V], the num_top most likely
    tokens plus targets[row] (the prompt token that row predicted), with their ranks, as vLLM reports them. Computed
    on the device and copied back without waiting, so the step can stay in flight; `attach` appends them to the
    request's record once the host reads the step back."""

    def __init__(self, record: LogprobRecord, logprobs: torch.Tensor, targets: list[int],
                 num_top: int):
        self.record = record
        self.targets = targets
        top = TopLogprobs.compute(logprobs, host_to_device(targets, logprobs.device), num_top)
        self._event = None
        if logprobs.is_cuda:
            top = top.to_host()
            self._event = torch.cuda.Event()
            self._event.record()
        self._top = top

    def attach(self, fill: Callable[[PositionLogprobs], PositionLogprobs]) -> None:
        """Waits for this step's copies alone; fill sets each entry's decoded tokens."""
        if self._event is not None:
            self._event.synchronize()
        self.record.extend(map(fill, self._top.entries(self.targets)))


def chosen_logprobs(raw: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Each row's chosen token's log-probability under the raw logits (float32)."""
    return raw.gather(1, token_ids[:, None]).squeeze(1) - torch.logsumexp(raw, dim=-1)


def requested_logprobs(raw: torch.Tensor, token_ids: torch.Tensor,
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
