"""What the engine hands back: vLLM-shaped request and completion outputs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.flat_logprobs import LogprobRecord


@dataclass
class Logprob:
    """One token's log-probability at one position, as vLLM reports it."""

    logprob: float
    rank: int | None = None  # 1 for the most likely token
    decoded_token: str | None = None  # the token alone, decoded


# token id -> its Logprob, for one position (the chosen token plus the top-k alternatives)
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: LogprobRecord | None  # a list, or FlatLogprobs with SamplingParams(flat_logprobs=True)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: LogprobRecord | None = None
    lora_name: str | None = None
    metrics: dict = field(default_factory=dict)
