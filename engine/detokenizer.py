"""Incremental detokenization with stop strings, at constant cost per token.

vLLM's prefix/read offset method: decode a short window of ids twice (up to the last emitted
token, and through the new one) and emit the difference. Text is only emitted once it does not
end in U+FFFD, so a multi-byte character split across tokens is never shown half-done.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

from transformers import PreTrainedTokenizerBase, TokenizersBackend

from engine.outputs import PositionLogprobs
from engine.sampling_params import SamplingParams

# How many prompt tokens give the first generated token its context (spaces, merges), as in vLLM.
_PROMPT_CONTEXT = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text of one generated sequence, fed one token at a time."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self._decode = _decoder(tokenizer, params.skip_special_tokens)
        self._params = params
        # Only the prompt's tail is kept: the window never reaches further back.
        self._ids = list(prompt_token_ids[-(_PROMPT_CONTEXT + 2) :])
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - _PROMPT_CONTEXT, 0)
        self._num_output_tokens = 0
        self._text = ""
        self._finished = False
        self._stop = params.stop
        self._max_stop_len = max((len(s) for s in self._stop), default=0)

    def append(self, token_id: int) -> str | None:
        """Adds one generated token; returns the stop string if one just matched (the text then ends there)."""
        self._ids.append(token_id)
        self._num_output_tokens += 1
        new_text = self._decode_new()
        if not new_text:
            return None
        old_len = len(self._text)
        self._text += new_text
        # vLLM: stop strings count only once min_tokens tokens are out.
        if self._stop and self._num_output_tokens > self._params.min_tokens:
            return self._check_stop(old_len)
        return None

    @property
    def output_text(self) -> str:
        """Text safe to show now: no half character, and no tail that may yet become a stop string."""
        if self._finished or not self._stop:
            return self._text
        return self._text[: len(self._text) - self._pending_stop_prefix()]

    def flush(self) -> str:
        """Finishes the sequence (stopped for another reason): the whole text, including any held-back tail.

        Bytes of a character that never completed stay out, as in vLLM.
        """
        self._finished = True
        return self._text

    def _decode_new(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            # Nothing visible yet (a skipped special token, or an unfinished character): wait for more.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._drop_consumed_ids()
        return full_text[len(prefix_text) :]

    def _drop_consumed_ids(self) -> None:
        """Keeps memory constant: ids before the prefix offset are never decoded again."""
        if self._prefix_offset > 64:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _check_stop(self, old_len: int) -> str | None:
        """Finds the earliest stop string that ends in the newly added text, and truncates there."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self._params.include_stop_str_in_output else index
        self._text = self._text[:end]
        self._finished = True
        return stop

    def _pending_stop_prefix(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        text = self._text
        for length in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(len(stop) > length and stop.startswith(tail) for stop in self._stop):
                return length
        return 0


def _decoder(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False).

    A fast tokenizer whose decode is transformers' own only forwards that to the Rust tokenizer, after
    argument checks that cost more than decoding the few ids of a window: then the Rust one is called.
    (spaces_between_special_tokens is not passed: no transformers 5 tokenizer uses it, and one rejects it.)
    """
    cls = type(tokenizer)
    if cls.decode is PreTrainedTokenizerBase.decode and cls._decode is TokenizersBackend._decode:
        return partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=skip_special_tokens)
    return partial(tokenizer.decode, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


class TokenTexts:
    """Each token id decoded alone, with its special tokens shown (vLLM's `decoded_token`), cached per id:
    logprobs name the same few thousand tokens over and over."""

    def __init__(self, tokenizer):
        self._decode = _decoder(tokenizer, skip_special_tokens=False)
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode([token_id])
        return text

    def fill(self, position: PositionLogprobs) -> PositionLogprobs:
        """The position with each Logprob's decoded_token set."""
        for token_id, logprob in position.items():
            logprob.decoded_token = self(token_id)
        return position
