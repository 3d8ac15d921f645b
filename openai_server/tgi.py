"""TGI's `POST /generate` and `POST /generate_stream` (`adapter_id` picks the adapter), with TGI's error shape."""
from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import PositionLogprobs

from .errors import APIError, bad_request
from .generation import Generation, abort_all, merge, start_for_client
from .httputil import client_gone, json_unless_disconnected, parse_body, sse_data, sse_response
from .protocol import TGIGenerateRequest
from .state import ServerState

logger = logging.getLogger("loraserve.server")
_REPLACEMENT_CHAR = "\ufffd"  # what a token holding part of a character decodes to alone


def _cut_to(texts: list[str], text: str) -> list[str]:
    """Token texts cut where `text` ends when they run past it (a stop sequence ending inside a token)."""
    if not "".join(texts).startswith(text):
        return texts
    cut, room = [], len(text)
    for piece in texts:
        cut.append(piece[:room])
        room -= len(cut[-1])
    return cut


def _tgi_error(exc: APIError) -> JSONResponse:
    kind = "validation" if exc.status < 500 else "generation"
    return JSONResponse({"error": exc.message, "error_type": kind}, status_code=exc.status)


def _finish_reason(completion) -> str:
    if completion.finish_reason == "length":
        return "length"
    if isinstance(completion.stop_reason, str):
        return "stop_sequence"
    return "eos_token"


