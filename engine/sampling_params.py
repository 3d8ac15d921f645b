"""vLLM-compatible sampling parameters, validated up front so bad requests fail before they run."""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

# Temperature 0 is greedy; temperatures between 0 and MIN_TEMPERATURE are raised to it, as vLLM raises them (logits
# divided by less overflow the float range), so only 0 is below SAMPLING_EPS.
SAMPLING_EPS = 1e-5
MIN_TEMPERATURE = 1e-2


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, for one request (all `n` completions share it)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: as many as the context window allows
    min_tokens: int = 0
    logprobs: int | None = None  # top alternatives reported per generated token (plus the chosen one)
    prompt_logprobs: int | None = None
    # logprobs and prompt_logprobs as FlatLogprobs: a few arrays, not a dict and a Logprob per token of every position
    flat_logprobs: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Accepted for vLLM compatibility; like vLLM with fast tokenizers, transformers' decode ignores it.
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be drawn
    bad_words: list[str] | None = None  # never generated, alone or as the end of a word begun before
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: the context window's)

    def __post_init__(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or at least 1, got {self.top_k}.")
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        if self.seed is not None:
            _check_int("seed", self.seed)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_token_ids(self.stop_token_ids, "stop_token_ids")
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _normalize_token_ids(self.allowed_token_ids, "allowed_token_ids")
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids cannot be empty.")
        self.bad_words = _normalize_words(self.bad_words)
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {self.truncate_prompt_tokens}.")
        if self.temperature < SAMPLING_EPS:
            # Greedy: the truncation knobs cannot change the argmax, so turn them off.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY


def bad_words_token_ids(words: list[str], tokenizer) -> list[list[int]]:
    """Each bad word's tokens as vLLM bans them: as written, and with a leading space when that spells the word
    with different tokens of the same count (a word in mid-text, for tokenizers that mark spaces)."""
    banned = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        banned.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            banned.append(spaced)
    return banned


def _check_int(name: str, value: object, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}.")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}.")


def _check_float(name: str, value: object, finite: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    if finite and math.isinf(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}.")


def _normalize_stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    stop = list(stop)
    for s in stop:
        if not isinstance(s, str):
            raise ValueError(f"stop must be a string or a list of strings, got {s!r}.")
        if not s:
            raise ValueError("stop cannot contain an empty string.")
    return stop


def _normalize_token_ids(token_ids: list[int] | None, name: str) -> list[int]:
    if token_ids is None:
        return []
    if isinstance(token_ids, (str, bytes, dict)):
        raise ValueError(f"{name} must be a list of token ids, got {token_ids!r}.")
    token_ids = list(token_ids)
    for token_id in token_ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"{name} must be non-negative integers, got {token_id!r}.")
    return token_ids


def _normalize_words(words: list[str] | None) -> list[str]:
    if words is None:
        return []
    if isinstance(words, str):
        raise ValueError(f"bad_words must be a list of strings, got {words!r}.")
    words = list(words)
    for word in words:
        if not isinstance(word, str) or not word.strip():
            raise ValueError(f"bad_words must be non-blank strings, got {word!r}.")
    return words


def _normalize_logit_bias(logit_bias: dict | None) -> dict[int, float] | None:
    """Keys may arrive as strings (JSON objects); bias values may be +-inf (ban or force a token)."""
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {logit_bias!r}.")
    normalized: dict[int, float] = {}
    for key, value in logit_bias.items():
        token_id = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {key!r}.")
        _check_float("logit_bias", value, finite=False)
        normalized[token_id] = float(value)
    return normalized
