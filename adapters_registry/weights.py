"""Read a peft adapter's weight file into {module: {"A": A, "B": B}}; anything that is not LoRA A/B is refused."""
from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from .errors import AdapterError

SAFETENSORS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"

# base_model.model.<module>.lora_A.weight, or with the adapter name: ...lora_A.<adapter>.weight
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<side>[AB])(?:\.[^.]+)?\.weight$")


def read_tensors(directory: Path, *, allow_pickle: bool) -> dict[str, torch.Tensor]:
    """All tensors of the adapter's weight file; a pickle file only with allow_pickle."""
    safetensors_path = directory / SAFETENSORS_NAME
    pickle_path = directory / PICKLE_NAME
    if safetensors_path.is_file():
        try:
            return load_file(str(safetensors_path), device="cpu")
        except (SafetensorError, OSError) as exc:
            raise AdapterError(f"{safetensors_path} is corrupt or truncated: {exc}") from None
    if pickle_path.is_file():
        if not allow_pickle:
            raise AdapterError(
                f"{pickle_path} is a pickle file, which can run arbitrary code; refusing to load it. "
                f"Convert it to {SAFETENSORS_NAME}, or opt in to pickle loading."
            )
        try:
            tensors = torch.load(str(pickle_path), map_location="cpu", weights_only=True)
        except Exception as exc:  # torch.load raises many kinds on a bad file
            raise AdapterError(f"{pickle_path} is corrupt or not a weights-only state dict: {exc}") from None
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise AdapterError(f"{pickle_path} does not hold a dict of tensors.")
        return tensors
    raise AdapterError(f"No {SAFETENSORS_NAME} (or {PICKLE_NAME}) in {directory}.")


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


@dataclass(slots=True)
class TensorHeader:
    """A tensor as the safetensors header describes it: what validation needs, without the data
    (a plain object: a meta tensor per weight made most of a header check's time)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def read_tensor_headers(directory: Path, *, allow_pickle: bool) -> dict[str, TensorHeader | torch.Tensor]:
    """The weight file's tensor names, shapes and dtypes from the safetensors header alone, so an
    adapter can be checked without reading its weights. A pickle file has no header: it is read whole."""
    safetensors_path = directory / SAFETENSORS_NAME
    if not safetensors_path.is_file():
        return read_tensors(directory, allow_pickle=allow_pickle)
    try:
        with safe_open(str(safetensors_path), framework="pt") as weights:
            headers = {}
            for key in weights.keys():
                tensor = weights.get_slice(key)
                headers[key] = TensorHeader(tuple(tensor.get_shape()),
                                            _SAFETENSORS_DTYPES.get(tensor.get_dtype(), torch.uint8))
            return headers
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"{safetensors_path} is corrupt or truncated: {exc}") from None


def _refusal(key: str) -> str:
    if "lora_magnitude_vector" in key:
        return f"weight file has DoRA magnitude vector {key}; DoRA adapters are not supported."
    if "lora_embedding_" in key:
        return f"weight file has an embedding LoRA tensor {key}; embeddings have no LoRA path in this model."
    if ".lora_A." in key or ".lora_B." in key:
        return f"weight file has LoRA bias tensor {key}; LoRA biases are not supported."
    return f"weight file has non-LoRA tensor {key} (trained base weights are not supported)."


_Weight = TypeVar("_Weight", torch.Tensor, TensorHeader)


@functools.lru_cache(maxsize=16384)
def _module_and_side(key: str) -> tuple[str, str] | None:
    """(module, "A" or "B") of a LoRA weight's key, else None. Cached: the adapters of one model repeat
    the same few hundred keys, and matching them took 0.2 ms of each Llama-3-8B adapter's check."""
    match = _LORA_KEY.match(key)
    return None if match is None else (match["module"], match["side"])


def group_lora_tensors(tensors: Mapping[str, _Weight]) -> dict[str, dict[str, _Weight]]:
    """Group tensors (or their headers) by base module name; any that is not a LoRA A/B weight is refused."""
    modules: dict[str, dict[str, _Weight]] = {}
    for key, tensor in tensors.items():
        parsed = _module_and_side(key)
        if parsed is None:
            raise AdapterError(_refusal(key))
        module, side = parsed
        sides = modules.setdefault(module, {})
        if side in sides:
            raise AdapterError(f"weight file has more than one lora_{side} for {module}.")
        if not tensor.dtype.is_floating_point:
            raise AdapterError(f"{key} has dtype {tensor.dtype}; LoRA weights must be floating point.")
        sides[side] = tensor
    return modules
