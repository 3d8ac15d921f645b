"""Check an adapter's base against the served model (TGI: other architecture refused, other checkpoint warned)."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import huggingface_hub
from huggingface_hub.errors import HFValidationError

from .errors import AdapterError
from .model_info import ModelInfo

logger = logging.getLogger("loraserve.adapters")


def _family(architecture: str) -> str:
    """"LlamaForCausalLM" and "LlamaModel" are both the "Llama" family."""
    return re.split(r"For[A-Z]|Model$", architecture, maxsplit=1)[0]


def _base_config(base: str) -> dict | None:
    """The base checkpoint's config.json, from a local directory or the Hub cache; never downloads."""
    local = Path(base).expanduser()
    path: Path | None = local / "config.json" if local.is_dir() else None
    if path is None:
        try:
            cached = huggingface_hub.try_to_load_from_cache(base, "config.json")
        except HFValidationError:
            return None
        path = Path(cached) if isinstance(cached, str) else None
    if path is None or not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _same_checkpoint(a: str, b: str) -> bool:
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def check_base_model(config: dict, model: ModelInfo, source: str) -> None:
    """Refuse an adapter whose base has another architecture; warn when only the checkpoint differs."""
    base = config.get("base_model_name_or_path")
    architectures: list[str] = []
    base_class = (config.get("auto_mapping") or {}).get("base_model_class")
    if isinstance(base_class, str):
        architectures.append(base_class)
    base_config = _base_config(base) if isinstance(base, str) and base else None
    if base_config is not None:
        architectures.extend(a for a in base_config.get("architectures") or [] if isinstance(a, str))
        base_type = base_config.get("model_type")
        if isinstance(base_type, str) and base_type != model.model_type:
            raise AdapterError(
                f"Adapter {source} was trained for a {base_type!r} model ({base}), "
                f"but the served model is {model.model_type!r} ({model.architecture})."
            )
    for architecture in architectures:
        if _family(architecture) != _family(model.architecture):
            raise AdapterError(
                f"Adapter {source} was trained for {architecture}, but the served model is {model.architecture}."
            )
    if isinstance(base, str) and base and model.name_or_path and not _same_checkpoint(base, model.name_or_path):
        logger.warning(
            "Adapter %s was trained on %s but the served model is %s (same architecture %s); loading it anyway.",
            source,
            base,
            model.name_or_path,
            model.architecture,
        )
