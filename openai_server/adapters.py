"""The `model` name → base or adapter, and the runtime load/unload of adapters (registry + engine, kept in step)."""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import anyio

from adapters_registry import AdapterEntry, AdapterError, AdapterNotFoundError, AdapterRegistry, AdapterSpec
from engine import LoRARequest
from engine.lora_manager import LoRAResidency

from .allowed_dirs import check_allowed
from .errors import APIError, bad_request, model_not_found

logger = logging.getLogger("loraserve.server")


def lora_request(entry: AdapterEntry) -> LoRARequest:
    return LoRARequest(entry.name, entry.int_id, entry.path)


def register_adapter(engine, registry: AdapterRegistry, spec: AdapterSpec, *, replace: bool = False) -> AdapterEntry:
    """Validate and load an adapter, then hand its weights to the engine; an old version (replace) is unloaded."""
    previous = registry.lookup(spec.name) if replace else None
    entry, weights = registry.register(spec, replace=replace)
    engine.add_lora(lora_request(entry), weights)
    if previous is not None:
        engine.remove_lora(previous.int_id)
    logger.debug(  # the registry already logged TGI's one line per adapter
        "Loaded adapter %s: rank %d, %d target modules, from %s in %.2f s",
        entry.name, entry.rank, len(entry.target_modules), entry.path, entry.load_seconds,
    )
    return entry


class AdapterService:
    """Resolves request `model` names and serves the adapter endpoints for one app."""

    def __init__(
        self,
        engine,
        registry: AdapterRegistry,
        base_names: list[str],
        *,
        allow_runtime_updating: bool,
        allowed_dirs: list[Path],
    ) -> None:
        self.engine = engine
        self.registry = registry
        self.base_names = base_names
        self.allow_runtime_updating = allow_runtime_updating
        self.allowed_dirs = allowed_dirs
        self._lock = asyncio.Lock()
        self.created = int(time.time())
        # unloaded (or replaced in place) adapters, listed while requests (queued or running) still use them
        self._unloaded: dict[int, AdapterEntry] = {}

    @property
    def base_name(self) -> str:
        return self.base_names[0]

    def resolve(self, model: str | None) -> LoRARequest | None:
        """None for the base model, a LoRARequest for an adapter; an unknown name is a 404."""
        if model is None or model in self.base_names:
            return None
        entry = self.registry.lookup(model)
        if entry is None:
            raise model_not_found(model)
        return lora_request(entry)

    def served(self) -> list[tuple[AdapterEntry, LoRAResidency | None]]:
        """Registered adapters, then unloaded ones whose requests have not ended (forgotten once they have: the
        engine then stops listing them), each with its residency: requests count per adapter until they end."""
        status = self.engine.lora_status()
        for int_id in list(self._unloaded):
            if int_id not in status:
                del self._unloaded[int_id]
        registered = [(entry, status.get(entry.int_id)) for entry in self.registry.list()]
        return registered + [(entry, status[entry.int_id]) for entry in self._unloaded.values()]

    def model_cards(self) -> list[dict]:
        """One card per name of the base model (as vLLM lists every served name), then one per adapter."""
        max_len = self.engine.max_model_len
        bases = [
            {
                "id": name, "object": "model", "created": self.created, "owned_by": "loraserve",
                "root": self.engine.model_name, "parent": None, "max_model_len": max_len,
            }
            for name in self.base_names
        ]
        adapters = [
            {
                "id": entry.name, "object": "model", "created": int(entry.loaded_at), "owned_by": "loraserve",
                "root": entry.source, "parent": self.base_name, "max_model_len": max_len,
            }
            for entry in self.registry.list()
        ]
        return [*bases, *adapters]

    def describe(self) -> list[dict]:
        """Each adapter with its shape, where its weights live now, and how busy it is; one unloaded while its
        requests still run is marked so, until they end."""
        described = []
        for entry, residency in self.served():
            slot = residency.slot if residency else None
            in_cpu = bool(residency and residency.in_cpu)
            described.append({
                "name": entry.name,
                "id": entry.int_id,
                "path": entry.path,
                "source": entry.source,
                "revision": entry.revision,
                "base_model_name": entry.base_model_name or self.base_name,
                "rank": entry.rank,
                "target_modules": entry.target_modules,
                "residency": "slot" if slot is not None else "host" if in_cpu else "disk",
                "slot": slot,
                "running_requests": residency.running if residency else 0,
                "unloaded": bool(residency and residency.unloaded),
                "loaded_at": entry.loaded_at,
                "load_seconds": round(entry.load_seconds, 4),
            })
        return described

    def _require_runtime_updating(self) -> None:
        if not self.allow_runtime_updating:
            raise APIError(
                "Runtime LoRA updating is disabled; start the server with --allow-runtime-lora-updating.", 404
            )

    async def load(self, name: str | None, path: str | None, load_inplace: bool) -> str:
        self._require_runtime_updating()
        if not name or not path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.base_names:
            raise bad_request(f"The name '{name}' is the base model's name; choose another adapter name.", "lora_name")
        async with self._lock:
            if name in self.registry and not load_inplace:
                raise bad_request(
                    f"The lora adapter '{name}' has already been loaded. "
                    "If you want to load the adapter in place, set 'load_inplace' to True.",
                    "lora_name",
                )
            if self.allowed_dirs:
                try:
                    check_allowed(path, self.allowed_dirs)
                except PermissionError as exc:
                    raise APIError(str(exc), 403, param="lora_path") from None
            spec = AdapterSpec(name=name, path=path)
            previous = self.registry.lookup(name) if load_inplace else None
            try:
                await anyio.to_thread.run_sync(
                    lambda: register_adapter(self.engine, self.registry, spec, replace=load_inplace)
                )
            except AdapterNotFoundError as exc:
                raise APIError(str(exc), 404, param="lora_path") from None
            except (AdapterError, ValueError) as exc:
                raise bad_request(str(exc), "lora_path") from None
            if previous is not None:
                self._unloaded[previous.int_id] = previous
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str | None) -> str:
        self._require_runtime_updating()
        if not name:
            raise bad_request("'lora_name' must be provided.", "lora_name")
        async with self._lock:
            try:
                entry = self.registry.unregister(name)
            except KeyError:
                raise APIError(f"The lora adapter '{name}' cannot be found.", 404, param="lora_name") from None
            self._unloaded[entry.int_id] = entry
            await anyio.to_thread.run_sync(self.engine.remove_lora, entry.int_id)
        logger.info("Unloaded adapter %s", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

