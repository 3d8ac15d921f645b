"""Megatron-style slicing of a Llama-family model and its LoRA adapters across tensor-parallel ranks.

Column-parallel projections (q/k/v by heads, gate/up evenly) keep their output rows for this rank;
row-parallel ones (o, down) keep their input columns and are summed across ranks after the matmul.
The embedding and lm_head are split by vocabulary rows, padded so every rank holds the same count.
Adapters follow their base weights: a column-parallel layer keeps all of A and its rows of B, a
row-parallel layer keeps its columns of A and all of B.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch

from adapters_registry import LoadedAdapter

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")


def head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def check_tensor_parallel_size(hf_config, size: int) -> None:
    """Refuse a size that would split a head or leave ranks with unequal shares."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    for what, value in (("attention heads", hf_config.num_attention_heads),
                        ("key/value heads", hf_config.num_key_value_heads),
                        ("intermediate size", hf_config.intermediate_size)):
        if value % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the model's {what} ({value})")


def padded_vocab_shard(vocab_size: int, size: int) -> int:
    """Vocabulary rows per rank: the vocabulary rounded up to a multiple of the rank count, divided."""
    return -(-vocab_size // size)


def shard_config(hf_config, size: int):
    """The config one rank's modules are built from: its heads, its MLP width, its vocabulary rows."""
    check_tensor_parallel_size(hf_config, size)
    config = copy.deepcopy(hf_config)
    config.head_dim = head_dim(hf_config)
    config.num_attention_heads = hf_config.num_attention_heads // size
    config.num_key_value_heads = hf_config.num_key_value_heads // size
    config.intermediate_size = hf_config.intermediate_size // size
    config.vocab_size = padded_vocab_shard(hf_config.vocab_size, size)
    return config


def shard_tensor(name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's part of one checkpoint tensor (HF name, e.g. `model.layers.0.self_attn.q_proj.weight`)."""
    module, kind = name.rsplit(".", 2)[-2:]
    if module in VOCAB_PARALLEL:
        rows = padded_vocab_shard(tensor.shape[0], size)
        padded = torch.nn.functional.pad(tensor, (0, 0, 0, rows * size - tensor.shape[0]))
        return padded[rank * rows:(rank + 1) * rows]
    if module in COLUMN_PARALLEL:
        return tensor.chunk(size, 0)[rank]
    if module in ROW_PARALLEL and kind == "weight":
        return tensor.chunk(size, 1)[rank]
    return tensor


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], rank: int,
                  size: int) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield name, shard_tensor(name, tensor, rank, size)


def shard_adapter(adapter: LoadedAdapter, rank: int, size: int) -> LoadedAdapter:
    """This rank's part of an adapter, sliced like the base weights it adds to."""
    modules = {}
    for name, weights in adapter.modules.items():
        kind = name.rsplit(".", 1)[-1]
        if kind in COLUMN_PARALLEL:
            modules[name] = replace(weights, lora_b=weights.lora_b.chunk(size, 0)[rank].contiguous())
        elif kind in ROW_PARALLEL:
            modules[name] = replace(weights, lora_a=weights.lora_a.chunk(size, 1)[rank].contiguous())
        else:
            raise ValueError(f"No tensor-parallel layout for LoRA module {name!r}")
    nbytes = sum(w.lora_a.nbytes + w.lora_b.nbytes for w in modules.values())
    return replace(adapter, modules=modules, nbytes=nbytes)


def full_module_shapes(shard_shapes: dict[str, tuple[int, int]], size: int) -> dict[str, tuple[int, int]]:
    """The unsharded (out, in) of every projection, from one rank's shapes: what adapters are checked against."""
    shapes = {}
    for name, (out_features, in_features) in shard_shapes.items():
        if name.rsplit(".", 1)[-1] in COLUMN_PARALLEL:
            shapes[name] = (out_features * size, in_features)
        else:
            shapes[name] = (out_features, in_features * size)
    return shapes
