"""The loraserve engine: continuous batching over a paged KV cache, with per-token LoRA adapters."""
from .async_engine import AsyncEngine, AsyncEngineBase
from .config import EngineConfig
from .core_client import ENGINE_CORES, EngineCoreClient, start_async_engine
from .engine_loop import EngineStopped
from .flat_logprobs import FlatLogprobs
from .llm import LLM
from .llm_engine import EngineStats, LLMEngine
from .lora_request import LoRARequest
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams

__all__ = [
    "AsyncEngine", "AsyncEngineBase", "CompletionOutput", "ENGINE_CORES", "EngineConfig", "EngineCoreClient",
    "EngineStats", "EngineStopped", "FlatLogprobs", "LLM", "LLMEngine", "Logprob", "LoRARequest", "RequestOutput",
    "SamplingParams", "start_async_engine",
]
