"""Requests and their sequences (one per `n`), as the scheduler and engine track them."""
from __future__ import annotations

import array
import enum
import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from .lora_request import LoRARequest
from .flat_logprobs import LogprobRecord

# stands in a sequence's token_ids for a token sampled by a step still on the device (async
# scheduling): the scheduler counts it, the model runner reads its value on the device
IN_FLIGHT_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    ENDING = "ending"  # its last token (by length) is still on the device; it holds no KV block or slot pin
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: Any  # SamplingParams
    lora_request: LoRARequest | None
    sequences: list["Sequence"] = field(default_factory=list)
    prompt_logprobs: LogprobRecord | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # params.bad_words, tokenized

    @property
    def finished(self) -> bool:
        for seq in self.sequences:  # a loop: asked of every request every step, it beats all() of a generator
            if seq.status is not SequenceStatus.FINISHED:
                return False
        return True

    @functools.cached_property
    def prompt_token_array(self) -> array.array:
        """The prompt as int64s, built once: the penalties gather every row's prompt each step, and from a list
        that costs a conversion a token (about 5 ms a step for 128 prompts of 512 tokens on the H200's host)."""
        return array.array("q", self.prompt_token_ids)

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request else 0


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request: Request
    index: int
    token_ids: list[int]
    detokenizer: Any  # IncrementalDetokenizer
    generator: torch.Generator | None
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    logprobs: LogprobRecord | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    skipped_steps: int = 0  # times the scheduler passed it over for lack of an adapter slot

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def drop_in_flight_token(self) -> None:
        """Forget the placeholder of a token not yet read back (the sequence ended, or it is read now)."""
        if self.token_ids and self.token_ids[-1] == IN_FLIGHT_TOKEN:
            self.token_ids.pop()

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id
