"""What every handler of one app shares: the engine, the adapter service, metrics and the settings."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .adapters import AdapterService
from .logprobs import LogprobFormatter
from .metrics import ServerMetrics


@dataclass
class ServerSettings:
    """HTTP-side settings (the engine has its own EngineConfig)."""

    served_model_names: list[str] = field(default_factory=list)  # empty: the engine's model name
    api_key: str | None = None
    allow_runtime_lora_updating: bool = False
    lora_allowed_dirs: list[Path] = field(default_factory=list)  # empty: any local path may be loaded
    chat_template: str | None = None  # template text overriding the tokenizer's
    max_logprobs: int = 20


@dataclass
class ServerState:
    engine: object
    adapters: AdapterService
    metrics: ServerMetrics
    settings: ServerSettings
    logprobs: LogprobFormatter

    @property
    def tokenizer(self):
        return self.engine.tokenizer
