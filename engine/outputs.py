"""What the engine hands back: vLLM-shaped request and completion outputs."""
from __future__ import annotations

from dataclasses import dataclass, field


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
    logprobs: list[PositionLogprobs] | None
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
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    lora_name: str | None = None
    metrics: dict = field(default_factory=dict)
