"""`loraserve serve` settings from four layers: flags > environment > config.yaml > defaults.

One table of options drives all layers, so a flag, its environment variable (`LORASERVE_<NAME>` plus the
vLLM/TGI spellings users already export) and its config-file key (the flag without dashes) never drift.
"""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from adapters_registry import AdapterSpec, parse_lora_adapters, parse_lora_modules
from engine.config import CUDAGRAPH_MODES
from engine.core_client import ENGINE_CORES
from engine.scheduler import ADMISSION_ORDERS

DEFAULT_CONFIG_NAME = "config.yaml"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass
class ServeConfig:
    """Everything `loraserve serve` needs; adapter specs already carry resolved paths."""

    model: str | None = None  # None: the embedded default (SmolLM2-135M-Instruct)
    revision: str | None = None
    tokenizer: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: list[str] = field(default_factory=list)
    api_key: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.85
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    cudagraph_mode: str = "full_and_piecewise"
    async_scheduling: bool = True
    engine_core: str = "auto"
    seed: int = 0
    enable_lora: bool = False
    lora_modules: list[AdapterSpec] = field(default_factory=list)
    lora_adapters: list[AdapterSpec] = field(default_factory=list)
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    adapter_reader: str = "auto"
    admission_order: str = "fcfs"
    allow_runtime_lora_updating: bool = False
    lora_allowed_dirs: list[str] = field(default_factory=list)
    allow_pickle_adapters: bool = False
    chat_template: str | None = None  # a file path or the template text
    max_logprobs: int = 20
    log_level: str = "info"
    config_file: str | None = None  # the config file that was read, if any

    def adapter_specs(self) -> list[AdapterSpec]:
        """vLLM-style then TGI-style adapters; a name given twice for the same place counts once."""
        specs: dict[str, AdapterSpec] = {}
        for spec in [*self.lora_modules, *self.lora_adapters]:
            other = specs.setdefault(spec.name, spec)
            if _location(other) != _location(spec):
                raise ConfigError(f"Adapter {spec.name!r} is given twice, as {other.path} and {spec.path}")
        return list(specs.values())


def _location(spec: AdapterSpec) -> tuple[str, str | None]:
    path = Path(spec.path).expanduser()
    return (str(path.resolve()) if path.exists() else spec.path), spec.revision


@dataclass(frozen=True)
class _Option:
    name: str  # ServeConfig field; flag is --name-with-dashes, env LORASERVE_NAME, config key `name`
    help: str
    kind: str = "str"  # str | int | float | bool | list
    env: tuple[str, ...] = ()  # extra environment names, as other servers spell them
    choices: tuple[str, ...] | None = None
    path: bool = False  # a relative path in the config file is relative to the file

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env_names(self) -> tuple[str, ...]:
        return ("LORASERVE_" + self.name.upper(), *self.env)


