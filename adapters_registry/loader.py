"""Load one peft LoRA adapter directory into CPU tensors (float32 unless asked otherwise) with the
scaling folded into B."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .base_model import check_base_model
from .errors import AdapterError
from .model_info import ModelInfo
from .peft_config import ModulePlan, check_supported, plan_modules, read_adapter_config
from .weights import TensorHeader, group_lora_tensors, read_tensor_headers, read_tensors


@dataclass
class LoRAModuleWeights:
    """One module's adapter: delta(x) = (x @ lora_a.T) @ lora_b.T, scaling already in lora_b."""

    lora_a: torch.Tensor  # [rank, in_features], CPU, in the dtype asked for (float32 by default)
    lora_b: torch.Tensor  # [out_features, rank], CPU, same dtype, scaled
    rank: int
    scaling: float


@dataclass
class LoadedAdapter:
    """A validated adapter, keyed by full module name as in ModelInfo.module_shapes."""

    path: str
    config: dict
    rank: int
    target_modules: list[str]
    modules: dict[str, LoRAModuleWeights]
    nbytes: int


def _check_sides(module: str, plan: ModulePlan, sides: dict[str, torch.Tensor | TensorHeader],
                 shape: tuple[int, int]) -> None:
    if len(sides) < 2:
        missing = [f"lora_{side}" for side in "AB" if side not in sides]
        raise AdapterError(f"Adapter weights for {module} are missing {' and '.join(missing)}.")
    out_features, in_features = shape
    for side, want in (("A", (plan.rank, in_features)), ("B", (out_features, plan.rank))):
        got = sides[side].shape
        if got != want:
            raise AdapterError(f"Adapter weight lora_{side} for {module} has shape {list(got)}; expected {list(want)}.")


def _module_weights(plan: ModulePlan, sides: dict[str, torch.Tensor], dtype: torch.dtype) -> LoRAModuleWeights:
    """B is scaled before it is converted, and in float32 unless its own dtype is already the one asked for,
    so a bf16 adapter loaded as bf16 gets the bits a float32 load rounded to bf16 would have."""
    b = sides["B"]
    lora_a = sides["A"].to(dtype).contiguous()
    lora_b = ((b if b.dtype == dtype else b.to(torch.float32)) * plan.scaling).to(dtype).contiguous()
    return LoRAModuleWeights(lora_a=lora_a, lora_b=lora_b, rank=plan.rank, scaling=plan.scaling)


def load_adapter(path: str | Path, model: ModelInfo, *, allow_pickle: bool = False,
                 dtype: torch.dtype = torch.float32) -> LoadedAdapter:
    """Validate the adapter in a local directory against the model and load its weights.

    dtype: of the loaded A and B. A server loads in its slots' dtype: a bf16 adapter then skips a
    float32 copy of every weight, which made most of a read's time.

    Our projections are nn.Linear, for which peft ignores fan_in_fan_out: A is [r, in] and B is
    [out, r] either way, so the flag needs no transpose here.
    """
    directory = Path(path)
    config, plans, grouped = _validated(directory, model, read_tensors, allow_pickle)
    modules = {module: _module_weights(plan, grouped[module], dtype) for module, plan in plans.items()}
    return LoadedAdapter(
        path=str(directory),
        config=config,
        rank=max(weights.rank for weights in modules.values()),
        target_modules=sorted({module.rsplit(".", 1)[-1] for module in modules}),
        modules=modules,
        nbytes=sum(w.lora_a.nbytes + w.lora_b.nbytes for w in modules.values()),
    )


def check_adapter(path: str | Path, model: ModelInfo, *, allow_pickle: bool = False) -> None:
    """Every check `load_adapter` makes, from the config and the weight file's header alone: cheap
    enough to run when a request arrives, so a bad adapter fails that request before any weights are read."""
    _validated(Path(path), model, read_tensor_headers, allow_pickle)


def _validated(directory: Path, model: ModelInfo, read, allow_pickle: bool
               ) -> tuple[dict, dict[str, ModulePlan], dict[str, dict[str, torch.Tensor | TensorHeader]]]:
    """The adapter's config, its per-module plans and its A/B tensors (or their headers) by module,
    after every check."""
    config = read_adapter_config(directory)
    check_supported(config)
    check_base_model(config, model, str(directory))
    plans = plan_modules(config, model)
    grouped = group_lora_tensors(read(directory, allow_pickle=allow_pickle))
    for module in grouped:
        if module not in plans:
            if module in model.module_shapes:
                raise AdapterError(f"Adapter weights include {module}, which is not targeted by adapter_config.json.")
            raise AdapterError(f"Adapter weights include {module}, which has no LoRA path in this model.")
    for module, plan in plans.items():
        _check_sides(module, plan, grouped.get(module, {}), model.module_shapes[module])
    return config, plans, grouped
