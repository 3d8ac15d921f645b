"""One rank's shard of the model: the stock modules built at shard sizes, plus the layers that talk.

Column-parallel projections need no communication, so they stay plain `LoRALinear`s holding their
slice. Row-parallel projections sum their partial products (and their partial LoRA shrinks) across
ranks; the embedding sums its partial lookups; the lm_head gathers its logit columns.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

import kernels

from ..model import LlamaForCausalLM, LoRALinear
from ..model_loader import iter_safetensors
from ..step_input import LoRAStep
from .group import TensorParallelGroup
from .sharding import full_module_shapes, shard_config, shard_weights


class RowParallelLoRALinear(LoRALinear):
    """Input columns split across ranks: `y = allreduce(x_r W_r^T) + b + expand(allreduce(shrink(x_r, A_r)), B)`.

    A holds this rank's input columns and B is whole, so the summed shrink is the full `x A^T` and the
    delta is added once, after the base product is reduced.
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, names: list[str], consumer: str,
                 group: TensorParallelGroup):
        super().__init__(in_features, out_sizes, bias, names, consumer)
        self.group = group

    def forward(self, x: torch.Tensor, lora: LoRAStep | None) -> tuple[torch.Tensor, None]:
        """The complete output (the delta is added here, after the reduction, whatever the step folds)."""
        y = self.group.all_reduce(nn.functional.linear(x, self.weight))
        if self.bias is not None:
            y = y + self.bias
        if lora is not None and self.lora_a is not None:
            lora_a, lora_b = self.slot_stacks(lora.rank_width)
            # contiguous for the collective (the Triton shrink returns h as a view of row-padded slices)
            h = self.group.all_reduce(kernels.lora_shrink_slices(x, lora_a, lora.meta).contiguous())
            kernels.lora_expand_slices(y, h, lora_b, lora.meta)
        return y, None


class VocabParallelEmbedding(nn.Module):
    """Rank r holds vocabulary rows [r * rows, (r + 1) * rows); other ids look up zeros, summed over ranks."""

    def __init__(self, weight: nn.Parameter, group: TensorParallelGroup):
        super().__init__()
        self.weight = weight
        self.group = group
        self.start = group.rank * weight.shape[0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)


class ShardedLlamaForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` at one rank's sizes; forward and compute_logits are collectives over the group."""

    def __init__(self, hf_config, max_positions: int, group: TensorParallelGroup):
        super().__init__(shard_config(hf_config, group.size), max_positions)
        self.group = group
        self.vocab_size = hf_config.vocab_size
        for layer in self.layers:
            layer.self_attn.o_proj = _row_parallel(layer.self_attn.o_proj, group)
            layer.mlp.down_proj = _row_parallel(layer.mlp.down_proj, group)
        self.embed_tokens = VocabParallelEmbedding(self.embed_tokens.weight, group)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rank 0's hidden rows, broadcast, times each rank's lm_head rows, gathered: the full logits."""
        hidden = self.group.broadcast(hidden.to(self.embed_tokens.weight.dtype).contiguous())
        return self.group.all_gather(super().compute_logits(hidden))[:, :self.vocab_size]

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """The unsharded shapes: adapters are validated against the model, not against one shard."""
        return full_module_shapes(super().module_shapes(), self.group.size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(shard_weights(weights, self.group.rank, self.group.size))


def _row_parallel(linear: LoRALinear, group: TensorParallelGroup) -> RowParallelLoRALinear:
    return RowParallelLoRALinear(linear.in_features, linear.out_sizes, linear.bias is not None, linear.names,
                                 linear.consumer, group)


def build_shard(model_cls: type[ShardedLlamaForCausalLM], hf_config, model_dir: Path, *, load_format: str,
                max_positions: int, group: TensorParallelGroup, dtype: torch.dtype,
                seed: int) -> ShardedLlamaForCausalLM:
    """Construct this rank's shard on its device and fill it from the checkpoint (or randomly, for "dummy")."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(group.device):
            model = model_cls(hf_config, max_positions, group)
    finally:
        torch.set_default_dtype(previous)
    if load_format == "dummy":
        model.init_dummy_weights(seed + group.rank)
    else:
        model.load_weights(iter_safetensors(model_dir))
    return model.eval()
