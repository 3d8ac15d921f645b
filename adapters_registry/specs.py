"""Adapter specs as users write them: TGI's LORA_ADAPTERS and vLLM's --lora-modules."""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterSpec:
    """A named adapter to register: `path` is a local directory or a Hub repo id."""

    name: str
    path: str
    revision: str | None = None
    base_model_name: str | None = None


_TGI_ENTRY = re.compile(r"^([^=@]+)(?:=([^=@]+))?(?:@([^=@]+))?$")


def parse_lora_adapters(text: str) -> list[AdapterSpec]:
    """Parse TGI's comma-separated `id`, `id@rev`, `name=/path`, `name=/path@rev` entries.

    For a bare `id` (a Hub repo) the name is the id itself.
    """
    if not text.strip():
        return []
    specs = []
    for raw in text.split(","):
        entry = raw.strip()
        match = _TGI_ENTRY.match(entry)
        if entry.count("=") > 1 or entry.count("@") > 1 or match is None:
            raise ValueError(f"Invalid LoRA adapter format: {entry}")
        name, path, revision = (part.strip() if part is not None else None for part in match.groups())
        if not name or path == "" or revision == "":
            raise ValueError(f"Invalid LoRA adapter format: {entry}")
        specs.append(AdapterSpec(name=name, path=path or name, revision=revision))
    return specs


_JSON_KEYS = {"name", "path", "base_model_name"}


def _parse_json_module(item: str) -> AdapterSpec:
    try:
        data = json.loads(item.strip())
    except json.JSONDecodeError as exc:
        raise ValueError(f"Invalid --lora-modules entry {item!r}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"Invalid --lora-modules entry {item!r}: expected a JSON object")
    unknown = sorted(set(data) - _JSON_KEYS)
    if unknown:
        raise ValueError(f"Invalid --lora-modules entry {item!r}: unknown keys {unknown}")
    for key in ("name", "path"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise ValueError(f"Invalid --lora-modules entry {item!r}: '{key}' must be a non-empty string")
    base = data.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"Invalid --lora-modules entry {item!r}: 'base_model_name' must be a string")
    return AdapterSpec(name=data["name"].strip(), path=data["path"].strip(), base_model_name=base)


def parse_lora_modules(items: Sequence[str]) -> list[AdapterSpec]:
    """Parse vLLM's `--lora-modules` items: `name=path`, or JSON `{"name", "path", "base_model_name"}`."""
    specs = []
    for item in items:
        text = item.strip()
        if text.startswith("{"):
            specs.append(_parse_json_module(item))
            continue
        parts = text.split("=")
        if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
            raise ValueError(
                f"Invalid --lora-modules entry {item!r}: expected name=path or "
                '{"name": ..., "path": ..., "base_model_name": ...}'
            )
        specs.append(AdapterSpec(name=parts[0].strip(), path=parts[1].strip()))
    return specs
