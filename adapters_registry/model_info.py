"""What an adapter is validated against: the served model's architecture and LoRA-capable modules."""
from __future__ import annotations

from dataclasses import dataclass

LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class ModelInfo:
    """The base model as adapters see it; the engine builds it from its own model.

    module_shapes maps each LoRA-capable projection's full name
    (e.g. "model.layers.0.self_attn.q_proj") to (out_features, in_features).
    """

    architecture: str
    model_type: str
    name_or_path: str | None
    module_shapes: dict[str, tuple[int, int]]
    max_lora_rank: int
