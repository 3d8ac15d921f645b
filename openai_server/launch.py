"""From a ServeConfig to a running server: engine, adapter registry, startup adapters, app, uvicorn."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from starlette.applications import Starlette

from adapters_registry import AdapterRegistry
from engine import AsyncEngineBase, EngineConfig, start_async_engine
from engine.gc_heap import freeze_startup_heap

from .adapters import register_adapter
from .app import build_app
from .chat_template import load_chat_template
from .config import ServeConfig
from .state import ServerSettings

logger = logging.getLogger("loraserve.server")


@dataclass
class Server:
    engine: AsyncEngineBase
    registry: AdapterRegistry
    app: Starlette


def engine_config(config: ServeConfig) -> EngineConfig:
    """LoRA is switched on by itself when adapters are configured or may be loaded at runtime."""
    wants_lora = bool(config.adapter_specs()) or config.allow_runtime_lora_updating
    if wants_lora and not config.enable_lora:
        logger.info("Adapters are configured: enabling LoRA (--enable-lora)")
    return EngineConfig(
        model=config.model,
        revision=config.revision,
        tokenizer=config.tokenizer,
        dtype=config.dtype,
        load_format=config.load_format,
        device=config.device,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        block_size=config.block_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
        tensor_parallel_size=config.tensor_parallel_size,
        enforce_eager=config.enforce_eager,
        cudagraph_mode=config.cudagraph_mode,
        async_scheduling=config.async_scheduling,
        enable_lora=config.enable_lora or wants_lora,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        max_cpu_loras=config.max_cpu_loras,
        adapter_reader=config.adapter_reader,
        admission_order=config.admission_order,
        allow_pickle_adapters=config.allow_pickle_adapters,
        seed=config.seed,
    )


def server_settings(config: ServeConfig) -> ServerSettings:
    if config.allow_runtime_lora_updating and not config.lora_allowed_dirs:
        logger.warning("Runtime LoRA updating is on without --lora-allowed-dirs: any local path can be loaded")
    return ServerSettings(
        served_model_names=list(config.served_model_name),
        api_key=config.api_key,
        allow_runtime_lora_updating=config.allow_runtime_lora_updating,
        lora_allowed_dirs=[Path(d) for d in config.lora_allowed_dirs],
        chat_template=load_chat_template(config.chat_template),
        max_logprobs=config.max_logprobs,
    )


def build_server(config: ServeConfig) -> Server:
    """Load the model and every configured adapter (a bad adapter stops startup with its reason)."""
    settings = server_settings(config)
    engine = start_async_engine(engine_config(config), config.engine_core)
    registry = AdapterRegistry(engine.model_info, allow_pickle=config.allow_pickle_adapters, dtype=engine.dtype)
    for spec in config.adapter_specs():
        register_adapter(engine, registry, spec)
    return Server(engine, registry, build_app(engine, registry, settings))


def serve(config: ServeConfig) -> None:
    server = build_server(config)
    freeze_startup_heap()
    base = config.served_model_name[0] if config.served_model_name else server.engine.model_name
    logger.info("loraserve listening on http://%s:%d (model %s, %d adapters)",
                config.host, config.port, base, len(server.registry))
    try:
        uvicorn.run(server.app, host=config.host, port=config.port, log_level=config.log_level)
    finally:
        server.engine.shutdown()
