"""Turn an adapter's path (local directory or Hub repo id) into a local directory."""
from __future__ import annotations

import os
from pathlib import Path

import huggingface_hub
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id

from .errors import AdapterError, AdapterNotFoundError

ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"]


def looks_local(path: str) -> bool:
    """True for paths that can only mean the local filesystem (absolute, ./, ../, ~, or deeper than org/name)."""
    return (
        os.path.isabs(path)
        or path in (".", "..")
        or path.startswith(("./", "../", "~"))
        or path.count("/") > 1
    )


def resolve_adapter_path(path: str, revision: str | None = None) -> Path:
    """A local directory as is; otherwise a Hub repo through `snapshot_download` (honours HF_HUB_OFFLINE and the cache).

    The revision applies to Hub repos only.
    """
    local = Path(path).expanduser()
    if local.is_dir():
        return local.resolve()
    if local.exists():
        raise AdapterError(f"Adapter path {path} is not a directory.")
    if looks_local(path):
        raise AdapterNotFoundError(f"Adapter path {path} does not exist.")
    try:
        validate_repo_id(path)
    except HFValidationError:
        raise AdapterNotFoundError(
            f"Adapter {path} is neither a local directory nor a valid Hugging Face Hub repo id."
        ) from None
    where = f"{path}@{revision}" if revision else path
    try:
        return Path(huggingface_hub.snapshot_download(path, revision=revision, allow_patterns=ADAPTER_FILES))
    except LocalEntryNotFoundError:
        raise AdapterNotFoundError(
            f"Adapter {where} is not a local directory, is not in the local Hugging Face cache, "
            "and the Hub cannot be reached (offline mode or no connection)."
        ) from None
    except OSError as exc:
        raise AdapterNotFoundError(f"Adapter {where} could not be fetched from the Hugging Face Hub: {exc}") from None
