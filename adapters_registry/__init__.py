"""Adapters as data: spec parsing, Hub/local resolution, peft validation, weight loading and the registry table."""
from .errors import AdapterError, AdapterNotFoundError
from .loader import LoadedAdapter, LoRAModuleWeights, check_adapter, load_adapter
from .model_info import LORA_PROJECTIONS, ModelInfo
from .registry import AdapterEntry, AdapterRegistry
from .resolve import resolve_adapter_path
from .specs import AdapterSpec, parse_lora_adapters, parse_lora_modules

__all__ = [
    "LORA_PROJECTIONS",
    "AdapterEntry",
    "AdapterError",
    "AdapterNotFoundError",
    "AdapterRegistry",
    "AdapterSpec",
    "LoRAModuleWeights",
    "LoadedAdapter",
    "ModelInfo",
    "check_adapter",
    "load_adapter",
    "parse_lora_adapters",
    "parse_lora_modules",
    "resolve_adapter_path",
]
