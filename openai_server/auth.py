"""Bearer-token auth for the API routes (`/v1/*`, TGI's, the tokenizer's); health, metrics and version stay open."""
from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_body

TGI_PATHS = ("/", "/generate", "/generate_stream")
TOKENIZER_PATHS = ("/tokenize", "/detokenize")


def is_protected(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path in TGI_PATHS or path in TOKENIZER_PATHS


class APIKeyMiddleware:
    """A plain ASGI middleware (not BaseHTTPMiddleware) so streaming and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and is_protected(scope["path"]):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected):
                response = JSONResponse(
                    error_body("Invalid or missing API key: send 'Authorization: Bearer <key>'.", 401, code="invalid_api_key"),
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
