"""Shared fixtures: a tiny Llama, its ModelInfo, and a valid peft adapter to copy and break."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from adapters_registry import LORA_PROJECTIONS, ModelInfo
from tests.tiny_models import make_peft_adapter, make_tiny_model


def model_info_for(base_dir: Path, max_lora_rank: int = 16) -> ModelInfo:
    """ModelInfo read off the transformers model itself, as the engine reads it off its own."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    shapes = {
        name: (module.out_features, module.in_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LORA_PROJECTIONS
    }
    return ModelInfo(
        architecture=model.config.architectures[0],
        model_type=model.config.model_type,
        name_or_path=str(base_dir),
        module_shapes=shapes,
        max_lora_rank=max_lora_rank,
    )


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def model_info(base_dir) -> ModelInfo:
    return model_info_for(base_dir)


@pytest.fixture(scope="session")
def good_adapter(base_dir, tmp_path_factory) -> Path:
    """A rank-8 adapter on all seven projections."""
    return make_peft_adapter(base_dir, tmp_path_factory.mktemp("good-adapter"))


@pytest.fixture
def adapter_copy(good_adapter, tmp_path) -> Callable[..., Path]:
    """Copy the good adapter and override keys of its adapter_config.json."""

    def make(**overrides) -> Path:
        out = tmp_path / "adapter"
        shutil.copytree(good_adapter, out)
        config_path = out / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config.update(overrides)
        config_path.write_text(json.dumps(config))
        return out

    return make
