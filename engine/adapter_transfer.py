"""An adapter's weights on their way to the engine-core process: one shared-memory buffer for all of them.

Pickled as they are, a rank-16 Llama-3-8B adapter is 448 tensors, each moved to a shared-memory file of its own and
passed as a descriptor (Connection.send), or saved through torch by value: 0.4-0.5 s an adapter on this repository's
2-core machine, against 0.1 s packed. On the H200, a server given 64 such adapters started in 72-78 s unpacked and
54 s packed (30-36 s with the engine on a thread). The engine copies the weights into its host rows anyway.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from adapters_registry import LoadedAdapter, LoRAModuleWeights


@dataclass
class PackedModule:
    name: str
    a_shape: torch.Size
    b_shape: torch.Size
    offset: int  # where lora_a starts in the buffer; lora_b follows it
    rank: int
    scaling: float


@dataclass
class PackedAdapter:
    adapter: LoadedAdapter  # without its modules' weights
    modules: list[PackedModule]
    buffer: torch.Tensor  # every module's lora_a then lora_b, flattened, in shared memory


def pack_adapter(adapter: LoadedAdapter) -> PackedAdapter:
    modules, sides, offset = [], [], 0
    for name, weights in adapter.modules.items():
        modules.append(PackedModule(name, weights.lora_a.shape, weights.lora_b.shape, offset, weights.rank,
                                    weights.scaling))
        sides += [weights.lora_a.reshape(-1), weights.lora_b.reshape(-1)]
        offset += weights.lora_a.numel() + weights.lora_b.numel()
    buffer = torch.empty(offset, dtype=sides[0].dtype if sides else torch.float32).share_memory_()
    if sides:
        torch.cat(sides, out=buffer)
    return PackedAdapter(dataclasses.replace(adapter, modules={}), modules, buffer)


def unpack_adapter(packed: PackedAdapter) -> LoadedAdapter:
    """The adapter again, its weights views of the buffer."""
    modules = {}
    for module in packed.modules:
        a_end = module.offset + module.a_shape.numel()
        modules[module.name] = LoRAModuleWeights(
            packed.buffer[module.offset:a_end].view(module.a_shape),
            packed.buffer[a_end:a_end + module.b_shape.numel()].view(module.b_shape), module.rank, module.scaling)
    return dataclasses.replace(packed.adapter, modules=modules)
