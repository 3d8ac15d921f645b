"""The loraserve engine: continuous batching over a paged KV cache, with per-token LoRA adapters."""
from .async_engine import AsyncEngine
from .config import EngineConfig
from .flat_logprobs import FlatLogprobs
from .llm import LLM
from .llm_engine import EngineStats, LLMEngine
from .lora_request import LoRARequest
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams

__all__ = [
    "AsyncEngine", "CompletionOutput", "EngineConfig", "EngineStats", "FlatLogprobs", "LLM", "LLMEngine", "Logprob",
    "LoRARequest", "RequestOutput", "SamplingParams",
]
