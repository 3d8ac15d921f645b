"""vLLM's flat logprobs (`SamplingParams(flat_logprobs=True)`): a request's logprob positions in a few flat arrays
instead of a dict and a `Logprob` per token of every position.

Python's collector walks every live container: scoring 512 prompts of 512 tokens with `prompt_logprobs=1` kept
about 800,000 dicts and `Logprob`s alive, and collections took a quarter of the run on the H200 (BENCHMARKS.md,
twenty-fifth session). Flat, a record is five objects however long it grows, four of them arrays the collector
never walks.
"""
from __future__ import annotations

import array
import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

from engine.outputs import Logprob, PositionLogprobs


class FlatLogprobs(Sequence[PositionLogprobs | None]):
    """Reads as a list of positions, each None or {token_id: Logprob} (built on each access, so changing one does
    not change the record); grows by `append` and `extend`. Position i holds entries bounds[i]:bounds[i + 1]; a
    position without entries is None (a position with logprobs has at least the chosen or target token)."""

    def __init__(self, positions: Iterable[PositionLogprobs | None] = ()):
        self._bounds = array.array("q", [0])
        self._token_ids = array.array("q")
        self._logprobs = array.array("d")
        self._ranks = array.array("q")  # 0 for a rank of None
        self._decoded_tokens: list[str | None] = []
        self.extend(positions)

    def append(self, position: PositionLogprobs | None) -> None:
        for token_id, logprob in (position or {}).items():
            self._token_ids.append(token_id)
            self._logprobs.append(logprob.logprob)
            self._ranks.append(logprob.rank or 0)
            self._decoded_tokens.append(logprob.decoded_token)
        self._bounds.append(len(self._token_ids))

    def extend(self, positions: Iterable[PositionLogprobs | None]) -> None:
        for position in positions:
            self.append(position)

    def copy(self) -> FlatLogprobs:
        """A snapshot, as list.copy() gives one (the engine hands out copies of records that go on growing)."""
        copied = FlatLogprobs()
        copied._bounds, copied._token_ids = array.array("q", self._bounds), array.array("q", self._token_ids)
        copied._logprobs, copied._ranks = array.array("d", self._logprobs), array.array("q", self._ranks)
        copied._decoded_tokens = list(self._decoded_tokens)
        return copied

    def __len__(self) -> int:
        return len(self._bounds) - 1

    @overload
    def __getitem__(self, index: int) -> PositionLogprobs | None: ...

    @overload
    def __getitem__(self, index: slice) -> FlatLogprobs: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return FlatLogprobs(self._position(i) for i in range(*index.indices(len(self))))
        position = operator.index(index)
        if position < 0:
            position += len(self)
        if not 0 <= position < len(self):
            raise IndexError("FlatLogprobs index out of range")
        return self._position(position)

    def __iter__(self) -> Iterator[PositionLogprobs | None]:
        return map(self._position, range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"FlatLogprobs({list(self)!r})"

    def _position(self, i: int) -> PositionLogprobs | None:
        start, end = self._bounds[i], self._bounds[i + 1]
        if start == end:
            return None
        return {self._token_ids[j]: Logprob(self._logprobs[j], self._ranks[j] or None, self._decoded_tokens[j])
                for j in range(start, end)}


# what the engine records a request's logprobs in: a list of positions, or flat on request
LogprobRecord = list[PositionLogprobs | None] | FlatLogprobs
