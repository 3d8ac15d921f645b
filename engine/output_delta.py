"""Outputs across the process boundary: what each step added to a request, not the whole of it.

The engine's RequestOutputs are cumulative (every token and logprob so far), so sent whole a request of n tokens
would cost O(n²) to pickle. The engine-core process sends each output as a delta against the last one it sent for
that request (`DeltaEncoder`), and the client rebuilds the cumulative output from them (`DeltaDecoder`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .flat_logprobs import LogprobRecord
from .outputs import CompletionOutput, RequestOutput


@dataclass(slots=True)
class CompletionDelta:
    index: int
    text_kept: int  # characters of the text sent before that still stand (all of it, unless the text changed)
    text_added: str
    new_token_ids: list[int]
    cumulative_logprob: float | None
    new_logprobs: LogprobRecord | None  # positions after those sent before; None when not asked for
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(slots=True)
class OutputDelta:
    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    new_prompt_logprobs: LogprobRecord | None
    first: RequestHeader | None  # with a request's first delta only


@dataclass(slots=True)
class RequestHeader:
    """What an output repeats unchanged: sent once."""

    prompt: str | None
    prompt_token_ids: list[int]
    lora_name: str | None


@dataclass(slots=True)
class _Sent:
    text: str = ""
    num_token_ids: int = 0
    num_logprobs: int = 0


@dataclass(slots=True)
class _RequestSent:
    completions: dict[int, _Sent] = field(default_factory=dict)
    num_prompt_logprobs: int = 0


def _tail(record: LogprobRecord | None, start: int) -> LogprobRecord | None:
    return None if record is None else record[start:]


class DeltaEncoder:
    """The engine side: remembers how much of each running request it has sent."""

    def __init__(self) -> None:
        self._sent: dict[str, _RequestSent] = {}

    def encode(self, output: RequestOutput) -> OutputDelta:
        sent = self._sent.get(output.request_id)
        first = None
        if sent is None:
            sent = self._sent[output.request_id] = _RequestSent()
            first = RequestHeader(output.prompt, output.prompt_token_ids, output.lora_name)
        completions = [self._completion(sent.completions.setdefault(c.index, _Sent()), c) for c in output.outputs]
        prompt_logprobs = _tail(output.prompt_logprobs, sent.num_prompt_logprobs)
        if output.prompt_logprobs is not None:
            sent.num_prompt_logprobs = len(output.prompt_logprobs)
        if output.finished:
            del self._sent[output.request_id]
        return OutputDelta(output.request_id, completions, output.finished, prompt_logprobs, first)

    def forget(self, request_id: str) -> None:
        """The request ended without a finished output (it failed): nothing more will be sent for it."""
        self._sent.pop(request_id, None)

    @staticmethod
    def _completion(sent: _Sent, completion: CompletionOutput) -> CompletionDelta:
        text = completion.text
        kept = len(sent.text) if text.startswith(sent.text) else 0
        delta = CompletionDelta(
            completion.index, kept, text[kept:], completion.token_ids[sent.num_token_ids:],
            completion.cumulative_logprob, _tail(completion.logprobs, sent.num_logprobs),
            completion.finish_reason, completion.stop_reason)
        sent.text, sent.num_token_ids = text, len(completion.token_ids)
        if completion.logprobs is not None:
            sent.num_logprobs = len(completion.logprobs)
        return delta


class DeltaDecoder:
    """The client side: keeps each running request's cumulative output and applies deltas to it."""

    def __init__(self) -> None:
        self._outputs: dict[str, RequestOutput] = {}

    def decode(self, delta: OutputDelta) -> RequestOutput:
        """The cumulative output after `delta`: a new object whose lists are the caller's (as the engine's are)."""
        previous = self._outputs.get(delta.request_id)
        if previous is None:
            header = delta.first
            previous = RequestOutput(delta.request_id, header.prompt, header.prompt_token_ids, [], False,
                                     lora_name=header.lora_name)
        completions = {c.index: c for c in previous.outputs}
        for change in delta.completions:
            completions[change.index] = _apply(completions.get(change.index), change)
        output = RequestOutput(
            delta.request_id, previous.prompt, previous.prompt_token_ids,
            [completions[index] for index in sorted(completions)], delta.finished,
            prompt_logprobs=_extended(previous.prompt_logprobs, delta.new_prompt_logprobs),
            lora_name=previous.lora_name)
        if delta.finished:
            self._outputs.pop(delta.request_id, None)
        else:
            self._outputs[delta.request_id] = output
        return output

    def forget(self, request_id: str) -> None:
        self._outputs.pop(request_id, None)


def _extended(record: LogprobRecord | None, new: LogprobRecord | None) -> LogprobRecord | None:
    if new is None:
        return record
    if record is None:
        return new
    extended = record.copy()
    extended.extend(new)
    return extended


def _apply(previous: CompletionOutput | None, change: CompletionDelta) -> CompletionOutput:
    text = previous.text[:change.text_kept] if previous is not None else ""
    token_ids = previous.token_ids if previous is not None else []
    logprobs = previous.logprobs if previous is not None else None
    return CompletionOutput(
        index=change.index, text=text + change.text_added, token_ids=token_ids + change.new_token_ids,
        cumulative_logprob=change.cumulative_logprob, logprobs=_extended(logprobs, change.new_logprobs),
        finish_reason=change.finish_reason, stop_reason=change.stop_reason)
