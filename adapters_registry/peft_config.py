"""Validate a peft `adapter_config.json` and decide, per base module, the rank and scaling peft would use."""
from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import AdapterError
from .model_info import LORA_PROJECTIONS, ModelInfo

CONFIG_NAME = "adapter_config.json"

# Modules a user may target that have no LoRA path in our model (full names as in transformers' Llama family).
NO_LORA_PATH_MODULES = ("model.embed_tokens", "lm_head")

# peft features that change the forward pass in ways plain LoRA A/B weights cannot express.
_UNSUPPORTED_FEATURES = (
    ("layer_replication", "layer replication"),
    ("alora_invocation_tokens", "activated LoRA (aLoRA)"),
    ("trainable_token_indices", "trainable tokens"),
    ("target_parameters", "LoRA on parameters (target_parameters)"),
    ("use_qalora", "QA-LoRA"),
    ("use_bdlora", "block-diagonal LoRA (use_bdlora)"),
    ("velora_config", "VeLoRA"),
    ("monteclora_config", "MonteCLoRA"),
    ("arrow_config", "Arrow routing"),
    ("kasa_config", "KaSA"),
)


# peft initialisations that rewrite the base weights when an adapter is loaded (the trained A and B then apply to
# that residual), so the adapter does not fit a base model shared with others until peft converts it to plain LoRA.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq")


@dataclass(frozen=True)
class ModulePlan:
    """What peft would build for one base module: its rank, alpha and the scaling folded into B."""

    rank: int
    alpha: float
    scaling: float


def read_adapter_config(directory: Path) -> dict:
    """Read adapter_config.json; a missing, unreadable or non-JSON file is an AdapterError."""
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise AdapterError(f"No {CONFIG_NAME} in {directory}: not a peft adapter directory.")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise AdapterError(f"Cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path} must hold a JSON object.")
    return config


def check_supported(config: dict) -> None:
    """Refuse adapters that are not plain LoRA (DoRA, extra trained modules, biases, other peft methods)."""
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise AdapterError(
            f"Only LoRA adapters are supported: adapter_config.json has peft_type {peft_type!r}, not 'LORA'."
        )
    if config.get("use_dora"):
        raise AdapterError("DoRA adapters (use_dora: true) are not supported.")
    if config.get("modules_to_save"):
        raise AdapterError(
            f"Adapters with modules_to_save {config['modules_to_save']} are not supported: "
            "only LoRA A/B weights can be served on a shared base model."
        )
    bias = config.get("bias", "none")
    if bias != "none":
        raise AdapterError(f"Adapters with trained biases (bias: {bias!r}) are not supported; bias must be 'none'.")
    if config.get("lora_bias"):
        raise AdapterError("Adapters with a LoRA bias (lora_bias: true) are not supported.")
    for key, feature in _UNSUPPORTED_FEATURES:
        if config.get(key):
            raise AdapterError(f"Adapters using {feature} ({key}) are not supported.")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise AdapterError(
            f"Adapters initialised with init_lora_weights {init!r} change the base model's weights when loaded, "
            "so they cannot share it with other adapters. Convert the adapter to a plain LoRA first (peft's "
            "save_pretrained with path_initial_model_for_weight_conversion)."
        )