OPTIONS: tuple[_Option, ...] = (
    _Option("model", "Model to serve: a Hugging Face directory or Hub id, or a .gguf file "
            "(default: the embedded SmolLM2-135M-Instruct). Also the positional MODEL.", env=("MODEL_ID",), path=True),
    _Option("revision", "Hub revision of the model."),
    _Option("tokenizer", "Tokenizer directory or Hub id, if not the model's.", path=True),
    _Option("host", "Address to listen on (default 127.0.0.1)."),
    _Option("port", "Port to listen on (default 8000).", "int"),
    _Option("served_model_name", "Name(s) clients use for the base model in `model`, each listed by /v1/models "
            "(default: the model path or id).", "list"),
    _Option("api_key", "Require `Authorization: Bearer KEY` on /v1/* and the TGI routes.", env=("VLLM_API_KEY",)),
    _Option("dtype", "Weights and activations dtype (default auto: bfloat16 on GPU, float32 on CPU).",
            choices=("auto", "float32", "float", "bfloat16", "float16", "half")),
    _Option("load_format", "auto: the model's weights; dummy: random weights at its shapes, for benchmarks "
            "(vLLM's --load-format dummy; default auto).", choices=("auto", "dummy")),
    _Option("device", "cpu, cuda, cuda:N or auto (default auto)."),
    _Option("max_model_len", "Context window in tokens (default: the model's).", "int"),
    _Option("max_num_seqs", "Most requests in one running batch (default 64).", "int"),
    _Option("max_num_batched_tokens", "Most tokens in one forward pass (default: chosen by the engine).", "int"),
    _Option("block_size", "Tokens per KV-cache block (default 16).", "int"),
    _Option("gpu_memory_utilization", "Fraction of GPU memory the engine may use (default 0.85).", "float"),
    _Option("tensor_parallel_size", "Shard the model over this many GPUs, one worker process each (default 1).",
            "int", env=("NUM_SHARD",)),
    _Option("enforce_eager", "On CUDA, run every step eagerly instead of replaying CUDA graphs.", "bool"),
    _Option("cudagraph_mode", "On CUDA: full_and_piecewise replays decode steps whole and mixed steps piece by "
            "piece, with attention between the pieces; full_decode_only runs mixed steps eagerly "
            "(default full_and_piecewise).", choices=CUDAGRAPH_MODES),
    _Option("async_scheduling", "On CUDA with graphs, launch the next step before the previous step's tokens "
            "are read back (they, their top logprobs and prompt logprobs are computed on the device whatever the "
            "sampling parameters) (default on; --no-async-scheduling turns it off).", "bool"),
    _Option("engine_core", "Where the engine steps: process (a process of its own, as vLLM's engine core, so the "
            "HTTP layer's per-token work never holds up its next step) or thread (a thread of the server's "
            "process). Default auto: process on one GPU, thread otherwise.", choices=ENGINE_CORES),
    _Option("seed", "Engine random seed (default 0).", "int"),
    _Option("enable_lora", "Serve LoRA adapters (switched on by itself when adapters are given).", "bool"),
    _Option("lora_modules", "vLLM-style adapters: NAME=PATH or JSON {\"name\",\"path\",\"base_model_name\"}; "
            "several may follow the flag.", "list", path=True),
    _Option("lora_adapters", "TGI-style adapters, comma-separated: ID, ID@REV, NAME=PATH, NAME=PATH@REV.",
            env=("LORA_ADAPTERS",), path=True),
    _Option("max_loras", "Distinct adapters in one batch: the adapter slots on the device (default 1).", "int"),
    _Option("max_lora_rank", "Largest adapter rank accepted (default 16).", "int"),
    _Option("max_cpu_loras", "Adapters kept in host memory (default: max_loras; smaller is an error).", "int"),
    _Option("adapter_reader", "Where adapter weights are read from disk in the background: child processes "
            "or threads (default auto: processes on a GPU, threads on the CPU, with tensor parallelism, or when "
            "/dev/shm has no room for the host copies).",
            choices=("auto", "process", "threads")),
    _Option("admission_order", "Order waiting requests are admitted in: fcfs, or balanced (adapter by adapter, "
            "each free adapter slot to the adapter that fills the batch best; default fcfs).",
            choices=ADMISSION_ORDERS),
    _Option("allow_runtime_lora_updating", "Enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter.",
            "bool", env=("VLLM_ALLOW_RUNTIME_LORA_UPDATING",)),
    _Option("lora_allowed_dirs", "Directories runtime-loaded adapters must lie under (resolved; no `..` or "
            "symlink escape). Empty: any local path.", "list", path=True),
    _Option("allow_pickle_adapters", "Also load adapter_model.bin (pickle) files; off by default.", "bool"),
    _Option("chat_template", "Chat template file, or the Jinja template text itself, overriding the tokenizer's.",
            path=True),
    _Option("max_logprobs", "Largest `logprobs` / `top_logprobs` a request may ask for (default 20).", "int"),
    _Option("log_level", "Log level (default info).", choices=("critical", "error", "warning", "info", "debug")),
)
_BY_NAME = {option.name: option for option in OPTIONS}


