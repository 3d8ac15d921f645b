"""Compute kernels: multi-LoRA shrink/expand (Triton on CUDA, torch reference elsewhere)."""

from kernels.lora import lora_expand, lora_expand_slices, lora_shrink, lora_shrink_slices
from kernels.lora_delta import LoRADelta
from kernels.lora_metadata import LoRAMetadata, prepare_lora_metadata

__all__ = [
    "LoRADelta",
    "LoRAMetadata",
    "lora_expand",
    "lora_expand_slices",
    "lora_shrink",
    "lora_shrink_slices",
    "prepare_lora_metadata",
]
