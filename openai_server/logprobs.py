"""Engine logprobs (one {token_id: Logprob} per position) → OpenAI's completion and chat logprob shapes."""
from __future__ import annotations

import math
import re
from functools import lru_cache

from engine.detokenizer import TokenTexts
from engine.outputs import PositionLogprobs

# JSON has no -inf; clients get this floor instead (as vLLM does).
MIN_LOGPROB = -9999.0
_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte → printable-character table, inverted: how byte-level BPE spells raw bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _clamp(logprob: float) -> float:
    return MIN_LOGPROB if math.isinf(logprob) or math.isnan(logprob) else max(logprob, MIN_LOGPROB)


def _logprob(position: PositionLogprobs, token_id: int) -> float:
    entry = position.get(token_id)
    return -math.inf if entry is None else entry.logprob


class LogprobFormatter:
    """Turns token ids into the strings and bytes clients see, cached per id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = TokenTexts(tokenizer)
        self._bytes: dict[int, list[int]] = {}
        space = tokenizer.convert_ids_to_tokens(tokenizer.encode(" a", add_special_tokens=False))
        self._byte_level = any(piece.startswith("Ġ") for piece in space)

    def bytes(self, token_id: int) -> list[int]:
        """The token's exact bytes, even when it holds only part of a UTF-8 character."""
        if token_id not in self._bytes:
            piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
            decoder = _byte_level_decoder()
            hex_byte = _HEX_BYTE.match(piece)
            if self._byte_level and piece and all(ch in decoder for ch in piece):
                self._bytes[token_id] = [decoder[ch] for ch in piece]
            elif hex_byte:
                self._bytes[token_id] = [int(hex_byte.group(1), 16)]
            else:
                self._bytes[token_id] = list(self.text(token_id).encode("utf-8"))
        return self._bytes[token_id]

    @staticmethod
    def _top(position: PositionLogprobs, k: int) -> list[tuple[int, float]]:
        return sorted(((t, lp.logprob) for t, lp in position.items()), key=lambda item: -item[1])[:k]

    def completion(
        self, token_ids: list[int], positions: list[PositionLogprobs | None], top_k: int, offset: int
    ) -> dict:
        """`{tokens, token_logprobs, top_logprobs, text_offset}`; a position without logprobs (the first
        prompt token) gets nulls. top_logprobs holds the top k plus the chosen token, as in vLLM."""
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for token_id, position in zip(token_ids, positions):
            text = self.text(token_id)
            tokens.append(text)
            text_offset.append(offset)
            offset += len(text)
            if position is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            chosen = _logprob(position, token_id)
            token_logprobs.append(_clamp(chosen))
            top = dict(self._top(position, top_k))
            top.setdefault(token_id, chosen)
            top_logprobs.append({self.text(t): _clamp(lp) for t, lp in top.items()})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset}

    def chat(self, token_ids: list[int], positions: list[PositionLogprobs], top_k: int) -> list[dict]:
        """The `content` list of chat logprobs: one `{token, logprob, bytes, top_logprobs}` per token."""
        return [
            {
                "token": self.text(token_id),
                "logprob": _clamp(_logprob(position, token_id)),
                "bytes": self.bytes(token_id),
                "top_logprobs": [
                    {"token": self.text(t), "logprob": _clamp(lp), "bytes": self.bytes(t)}
                    for t, lp in self._top(position, top_k)
                ],
            }
            for token_id, position in zip(token_ids, positions)
        ]