class ConfigError(ValueError):
    """A setting that cannot be used; the message names where it came from."""


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option as a flag; unset flags stay out of the namespace so lower layers show through."""
    parser.add_argument("model_arg", nargs="?", metavar="MODEL", default=argparse.SUPPRESS,
                        help="Model to serve (same as --model).")
    parser.add_argument("--config", default=argparse.SUPPRESS, metavar="FILE",
                        help=f"YAML file of settings (keys are the flag names; env LORASERVE_CONFIG). Without it, "
                             f"./{DEFAULT_CONFIG_NAME} is read when no model is given.")
    for option in OPTIONS:
        env_note = " [env: " + ", ".join(option.env_names) + "]"
        kwargs: dict = {"default": argparse.SUPPRESS, "help": option.help + env_note, "dest": option.name}
        if option.kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif option.kind == "list":
            kwargs["nargs"] = "+"
        else:
            kwargs["type"] = {"str": str, "int": int, "float": float}[option.kind]
        if option.choices:
            kwargs["choices"] = option.choices
            kwargs["type"] = str.lower
        parser.add_argument(option.flag, **kwargs)


def _from_env_text(option: _Option, text: str, source: str) -> object:
    if option.kind == "bool":
        lowered = text.strip().lower()
        if lowered not in _TRUE | _FALSE:
            raise ConfigError(f"{source}: expected true or false, got {text!r}")
        return lowered in _TRUE
    if option.kind == "list":
        stripped = text.strip()
        if stripped.startswith(("[", "{")):  # a JSON list, or one JSON object (whose commas are its own)
            kind = "list" if stripped.startswith("[") else "object"
            try:
                items = json.loads(stripped)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{source}: not a valid JSON {kind} ({exc.msg})") from None
            items = items if isinstance(items, list) else [items]
            return [json.dumps(item) if isinstance(item, dict) else str(item) for item in items]
        return [item.strip() for item in stripped.split(",") if item.strip()]
    return _convert(option, text, source)


def _convert(option: _Option, value: object, source: str) -> object:
    try:
        if option.name == "lora_adapters" and isinstance(value, list):
            return ",".join(str(item) for item in value)
        not_of_kind = {"int": (bool, list, dict, float), "float": (bool, list, dict), "str": (bool, list, dict)}
        if isinstance(value, not_of_kind.get(option.kind, ())):
            raise TypeError  # YAML's other types are not this kind, whatever int() or str() make of them
        if option.kind == "int":
            return int(value)
        if option.kind == "float":
            return float(value)
        if option.kind == "bool":
            if isinstance(value, bool):
                return value
            return _from_env_text(option, str(value), source)
        if option.kind == "list":
            items = value if isinstance(value, list) else [value]
            return [json.dumps(item) if isinstance(item, dict) else str(item) for item in items]
        text = str(value).lower() if option.choices else str(value)  # choices ignore case: INFO, as logging spells it
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: expected {option.kind}, got {value!r}") from None
    if option.choices and text not in option.choices:
        raise ConfigError(f"{source}: {text!r} is not one of {', '.join(option.choices)}")
    return text


def _env_layer(environ: Mapping[str, str]) -> dict[str, object]:
    layer = {}
    for option in OPTIONS:
        for name in option.env_names:
            if name in environ:
                layer[option.name] = _from_env_text(option, environ[name], f"environment variable {name}")
                break
    return layer


def _file_layer(path: Path) -> dict[str, object]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of setting names to values")
    layer = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in _BY_NAME:
            raise ConfigError(f"config file {path}: unknown setting {key!r}")
        if value is not None:
            layer[name] = _convert(_BY_NAME[name], value, f"config file {path}, setting {key!r}")
    return layer


def _relative_to(base: Path, value: str) -> str:
    """A relative path that exists under `base` becomes that path; anything else (a Hub id) is kept."""
    candidate = Path(value).expanduser()
    if candidate.is_absolute():
        return value
    return str((base / candidate).resolve()) if (base / candidate).exists() else value


def _rebase_paths(layer: dict[str, object], base: Path) -> dict[str, object]:
    """Make a config file's relative paths relative to the file itself."""
    rebased = dict(layer)
    if "model" in rebased:
        rebased["model"] = _relative_to(base, rebased["model"])
    if "tokenizer" in rebased:
        rebased["tokenizer"] = _relative_to(base, rebased["tokenizer"])
    if "chat_template" in rebased and "{" not in rebased["chat_template"]:
        rebased["chat_template"] = _relative_to(base, rebased["chat_template"])
    if "lora_allowed_dirs" in rebased:
        rebased["lora_allowed_dirs"] = [str((base / Path(d).expanduser()).resolve()) for d in rebased["lora_allowed_dirs"]]
    for key, parse in (("lora_modules", parse_lora_modules), ("lora_adapters", parse_lora_adapters)):
        if key in rebased:
            rebased[key] = [_rebase_spec(spec, base) for spec in _parse_specs(key, parse, rebased[key])]
    return rebased


