"""vLLM's POST /tokenize and POST /detokenize: the served model's tokenizer (adapters share it), off the event loop."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .chat import render_messages
from .errors import bad_request
from .httputil import parse_body
from .protocol import DetokenizeRequest, TokenizeRequest
from .state import ServerState


class TokenizeHandlers:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def tokenize(self, request: Request) -> Response:
        state = self.state
        body = await parse_body(request, TokenizeRequest)
        state.adapters.resolve(body.model)  # an unknown model is a 404, as everywhere
        tokenizer = state.tokenizer
        if body.messages is not None:
            tokens = await render_messages(state, body)
        else:
            tokens = await state.engine.run_tokenizer(
                lambda: tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        return JSONResponse({
            "count": len(tokens), "max_model_len": state.engine.max_model_len, "tokens": tokens,
            "token_strs": tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None,
        })

    async def detokenize(self, request: Request) -> Response:
        state = self.state
        body = await parse_body(request, DetokenizeRequest)
        state.adapters.resolve(body.model)
        vocab = len(state.tokenizer)
        if any(token >= vocab for token in body.tokens):
            raise bad_request(f"tokens must be below the tokenizer's vocabulary size {vocab}", param="tokens")
        text = await state.engine.run_tokenizer(lambda: state.tokenizer.decode(body.tokens))
        return JSONResponse({"prompt": text})
