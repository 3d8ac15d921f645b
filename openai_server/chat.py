"""POST /v1/chat/completions: render the chat template, generate `n` choices, stream deltas or answer whole."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from functools import partial

from starlette.requests import Request
from starlette.responses import Response

from .chat_template import render_chat
from .generation import Generation, abort_all, merge, start_for_client, usage, usage_of
from .httputil import client_gone, json_unless_disconnected, parse_body, sse_response, with_openai_framing
from .protocol import ChatCompletionRequest, TokenizeRequest
from .sampling import check_logprobs, sampling_params
from .state import ServerState


async def render_messages(state: ServerState, body: ChatCompletionRequest | TokenizeRequest) -> list[int]:
    """A request's messages through the chat template as prompt tokens, on the tokenizer thread: chat completions
    and /tokenize count them the same."""
    return await state.engine.run_tokenizer(partial(
        render_chat,
        state.tokenizer,
        [message.as_template_input() for message in body.messages],
        chat_template=state.settings.chat_template,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        template_kwargs=body.chat_template_kwargs,
    ))


class ChatHandler:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def handle(self, request: Request) -> Response:
        state = self.state
        body = await parse_body(request, ChatCompletionRequest)
        lora = state.adapters.resolve(body.model)
        state.metrics.requests.labels("chat", state.metrics.label(lora)).inc()
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        check_logprobs(top_logprobs, state.settings.max_logprobs, "top_logprobs")
        prompt_ids = await render_messages(state, body)
        # no max_tokens: the engine allows what the context window (after truncate_prompt_tokens) and cache hold
        params = sampling_params(body, max_tokens=body.requested_max_tokens(), logprobs=top_logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generations = await start_for_client(request, state, [prompt_ids], params, lora, [request_id])
        if generations is None:
            return client_gone()
        model = body.model or state.adapters.base_name
        created = int(time.time())
        if body.stream:
            events = self._stream(body, generations, request_id, model, created, top_logprobs)
            return sse_response(with_openai_framing(events), lambda: abort_all(generations))
        return await json_unless_disconnected(request, self._whole(generations, request_id, model, created, top_logprobs))

    def _logprobs(self, completion, start: int, top_logprobs: int | None) -> dict | None:
        if top_logprobs is None:
            return None
        token_ids = completion.token_ids[start:]
        positions = (completion.logprobs or [])[start:]
        return {"content": self.state.logprobs.chat(token_ids, positions, top_logprobs)}

    async def _whole(self, generations: list[Generation], request_id, model, created, top_logprobs) -> dict:
        final = generations[0].last
        async for _, output in merge(generations):
            final = output
        choices = [
            {
                "index": completion.index,
                "message": {"role": "assistant", "content": completion.text},
                "logprobs": self._logprobs(completion, 0, top_logprobs),
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
            for completion in final.outputs
        ]
        return {
            "id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage([final]),
        }

    async def _stream(self, body, generations, request_id, model, created, top_logprobs) -> AsyncIterator[dict]:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous_usage = bool(body.stream_options and body.stream_options.continuous_usage)
        final = generations[0].last
        prompt_tokens = len(final.prompt_token_ids)

        def chunk(choices: list[dict], completion_tokens: int = 0) -> dict:
            """completion_tokens: the chunk's choice's tokens so far, for continuous usage stats (as vLLM counts)."""
            event = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
            if include_usage:
                event["usage"] = usage_of(prompt_tokens, completion_tokens) if continuous_usage else None
            return event

        for index in range(body.n):
            yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finished: set[int] = set()
        async for _, output in merge(generations):
            final = output
            for completion in output.outputs:
                index = completion.index
                if index in finished:
                    continue
                text = completion.text[sent_text.get(index, 0):]
                start = sent_tokens.get(index, 0)
                new_tokens = len(completion.token_ids) > start and top_logprobs is not None
                if not text and not new_tokens and completion.finish_reason is None:
                    continue
                sent_text[index] = len(completion.text)
                sent_tokens[index] = len(completion.token_ids)
                if completion.finish_reason is not None:
                    finished.add(index)
                yield chunk([{
                    "index": index,
                    "delta": {"content": text} if text else {},
                    "logprobs": self._logprobs(completion, start, top_logprobs),
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                }], len(completion.token_ids))
        if include_usage:
            yield {**chunk([]), "usage": usage([final])}