def _rebase_spec(spec: AdapterSpec, base: Path) -> AdapterSpec:
    return AdapterSpec(spec.name, _relative_to(base, spec.path), spec.revision, spec.base_model_name)


def _parse_specs(key: str, parse, value) -> list[AdapterSpec]:
    try:
        return parse(value)
    except ValueError as exc:
        raise ConfigError(f"--{key.replace('_', '-')}: {exc}") from None


def _config_path(flags: dict, env_layer: dict, environ: Mapping[str, str], cwd: Path) -> Path | None:
    """An explicit --config / LORASERVE_CONFIG, else ./config.yaml when no model was named."""
    explicit = flags.get("config") or environ.get("LORASERVE_CONFIG")
    if explicit:
        path = Path(explicit).expanduser()
        path = path if path.is_absolute() else cwd / path
        if not path.is_file():
            raise ConfigError(f"config file {explicit} does not exist")
        return path
    default = cwd / DEFAULT_CONFIG_NAME
    if "model" not in flags and "model" not in env_layer and default.is_file():
        return default
    return None


def resolve_config(namespace: argparse.Namespace, environ: Mapping[str, str], cwd: Path) -> ServeConfig:
    """Merge the layers: flags > environment > config file > defaults."""
    flags = dict(vars(namespace))
    flags.pop("command", None)
    positional = flags.pop("model_arg", None)
    if positional is not None:
        if "model" in flags and flags["model"] != positional:
            raise ConfigError(f"the model is given twice: {positional!r} and --model {flags['model']!r}")
        flags["model"] = positional
    env_layer = _env_layer(environ)
    config_path = _config_path(flags, env_layer, environ, cwd)
    file_layer = _rebase_paths(_file_layer(config_path), config_path.parent) if config_path else {}
    flags.pop("config", None)
    merged: dict[str, object] = {}
    for layer in (file_layer, _parse_layer_specs(env_layer), _parse_layer_specs(flags)):
        merged.update(layer)
    config = ServeConfig(**merged)
    config.config_file = str(config_path) if config_path else None
    if not 0 <= config.port <= 65535:
        raise ConfigError(f"port must be from 0 to 65535, got {config.port}")
    if config.max_logprobs < 0:
        raise ConfigError(f"max_logprobs must be at least 0, got {config.max_logprobs}")
    return config


def _parse_layer_specs(layer: dict[str, object]) -> dict[str, object]:
    parsed = dict(layer)
    if "lora_modules" in parsed:
        parsed["lora_modules"] = _parse_specs("lora_modules", parse_lora_modules, parsed["lora_modules"])
    if "lora_adapters" in parsed:
        parsed["lora_adapters"] = _parse_specs("lora_adapters", parse_lora_adapters, parsed["lora_adapters"])
    return parsed


def serve_config_from_args(
    argv: Sequence[str], environ: Mapping[str, str] | None = None, cwd: Path | None = None
) -> ServeConfig:
    """`loraserve serve` arguments (without the `serve`) → a ServeConfig; ConfigError on a bad setting."""
    parser = argparse.ArgumentParser(prog="loraserve serve")
    add_serve_arguments(parser)
    return resolve_config(parser.parse_args(list(argv)), os.environ if environ is None else environ, cwd or Path.cwd())

