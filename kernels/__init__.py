"""Compute kernels: Triton on CUDA, a torch reference elsewhere.

The package exports the multi-LoRA entry points (shrink, expand, their metadata) and `LoRADelta`, an expand
left for the fused op that consumes the projection. Attention (`kernels.attention`), the fused per-token ops
(`kernels.fused`) and the greedy choice (`kernels.greedy`) are imported from their modules.
"""

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