def _number(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AdapterError(f"adapter_config.json: {key} must be a number, got {value!r}.")
    return value


def _rank(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise AdapterError(f"adapter_config.json: {key} must be a positive integer, got {value!r}.")
    return value


def _pattern_value(patterns: dict, module: str, default):
    """peft's get_pattern_key: the first key `k` with `(.*\\.)?(k)$` matching the module name wins."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _layer_index_ok(config: dict, module: str) -> bool:
    """peft's layers_to_transform / layers_pattern filter (applied only to list target_modules)."""
    indexes = config.get("layers_to_transform")
    if indexes is None or indexes == []:
        return True
    patterns = config.get("layers_pattern")
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
    else:
        match = None
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module)
            if match is not None:
                break
    if match is None:
        return False
    index = int(match.group("idx"))
    return index == indexes if isinstance(indexes, int) else index in indexes


def _excluded(config: dict, module: str) -> bool:
    exclude = config.get("exclude_modules")
    if not exclude:
        return False
    if isinstance(exclude, str):
        return re.fullmatch(exclude, module) is not None
    return module in exclude or any(module.endswith(f".{key}") for key in exclude)


def _list_target_matches(entry: str, module: str) -> bool:
    return module == entry or module.endswith(f".{entry}")


def _listed(targets: list[str], config: dict, module: str) -> bool:
    """peft's list matching: an exact name always counts; a suffix match is subject to the layer filter."""
    if module in targets:
        return True
    return any(module.endswith(f".{t}") for t in targets) and _layer_index_ok(config, module)


# The adapter_config.json keys that decide which base modules an adapter targets.
_SELECTION_KEYS = ("target_modules", "layers_to_transform", "layers_pattern", "exclude_modules")


def targeted_modules(config: dict, model: ModelInfo) -> list[str]:
    """The base modules peft would wrap, in model order; targets without a LoRA path are refused.

    Worked out once per model and selection: matching every module name against the targets took a
    fifth of a Llama-3-8B adapter's check, and the adapters of one model mostly target alike."""
    selection = json.dumps([config.get(key) for key in _SELECTION_KEYS])
    return list(_targeted(tuple(model.module_shapes), selection))


@functools.lru_cache(maxsize=64)
def _targeted(names: tuple[str, ...], selection: str) -> tuple[str, ...]:
    """targeted_modules for module names and the selection keys' values as JSON (both hashable)."""
    config = dict(zip(_SELECTION_KEYS, json.loads(selection)))
    targets = config["target_modules"]
    supported = ", ".join(LORA_PROJECTIONS)
    if isinstance(targets, str):
        if targets.lower() == "all-linear":  # peft's spelling check ignores case
            matched = names
        else:
            regex = re.compile(targets)
            for module in NO_LORA_PATH_MODULES:
                if regex.fullmatch(module):
                    raise AdapterError(
                        f"target_modules {targets!r} matches {module}, which has no LoRA path in this model "
                        f"(supported: {supported})."
                    )
            matched = [m for m in names if regex.fullmatch(m)]
    elif isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        for entry in targets:  # one naming no module of the model at all is passed over, as peft does
            if any(_list_target_matches(entry, module) for module in NO_LORA_PATH_MODULES):
                raise AdapterError(
                    f"target module {entry!r} has no LoRA path in this model (supported: {supported})."
                )
        matched = [m for m in names if _listed(targets, config, m)]
    else:
        raise AdapterError(
            "adapter_config.json: target_modules must be a non-empty list of module names or a regex string, "
            f"got {targets!r}."
        )
    matched = [m for m in matched if not _excluded(config, m)]
    if not matched:
        raise AdapterError(
            f"target_modules {targets!r} matches no LoRA-capable module of this model (supported: {supported})."
        )
    return tuple(matched)


def _is_str_or_str_list(value: object) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


def _check_field_types(config: dict) -> None:
    """Refuse malformed selection fields up front so matching below never trips over them."""
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise AdapterError(f"adapter_config.json: {key} must be an object, got {config[key]!r}.")
    for key in ("layers_pattern", "exclude_modules"):
        if config.get(key) is not None and not _is_str_or_str_list(config[key]):
            raise AdapterError(
                f"adapter_config.json: {key} must be a string or a list of strings, got {config[key]!r}."
            )
    layers = config.get("layers_to_transform")
    is_int = isinstance(layers, int) and not isinstance(layers, bool)
    is_int_list = isinstance(layers, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in layers)
    if layers is not None and not (is_int or is_int_list):
        raise AdapterError(f"adapter_config.json: layers_to_transform must be an integer or a list, got {layers!r}.")


def plan_modules(config: dict, model: ModelInfo) -> dict[str, ModulePlan]:
    """Per targeted module, the rank and scaling peft would use (rank_pattern / alpha_pattern / rsLoRA)."""
    _check_field_types(config)
    try:
        plans = _plan(config, model)
    except re.error as exc:
        raise AdapterError(f"adapter_config.json has an invalid regex pattern {exc.pattern!r}: {exc}") from None
    max_rank = max(plan.rank for plan in plans.values())
    if max_rank > model.max_lora_rank:
        raise AdapterError(f"LoRA rank {max_rank} is greater than max_lora_rank {model.max_lora_rank}.")
    return plans


def _plan(config: dict, model: ModelInfo) -> dict[str, ModulePlan]:
    default_rank = _rank("r", config.get("r"))
    default_alpha = _number("lora_alpha", config.get("lora_alpha", 8))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora"))
    modules = targeted_modules(config, model)
    if not rank_pattern and not alpha_pattern:
        return dict.fromkeys(modules, _module_plan(default_rank, default_alpha, rslora))
    plans = {}
    for module in modules:
        rank = _rank(f"rank_pattern for {module}", _pattern_value(rank_pattern, module, default_rank))
        alpha = _number(f"alpha_pattern for {module}", _pattern_value(alpha_pattern, module, default_alpha))
        plans[module] = _module_plan(rank, alpha, rslora)
    return plans


@functools.lru_cache(maxsize=256, typed=True)
def _module_plan(rank: int, alpha: float, rslora: bool) -> ModulePlan:
    """One plan shared by every module with this rank and alpha (most adapters have one of each)."""
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    return ModulePlan(rank=rank, alpha=alpha, scaling=scaling)