def _params(body: TGIGenerateRequest) -> SamplingParams:
    """Greedy unless sampling is asked for, as TGI decides: `do_sample`, or a temperature other than 1, a top_k, or
    a top_p below 1. A matched stop sequence stays in the text, as TGI leaves it."""
    p = body.parameters
    warped = (p.temperature not in (None, 1.0)) or p.top_k is not None or (p.top_p is not None and p.top_p < 1.0)
    sample = p.do_sample or warped
    try:
        return SamplingParams(
            temperature=(p.temperature or 1.0) if sample else 0.0,
            top_p=p.top_p or 1.0,
            top_k=p.top_k or 0,
            repetition_penalty=p.repetition_penalty or 1.0,
            frequency_penalty=p.frequency_penalty or 0.0,
            seed=p.seed,
            stop=p.stop,
            include_stop_str_in_output=True,
            max_tokens=p.max_new_tokens,
            logprobs=0,
            prompt_logprobs=0 if p.decoder_input_details else None,
            truncate_prompt_tokens=p.truncate,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None


class TGIHandler:
    def __init__(self, state: ServerState, stream: bool | None) -> None:
        self.state = state
        self.stream = stream  # None: the body's `stream` field decides (TGI's `POST /`)
        self._special = set(state.tokenizer.all_special_ids)

    async def handle(self, request: Request) -> Response:
        try:
            return await self._handle(request)
        except APIError as exc:
            return _tgi_error(exc)

    async def _handle(self, request: Request) -> Response:
        state = self.state
        body = await parse_body(request, TGIGenerateRequest)
        lora = state.adapters.resolve(body.parameters.adapter_id)
        stream = body.stream if self.stream is None else self.stream
        if stream and body.parameters.decoder_input_details:
            raise bad_request("decoder_input_details == True is not supported when streaming tokens")
        state.metrics.requests.labels("generate_stream" if stream else "generate", state.metrics.label(lora)).inc()
        generations = await start_for_client(request, state, [body.inputs], _params(body), lora,
                                             [f"generate-{uuid.uuid4().hex}"])
        if generations is None:
            return client_gone()
        if stream:
            return sse_response(self._events(body, generations), lambda: abort_all(generations))
        return await json_unless_disconnected(request, self._whole(body, generations))

    def _token(self, token_id: int, text: str, position: PositionLogprobs | None) -> dict:
        special = token_id in self._special
        logprob = position[token_id].logprob if position and token_id in position else None
        return {"id": token_id, "text": text, "logprob": logprob, "special": special}

    def _tokens(self, completion, start: int, texts: list[str] | None = None) -> list[dict]:
        """The tokens since `start`, with `texts` (or no text yet)."""
        ids = completion.token_ids[start:]
        positions = (completion.logprobs or [])[start:] or [None] * len(ids)
        texts = texts or [""] * len(ids)
        return [self._token(token_id, text, position) for token_id, text, position in zip(ids, texts, positions)]

    def _token_texts(self, output) -> list[str]:
        """Each generated token's own text, as the stream released it: a character split over several tokens goes
        to the token that completes it, and special tokens have none. The texts the engine decoded for the logprobs
        (each token alone) are those when they are whole characters adding up to the generated text, as byte-level
        tokens almost always are; else (a split character, a SentencePiece word whose leading space shows only in
        context, a text cut by a stop sequence) the tokens are decoded again, in context."""
        completion = output.outputs[0]
        alone = self._texts_alone(completion)
        if "".join(alone) == completion.text and not any(_REPLACEMENT_CHAR in text for text in alone):
            return alone
        return _cut_to(self._texts_in_context(output.prompt_token_ids, completion.token_ids), completion.text)

    def _new_texts(self, output, start: int, text: str) -> list[str] | None:
        """The own texts of an output's tokens since `start` when it brings several (the engine sends a request's
        last two together), decoded in context, if they add up to its new `text`; else None (the new text then
        goes to the last of them)."""
        token_ids = output.outputs[0].token_ids
        if len(token_ids) - start < 2:
            return None
        texts = self._texts_in_context(output.prompt_token_ids, token_ids)[start:]
        return texts if "".join(texts) == text else None

    def _texts_alone(self, completion) -> list[str]:
        """Each token's text decoded alone, as the engine did for its logprobs (TGI's requests ask for them);
        special tokens have none."""
        return ["" if token_id in self._special else position[token_id].decoded_token
                for token_id, position in zip(completion.token_ids, completion.logprobs)]

    def _texts_in_context(self, prompt_token_ids: list[int], token_ids: list[int]) -> list[str]:
        """Each token's text decoded after the ones before it, as the engine's stream decodes it."""
        detokenizer = IncrementalDetokenizer(self.state.tokenizer, prompt_token_ids, SamplingParams())
        texts, shown = [], 0
        for token_id in token_ids:
            detokenizer.append(token_id)
            texts.append(detokenizer.output_text[shown:])
            shown = len(detokenizer.output_text)
        return texts

    def _prefill(self, output) -> list[dict]:
        """TGI's prefill tokens: each prompt token with its logprob given the ones before (none for the first)."""
        return [
            {"id": token_id, "text": self.state.logprobs.text(token_id),
             "logprob": position[token_id].logprob if position else None}
            for token_id, position in zip(output.prompt_token_ids, output.prompt_logprobs)
        ]

    def _details(self, body: TGIGenerateRequest, output, with_tokens: bool) -> dict:
        completion = output.outputs[0]
        details = {
            "finish_reason": _finish_reason(completion),
            "generated_tokens": len(completion.token_ids),
            "seed": body.parameters.seed,
        }
        if with_tokens:
            details["prefill"] = self._prefill(output) if body.parameters.decoder_input_details else []
            details["tokens"] = self._tokens(completion, 0, self._token_texts(output))
        return details

    async def _whole(self, body: TGIGenerateRequest, generations: list[Generation]) -> dict:
        final = generations[0].last
        async for _, output in merge(generations):
            final = output
        completion = final.outputs[0]
        text = body.inputs + completion.text if body.parameters.return_full_text else completion.text
        response = {"generated_text": text}
        if body.parameters.details:
            response["details"] = self._details(body, final, with_tokens=True)
        return response

    async def _events(self, body: TGIGenerateRequest, generations: list[Generation]) -> AsyncIterator[str]:
        """One event per token; the last carries `generated_text` and `details`. Events lag one token so
        the final one can be completed once the engine says the request is finished. Tokens that come together get
        their own texts (`_new_texts`); otherwise new text goes to the last new token that is not special, else to
        the event held back: TGI clients skip special tokens' text."""
        held: dict | None = None
        sent_text = sent_tokens = 0
        count = 0
        try:
            async for _, output in merge(generations):
                completion = output.outputs[0]
                text = completion.text[sent_text:]
                own_texts = self._new_texts(output, sent_tokens, text)
                tokens = self._tokens(completion, sent_tokens, own_texts)
                sent_text, sent_tokens = len(completion.text), len(completion.token_ids)
                if own_texts is None:
                    target = next((token for token in reversed(tokens) if not token["special"]), None)
                    if target is None and held is not None:
                        target = held["token"]
                    if target is not None:
                        target["text"] += text
                for token in tokens:
                    if held is not None:
                        yield sse_data(held)
                    count += 1
                    held = {"index": count, "token": token, "generated_text": None, "details": None, "top_tokens": None}
                if output.finished and held is not None:
                    full = completion.text
                    held["generated_text"] = body.inputs + full if body.parameters.return_full_text else full
                    held["details"] = self._details(body, output, with_tokens=False)
        except APIError as exc:
            yield sse_data({"error": exc.message, "error_type": "validation"})
            return
        except Exception:
            logger.exception("Error while streaming /generate_stream")
            yield sse_data({"error": "Internal server error while generating.", "error_type": "generation"})
            return
        if held is not None:
            yield sse_data(held)
