"""The one record the model runner hands the model each step (no globals)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kernels.lora_metadata import LoRAMetadata
    from kernels.prefill_attention_triton import PrefillPlan


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat KV slot of every new token (and of piecewise padding rows)
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    context_lens: torch.Tensor  # [B] tokens in the cache after this step, per sequence
    query_lens: list[int]  # new tokens per sequence, in batch order
    context_lens_list: list[int]
    num_decode: int  # the leading sequences with exactly one new token (batched decode attention)
    # where the Triton prefill attention's programs work, for the sequences after the decode ones;
    # None when the step has no prefill rows or the torch loop runs them
    prefill: PrefillPlan | None = None

    @property
    def decode_only(self) -> bool:
        return self.num_decode == len(self.query_lens)


@dataclass
class LoRAStep:
    """The adapters' part of a step. side_stream, only in CUDA-graph decode buckets on the per-token (BGMV)
    path: the stream each LoRA shrink runs on while its base matmul runs on the main one (the shrinks are
    latency-bound and the skinny decode matmuls leave SMs idle); the expand waits for both. Eager steps
    leave it None. fold_into: the fused ops (`lora_tuning.folded_ops`: "rotary_and_write_kv", "silu_and_mul",
    "add_rms_norm") that take the expand of the projection whose output they read, adding the delta as they
    read each row: one launch a projection fewer, and the projection's output is not read and written back.
    tiled_folds: the ops of fold_into that take their tiled variant (B read once per tile of same-slot tokens)
    although the step is on the per-token path (`lora_tuning.tiled_decode_ops`: many rows on few adapters); on
    the segment path every fold is tiled whatever this holds. rank_width: the rank width the LoRA ops read the
    slots at, narrower than the slots when every adapter of the step fits it (`lora_tuning.rank_width`: the
    launches then take that rank's shapes); None, the slots' whole width."""

    meta: LoRAMetadata  # the tokens grouped by adapter slot
    side_stream: torch.cuda.Stream | None = None
    fold_into: frozenset[str] = frozenset()
    tiled_folds: frozenset[str] = frozenset()
    rank_width: int | None = None


@dataclass
class StepInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attention: AttentionMetadata
    lora: LoRAStep | None  # None when no token uses an adapter


def host_to_device(values: list | torch.Tensor, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host numbers (a list, or a CPU tensor kept as it is) as a tensor on `device` (a list becomes int64 unless
    `dtype` says otherwise). To a GPU, through page-locked memory without waiting: a plain copy from pageable
    memory waits for all the work queued before it, so a step launched while the one before runs (async
    scheduling) would wait for that one to end before its first kernel."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


@dataclass
class DeviceTokens:
    """Input ids of a step that are still on the device (async scheduling): scheduled sequence i's next
    input id is tokens[rows[i]], the token the previous step sampled for it, which the host has not read;
    rows[i] is -1 for a sequence whose input ids the host has (a prompt admitted in this step)."""

    tokens: torch.Tensor  # [B_prev] int64, the previous step's sampled tokens
    rows: list[int]

    def write_into(self, input_ids: torch.Tensor, starts: list[int]) -> None:
        """input_ids[starts[i]] = tokens[rows[i]] for each sequence i the previous step sampled for (its
        host input id is a placeholder)."""
        pairs = [(start, row) for start, row in zip(starts, self.rows) if row >= 0]
        if not pairs:
            return
        index = host_to_device(pairs, input_ids.device).T
        input_ids.index_copy_(0, index[0], self.tokens.index_select(0, index[1]))
