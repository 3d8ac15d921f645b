"""Where each projection's LoRA A and B live inside one adapter slot.

A slot is one row of a [slots, numel] buffer holding every projection's A [max_rank, in] and
B [out, max_rank] side by side. The device slots and the host copies share this layout, so loading
an adapter into a slot is a single host-to-device copy, and a host copy is written once, by a reader
thread or process, in the form the kernels read. The kernels read a slot's A rows up to its adapter's rank and
its B columns up to that rank rounded up to whole vectors (`lora_triton.rank_columns`), so the zero padding
`write` leaves past the rank is what they read there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters_registry import LoadedAdapter


@dataclass
class SlotRanks:
    """Each adapter slot's rank: on the device, where the LoRA kernels read it to skip a slot's padding, and on
    the host, where a decode step's graph is chosen by its adapters' largest rank (`lora_tuning.rank_width`)."""

    on_device: torch.Tensor  # [slots] int32, written in stream order with the slots' weights
    on_host: list[int]
    max_rank: int  # the slots' width

    @classmethod
    def zeros(cls, num_slots: int, max_rank: int, device: torch.device) -> SlotRanks:
        return cls(torch.zeros(num_slots, dtype=torch.int32, device=device), [0] * num_slots, max_rank)

    @property
    def num_slots(self) -> int:
        return len(self.on_host)

    def largest(self, lora_slots: list[int]) -> int:
        """The largest rank among these slots (-1: none; 0 when no slot is used)."""
        host = self.on_host
        return max((host[slot] for slot in set(lora_slots) if slot >= 0), default=0)


@dataclass(frozen=True)
class ProjectionRegion:
    module: str  # full module name, as in an adapter ("model.layers.0.self_attn.q_proj")
    a_offset: int
    b_offset: int
    in_features: int
    out_features: int


class SlotLayout:
    def __init__(self, lora_layers: dict, max_rank: int):
        """lora_layers: the model's `LoRALinear`s by name (`model.lora_layers()`). Only their shapes are
        kept, so a layout can travel to a reader process."""
        self.max_rank = max_rank
        self.regions: list[list[ProjectionRegion]] = []  # per layer, one region per slice
        offset = 0
        for prefix, linear in lora_layers.items():
            parent = prefix.rsplit(".", 1)[0]
            slices = []
            for name, out_features in zip(linear.names, linear.out_sizes):
                a_size, b_size = max_rank * linear.in_features, out_features * max_rank
                slices.append(ProjectionRegion(f"{parent}.{name}", offset, offset + a_size, linear.in_features,
                                               out_features))
                offset += a_size + b_size
            self.regions.append(slices)
        self.numel = offset

    def bind(self, slots: torch.Tensor, lora_layers: dict) -> None:
        """Point every layer's `lora_a`/`lora_b` stacks at their regions of `slots` [S, numel]."""
        num_slots, r = slots.shape[0], self.max_rank
        for linear, slices in zip(lora_layers.values(), self.regions):
            linear.lora_a = [slots[:, p.a_offset:p.a_offset + r * p.in_features].view(num_slots, r, p.in_features)
                             for p in slices]
            linear.lora_b = [slots[:, p.b_offset:p.b_offset + p.out_features * r].view(num_slots, p.out_features, r)
                             for p in slices]

    def write(self, adapter: LoadedAdapter, row: torch.Tensor) -> int:
        """Lay an adapter out in one slot row [numel]: its A and B (converted to the row's dtype), zeros
        past its rank and for projections it does not target. Returns the row's rank: its largest module
        rank, past which every projection's A rows and B columns are zero (the kernels skip them)."""
        r_max = self.max_rank
        rank = 0
        for slices in self.regions:
            for p in slices:
                a = row[p.a_offset:p.a_offset + r_max * p.in_features].view(r_max, p.in_features)
                b = row[p.b_offset:p.b_offset + p.out_features * r_max].view(p.out_features, r_max)
                weights = adapter.modules.get(p.module)
                if weights is None:
                    a.zero_()
                    b.zero_()
                    continue
                r = weights.rank
                rank = max(rank, r)
                a[:r].copy_(weights.lora_a)
                b[:, :r].copy_(weights.lora_b)
                if r < r_max:
                    a[r:].zero_()
                    b[:, r:].zero_()
        return rank
