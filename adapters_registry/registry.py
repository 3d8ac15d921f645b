"""The name → adapter table that /v1/models lists and load/unload change; thread-safe."""
from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass

import torch

from .loader import LoadedAdapter, load_adapter
from .model_info import ModelInfo
from .resolve import resolve_adapter_path
from .specs import AdapterSpec

logger = logging.getLogger("loraserve.adapters")


@dataclass
class AdapterEntry:
    """A registered adapter: its name, a never-reused int id, where it came from and what it is. Not its weights:
    a server with many adapters would hold them all, while the engine's host cache keeps at most max_cpu_loras."""

    name: str
    int_id: int
    path: str  # resolved local directory
    source: str  # the path or repo id as given
    revision: str | None
    base_model_name: str | None
    rank: int
    target_modules: list[str]
    loaded_at: float
    load_seconds: float


class AdapterRegistry:
    """Registers adapters eagerly (resolve, validate, load) so a bad adapter fails here and changes nothing."""

    def __init__(self, model: ModelInfo, *, allow_pickle: bool = False, dtype: torch.dtype = torch.float32) -> None:
        """dtype: what the weights are loaded in; the engine's own (its slots') skips a float32 copy of each."""
        self.model = model
        self.allow_pickle = allow_pickle
        self.dtype = dtype
        self._lock = threading.Lock()
        self._entries: dict[str, AdapterEntry] = {}
        self._ids = itertools.count(1)

    def _check_free(self, name: str, replace: bool) -> None:
        if not replace and name in self._entries:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")

    def register(self, spec: AdapterSpec, *, replace: bool = False) -> tuple[AdapterEntry, LoadedAdapter]:
        """Load and add an adapter; with replace, an existing name gets the new weights under a new int id. Returns
        the entry and the weights it was checked with, for the caller to hand to the engine: the table keeps none."""
        with self._lock:
            self._check_free(spec.name, replace)
        logger.info("Loading adapter weights into model: %s", spec.name)
        start = time.perf_counter()
        path = resolve_adapter_path(spec.path, spec.revision)
        adapter = load_adapter(path, self.model, allow_pickle=self.allow_pickle, dtype=self.dtype)
        load_seconds = time.perf_counter() - start
        with self._lock:
            self._check_free(spec.name, replace)
            entry = AdapterEntry(
                name=spec.name,
                int_id=next(self._ids),
                path=str(path),
                source=spec.path,
                revision=spec.revision,
                base_model_name=spec.base_model_name,
                rank=adapter.rank,
                target_modules=adapter.target_modules,
                loaded_at=time.time(),
                load_seconds=load_seconds,
            )
            self._entries[spec.name] = entry
        return entry, adapter

    def unregister(self, name: str) -> AdapterEntry:
        """Remove a name; KeyError if it is not registered."""
        with self._lock:
            if name not in self._entries:
                raise KeyError(f"The lora adapter '{name}' is not loaded.")
            return self._entries.pop(name)

    def lookup(self, name: str) -> AdapterEntry | None:
        with self._lock:
            return self._entries.get(name)

    def list(self) -> list[AdapterEntry]:
        """Entries in registration order (a replaced name keeps its place)."""
        with self._lock:
            return list(self._entries.values())

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
