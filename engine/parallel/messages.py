"""What the driver tells the workers, in the order it happens; every message is small and picklable.

Tensors travel as numpy arrays (plain pickling, no shared-memory handles), and are rebuilt on each
worker's own device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..lora_request import LoRARequest
from ..step_input import AttentionMetadata, LoRAStep, StepInput


@dataclass
class Step:
    """One forward pass: StepInput's contents, plus the KV cache's extent so a worker can size its shard."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    context_lens: np.ndarray
    query_lens: list[int]
    num_decode: int
    lora_slots: np.ndarray | None  # per token, -1 = base model; None when no token uses an adapter
    num_lora_slots: int
    # the fused ops the driver's step folds the LoRA expands into (LoRAStep.fold_into): every rank folds alike
    lora_fold_into: frozenset[str]
    # those of them that take the fused ops' tiled variants (LoRAStep.tiled_folds), as the driver chose
    lora_tiled_folds: frozenset[str]
    # whether the driver's step runs the LoRA kernels in segments whatever its size (LoRAMetadata.segments)
    lora_segments: bool
    num_kv_blocks: int
    block_size: int
    # the Triton prefill attention's plan (tiles, sequences, block_q), made once per step on the driver
    prefill: tuple[np.ndarray, np.ndarray, int] | None = None


@dataclass
class ComputeLogits:
    """Take part in compute_logits for rank 0's `num_rows` hidden rows."""

    num_rows: int


@dataclass
class EnableLoRA:
    """Attach adapter slots to the shard, validating adapters against `model_info` (the unsharded shapes)."""

    model_info: object  # adapters_registry.ModelInfo


@dataclass
class LoadAdapter:
    """Put this adapter's shard into `slot` (the driver's LoRAManager chose the slot)."""

    lora_request: LoRARequest
    slot: int


@dataclass
class Shutdown:
    pass


@dataclass
class Started:
    """The worker process runs (sent before it joins the process group)."""

    rank: int


@dataclass
class Ready:
    """The worker's shard is built and loaded."""

    rank: int


@dataclass
class WorkerFailed:
    rank: int
    traceback: str


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy()


def encode_step(step: StepInput, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> Step:
    attn, lora = step.attention, step.lora
    num_blocks, block_size = kv_caches[0][0].shape[:2]
    return Step(
        input_ids=_numpy(step.input_ids), positions=_numpy(step.positions),
        slot_mapping=_numpy(attn.slot_mapping), block_tables=_numpy(attn.block_tables),
        context_lens=_numpy(attn.context_lens), query_lens=list(attn.query_lens), num_decode=attn.num_decode,
        lora_slots=None if lora is None else _numpy(lora.meta.slots[:lora.meta.num_tokens]),
        num_lora_slots=0 if lora is None else lora.meta.num_slots,
        lora_fold_into=frozenset() if lora is None else lora.fold_into,
        lora_tiled_folds=frozenset() if lora is None else lora.tiled_folds,
        lora_segments=lora is not None and lora.meta.segments,
        num_kv_blocks=num_blocks, block_size=block_size,
        prefill=None if attn.prefill is None else (_numpy(attn.prefill.tiles), _numpy(attn.prefill.sequences),
                                                   attn.prefill.block_q),
    )


def decode_step(message: Step, device: torch.device, lora_slot_ranks: torch.Tensor | None = None) -> StepInput:
    """lora_slot_ranks: this worker's slot ranks on the device (`LoRAManager.slot_ranks.on_device`), which the LoRA
    kernels read."""
    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device)

    context_lens = tensor(message.context_lens)
    lora = None
    if message.lora_slots is not None:
        import kernels

        meta = kernels.prepare_lora_metadata(tensor(message.lora_slots), message.num_lora_slots,
                                             slot_ranks=lora_slot_ranks)
        lora = LoRAStep(meta.in_segments() if message.lora_segments else meta,
                        fold_into=message.lora_fold_into, tiled_folds=message.lora_tiled_folds)
    prefill = None
    if message.prefill is not None:
        from kernels.prefill_attention_triton import PrefillPlan

        tiles, sequences, block_q = message.prefill
        prefill = PrefillPlan(tiles=tensor(tiles), sequences=tensor(sequences), block_q=block_q)
    return StepInput(
        input_ids=tensor(message.input_ids),
        positions=tensor(message.positions),
        attention=AttentionMetadata(
            slot_mapping=tensor(message.slot_mapping), block_tables=tensor(message.block_tables),
            context_lens=context_lens, query_lens=list(message.query_lens),
            context_lens_list=message.context_lens.tolist(), num_decode=message.num_decode, prefill=prefill,
        ),
        lora=lora,
    )
