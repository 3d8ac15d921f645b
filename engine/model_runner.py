"""Turns one scheduler step into one batched forward pass over the paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from kernels import lora_tuning
from kernels.attention import prefill_uses_triton

from .lora_layout import SlotRanks
from .model import LlamaForCausalLM
from .scheduler import ScheduledSequence
from .step_input import AttentionMetadata, DeviceTokens, LoRAStep, StepInput, host_to_device


@dataclass
class StepResult:
    hidden: torch.Tensor  # [T, hidden] final-norm hidden states of every new token
    starts: list[int]  # offset of each scheduled sequence's first new token in `hidden`


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device, lora_slot_ranks: SlotRanks | None = None):
        """lora_slot_ranks: each adapter slot's rank (`LoRAManager.slot_ranks`), None without adapter slots."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.lora_slot_ranks = lora_slot_ranks
        self.num_lora_slots = 0 if lora_slot_ranks is None else lora_slot_ranks.num_slots
        self.graphs = None
        self.piecewise = None

    def build_step(self, scheduled: list[ScheduledSequence], adapter_slots: list[int]) -> StepInput:
        """adapter_slots: the LoRA slot of each scheduled sequence (-1 = base model). From its rows' slots, the step
        runs the LoRA kernels in segments where `lora_tuning.step_path` says, and its folds take the fused ops'
        tiled variants where `lora_tuning.tiled_decode_ops` says.

        Sequences with one new token should come first: they share one batched decode attention.
        """
        rows, attention = self._pack_step(scheduled, adapter_slots)
        ids, pos, _, lora_slots = rows
        lora = None
        if any(s >= 0 for s in adapter_slots):
            num_tokens = len(lora_slots)
            token_slots = [slot for item, slot in zip(scheduled, adapter_slots) for _ in range(item.num_new_tokens)]
            meta = kernels.prepare_lora_metadata(lora_slots, self.num_lora_slots,
                                                 slot_ranks=self.lora_slot_ranks.on_device)
            if lora_tuning.step_path(num_tokens, self.lora_slot_ranks.max_rank, token_slots) != meta.path:
                meta = meta.in_segments()
            lora = LoRAStep(meta, fold_into=lora_tuning.folded_ops(meta.path),
                            tiled_folds=lora_tuning.tiled_decode_ops(num_tokens, token_slots))
        return StepInput(input_ids=ids, positions=pos, attention=attention, lora=lora)

    def _pack_step(self, scheduled: list[ScheduledSequence], adapter_slots: list[int],
                   padded_to: int | None = None) -> tuple[torch.Tensor, AttentionMetadata]:
        """The step's per-token rows on the device ([4, tokens]: input ids, positions, KV slots, adapter
        slots), padded with the piecewise graphs' padding rows up to `padded_to` tokens, and its attention
        metadata."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        token_slots: list[int] = []
        query_lens, context_lens, tables = [], [], []
        bs = self.block_size
        for item, lora_slot in zip(scheduled, adapter_slots):
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            table = seq.block_table
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            token_slots.extend([lora_slot] * n)
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(table)
        num_tokens = len(input_ids)
        if padded_to is not None:
            if padded_to < num_tokens:
                raise ValueError(f"cannot pad a step of {num_tokens} tokens to {padded_to}")
            padding = padded_to - num_tokens
            for row, value in zip((input_ids, positions, slot_mapping, token_slots), self.piecewise.padding_row):
                row.extend([value] * padding)
            num_tokens = padded_to
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        num_decode = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        plan_values: list[int] = []
        if num_decode < len(query_lens) and prefill_uses_triton(dev):
            from kernels.prefill_attention_triton import DEFAULT_CONFIG, PrefillPlan

            config = self.model.config
            block_q = DEFAULT_CONFIG.block_q(config.num_attention_heads // config.num_key_value_heads)
            plan_values = PrefillPlan.host_values(query_lens[num_decode:], context_lens[num_decode:], block_q)
        # the per-token inputs and the prefill plan travel as one tensor (one copy to a GPU), used in pieces
        packed = host_to_device(input_ids + positions + slot_mapping + token_slots + plan_values, dev)
        rows = packed[:4 * num_tokens].view(4, num_tokens)
        prefill = None
        if plan_values:
            prefill = PrefillPlan.from_values(packed[4 * num_tokens:], len(query_lens) - num_decode, block_q)
        attention = AttentionMetadata(
            slot_mapping=rows[2],
            block_tables=host_to_device(padded, dev),
            context_lens=host_to_device(context_lens, dev),
            query_lens=query_lens,
            context_lens_list=context_lens,
            num_decode=num_decode,
            prefill=prefill,
        )
        return rows, attention

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int, scratch_block: int,
                           max_num_batched_tokens: int | None = None) -> None:
        """Decode steps replay CUDA graphs; with max_num_batched_tokens, so do mixed steps, piece by piece
        (`engine/piecewise_graphs.py`), up to that many tokens or PIECEWISE_MAX_TOKENS, whichever is fewer."""
        from .cuda_graphs import DecodeGraphs
        from .piecewise_graphs import PiecewiseGraphs

        self.graphs = DecodeGraphs(self.model, self.kv_caches, max_num_seqs=max_num_seqs,
                                   max_blocks_per_seq=-(-max_model_len // self.block_size),
                                   scratch_block=scratch_block, block_size=self.block_size,
                                   lora_slot_ranks=self.lora_slot_ranks, device=self.device)
        if max_num_batched_tokens is not None:
            self.piecewise = PiecewiseGraphs(self.model, self.kv_caches, max_tokens=max_num_batched_tokens,
                                             scratch_slot=scratch_block * self.block_size,
                                             lora_slot_ranks=self.lora_slot_ranks, device=self.device)

    def replays_graph(self, batch: int) -> bool:
        """True when a decode-only step of `batch` sequences replays a CUDA graph."""
        return self.graphs is not None and self.graphs.fits(batch)

    def _piecewise_bucket(self, num_tokens: int) -> int | None:
        """The token count a mixed step of `num_tokens` replays the pieces of, or None when it runs eagerly."""
        return None if self.piecewise is None else self.piecewise.bucket(num_tokens)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence], adapter_slots: list[int],
                device_tokens: DeviceTokens | None = None) -> StepResult:
        """device_tokens: input ids to take on the device instead of from the sequences' token_ids (which
        hold placeholders for them)."""
        decode_only = all(item.num_new_tokens == 1 for item in scheduled)
        num_tokens = sum(item.num_new_tokens for item in scheduled)
        bucket = None if decode_only else self._piecewise_bucket(num_tokens)
        starts, offset = [], 0
        for item in scheduled:
            starts.append(offset)
            offset += item.num_new_tokens
        if decode_only and self.replays_graph(len(scheduled)):
            seqs = [item.seq for item in scheduled]
            hidden = self.graphs.run([s.token_ids[s.num_computed_tokens] for s in seqs],
                                     [s.num_computed_tokens for s in seqs], [s.block_table for s in seqs],
                                     adapter_slots, device_tokens)
        elif bucket is not None:
            rows, attention = self._pack_step(scheduled, adapter_slots, bucket)
            if device_tokens is not None:
                device_tokens.write_into(rows[0], starts)
            hidden = self.piecewise.run(rows, attention, num_tokens)
        else:
            step = self.build_step(scheduled, adapter_slots)
            if device_tokens is not None:
                device_tokens.write_into(step.input_ids, starts)
            hidden = self.model(step, self.kv_caches)
        return StepResult(hidden=hidden, starts=starts)
