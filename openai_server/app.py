"""The Starlette app: routes for the OpenAI, vLLM and TGI surfaces over one engine and adapter registry."""
from __future__ import annotations

import importlib.metadata
import logging
import tomllib
from pathlib import Path

import anyio
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from adapters_registry import AdapterRegistry
from engine import EngineStopped

from .adapters import AdapterService
from .auth import APIKeyMiddleware
from .chat import ChatHandler
from .completions import CompletionHandler
from .errors import APIError, error_body
from .httputil import parse_body
from .logprobs import LogprobFormatter
from .metrics import ServerMetrics
from .protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from .state import ServerSettings, ServerState
from .tgi import TGIHandler
from .tokenize import TokenizeHandlers

logger = logging.getLogger("loraserve.server")


def server_version() -> str:
    """The installed distribution's version, or pyproject's when running from a source checkout."""
    try:
        return importlib.metadata.version("loraserve")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


def build_app(engine, registry: AdapterRegistry, settings: ServerSettings) -> Starlette:
    """An app serving `engine`; adapters already in `registry` are served, and (if allowed) more can be loaded."""
    adapters = AdapterService(
        engine,
        registry,
        settings.served_model_names or [engine.model_name],
        allow_runtime_updating=settings.allow_runtime_lora_updating,
        allowed_dirs=settings.lora_allowed_dirs,
    )
    state = ServerState(
        engine=engine,
        adapters=adapters,
        metrics=ServerMetrics(engine, adapters.served, adapters.base_name),
        settings=settings,
        logprobs=LogprobFormatter(engine.tokenizer),
    )
    version = server_version()
    tokenize = TokenizeHandlers(state)

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": adapters.model_cards()})

    async def lora_adapters(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": await anyio.to_thread.run_sync(adapters.describe)})

    async def load_lora_adapter(request: Request) -> Response:
        body = await parse_body(request, LoadLoRAAdapterRequest)
        return PlainTextResponse(await adapters.load(body.lora_name, body.lora_path, body.load_inplace))

    async def unload_lora_adapter(request: Request) -> Response:
        body = await parse_body(request, UnloadLoRAAdapterRequest)
        return PlainTextResponse(await adapters.unload(body.lora_name))

    async def health(_: Request) -> Response:
        return Response(status_code=200 if engine.alive else 503)

    async def metrics(_: Request) -> Response:
        return Response(await anyio.to_thread.run_sync(state.metrics.render), media_type=CONTENT_TYPE_LATEST)

    async def version_info(_: Request) -> Response:
        return JSONResponse({"version": version})

    async def tgi_info(_: Request) -> Response:
        """TGI's GET /info: what its clients read to size their requests."""
        return JSONResponse({
            "model_id": adapters.base_name, "model_dtype": str(engine.dtype).removeprefix("torch."),
            "model_device_type": engine.device.type, "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": engine.config.max_num_seqs, "max_best_of": 1,
            "max_input_tokens": engine.max_model_len - 1, "max_total_tokens": engine.max_model_len,
            "router": "loraserve", "version": version,
        })

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", CompletionHandler(state).handle, methods=["POST"]),
        Route("/v1/chat/completions", ChatHandler(state).handle, methods=["POST"]),
        Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
        Route("/v1/lora_adapters", lora_adapters, methods=["GET"]),
        Route("/tokenize", tokenize.tokenize, methods=["POST"]),
        Route("/detokenize", tokenize.detokenize, methods=["POST"]),
        Route("/generate", TGIHandler(state, stream=False).handle, methods=["POST"]),
        Route("/generate_stream", TGIHandler(state, stream=True).handle, methods=["POST"]),
        Route("/", TGIHandler(state, stream=None).handle, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/version", version_info, methods=["GET"]),
        Route("/info", tgi_info, methods=["GET"]),
    ]
    middleware = [Middleware(APIKeyMiddleware, api_key=settings.api_key)] if settings.api_key else []
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=_exception_handlers())
    app.state.server = state
    return app


def _exception_handlers() -> dict:
    async def api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    async def engine_stopped(_: Request, exc: EngineStopped) -> Response:
        return JSONResponse(error_body(str(exc), 503), status_code=503)

    async def http_error(_: Request, exc: HTTPException) -> Response:
        return JSONResponse(error_body(exc.detail, exc.status_code), status_code=exc.status_code, headers=exc.headers)

    async def unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("Unhandled error", exc_info=exc)
        return JSONResponse(error_body("Internal server error.", 500), status_code=500)

    return {APIError: api_error, EngineStopped: engine_stopped, HTTPException: http_error, Exception: unexpected}
