"""What the sampler needs of one sequence in one step."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One sequence to sample for in this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]  # the engine passes an int64 array (Request.prompt_token_array)
    output_token_ids: list[int]  # generated before this step
    generator: torch.Generator | None = None  # set for seeded requests (see make_generator)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Async scheduling: output_token_ids ends in a placeholder for the token the step in flight drew, which is row
    # in_flight_row of the tokens passed with the rows (-1: every token is on the host).
    in_flight_row: int = -1
