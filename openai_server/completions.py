"""POST /v1/completions: one engine request per prompt, `n` choices each, streamed or whole."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from .generation import Generation, abort_all, merge, start_for_client, usage, usage_of
from .httputil import client_gone, json_unless_disconnected, parse_body, sse_response, with_openai_framing
from .protocol import CompletionRequest
from .sampling import check_logprobs, sampling_params
from .state import ServerState


@dataclass
class _ChoiceProgress:
    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    started: bool = False
    finished: bool = False


class CompletionHandler:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def handle(self, request: Request) -> Response:
        state = self.state
        body = await parse_body(request, CompletionRequest)
        lora = state.adapters.resolve(body.model)
        state.metrics.requests.labels("completions", state.metrics.label(lora)).inc()
        check_logprobs(body.logprobs, state.settings.max_logprobs, "logprobs")
        echo_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        params = sampling_params(body, max_tokens=body.max_tokens, logprobs=body.logprobs, prompt_logprobs=echo_logprobs)
        prompts = body.prompts()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        generations = await start_for_client(request, state, prompts, params, lora,
                                             [f"{request_id}-{i}" for i in range(len(prompts))])
        if generations is None:
            return client_gone()
        model = body.model or state.adapters.base_name
        created = int(time.time())
        if body.stream:
            events = self._stream(body, prompts, generations, request_id, model, created)
            return sse_response(with_openai_framing(events), lambda: abort_all(generations))
        return await json_unless_disconnected(request, self._whole(body, prompts, generations, request_id, model, created))

    def _echo(self, body, prompt: str | list[int], output) -> str:
        """The prompt as echoed: its text, or the tokens the engine ran decoded (token ids, or a prompt cut by
        truncate_prompt_tokens, so that the echoed logprobs' offsets point into it)."""
        if isinstance(prompt, str) and body.truncate_prompt_tokens is None:
            return prompt
        return self.state.tokenizer.decode(output.prompt_token_ids)

    async def _whole(self, body, prompts, generations: list[Generation], request_id, model, created) -> dict:
        finals = [generation.last for generation in generations]
        async for index, output in merge(generations):
            finals[index] = output
        fmt = self.state.logprobs
        choices = []
        for prompt_index, output in enumerate(finals):
            for completion in output.outputs:
                text, token_ids, positions = completion.text, completion.token_ids, completion.logprobs
                if body.echo:
                    text = self._echo(body, prompts[prompt_index], output) + text
                    token_ids = output.prompt_token_ids + token_ids
                    positions = (output.prompt_logprobs or [None] * len(output.prompt_token_ids)) + (positions or [])
                choices.append({
                    "index": prompt_index * body.n + completion.index,
                    "text": text,
                    "logprobs": fmt.completion(token_ids, positions, body.logprobs, 0) if body.logprobs is not None else None,
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                })
        return {
            "id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": sorted(choices, key=lambda c: c["index"]), "usage": usage(finals),
        }

    async def _stream(self, body, prompts, generations, request_id, model, created) -> AsyncIterator[dict]:
        fmt = self.state.logprobs
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous_usage = bool(body.stream_options and body.stream_options.continuous_usage)
        progress: dict[int, _ChoiceProgress] = {}
        finals = [generation.last for generation in generations]

        def chunk(choices: list[dict], so_far: dict | None = None) -> dict:
            """so_far: the chunk's choice's usage so far, for continuous usage stats (as vLLM counts)."""
            event = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices}
            if include_usage:
                event["usage"] = so_far if continuous_usage else None
            return event

        async for prompt_index, output in merge(generations):
            finals[prompt_index] = output
            for completion in output.outputs:
                index = prompt_index * body.n + completion.index
                choice = progress.setdefault(index, _ChoiceProgress())
                if choice.finished:
                    continue
                text = completion.text[choice.text_len:]
                token_ids = completion.token_ids[choice.num_tokens:]
                positions = (completion.logprobs or [])[choice.num_tokens:]
                if body.echo and not choice.started:
                    text = self._echo(body, prompts[prompt_index], output) + text
                    token_ids = output.prompt_token_ids + token_ids
                    positions = (output.prompt_logprobs or [None] * len(output.prompt_token_ids)) + positions
                reports_tokens = body.logprobs is not None and bool(token_ids)
                if not text and not reports_tokens and completion.finish_reason is None:
                    continue
                logprobs = None
                if body.logprobs is not None:
                    logprobs = fmt.completion(token_ids, positions, body.logprobs, choice.text_offset)
                    choice.text_offset += sum(len(t) for t in logprobs["tokens"])
                choice.started = True
                choice.text_len = len(completion.text)
                choice.num_tokens = len(completion.token_ids)
                choice.finished = completion.finish_reason is not None
                yield chunk([{
                    "index": index, "text": text, "logprobs": logprobs,
                    "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
                }], usage_of(len(output.prompt_token_ids), len(completion.token_ids)))
        if include_usage:
            yield {**chunk([]), "usage": usage(finals)}

