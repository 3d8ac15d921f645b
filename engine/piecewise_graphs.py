"""Mixed steps (prompts, beside decode rows) replayed from CUDA graphs piece by piece.

An eager mixed step launches a few hundred kernels (about 450 for Llama-3-8B with adapters, 41–81 ms of
host time on the H200's host), so a step that admits one prompt is host-bound. Its attention depends on
the step's sequences (how many decode rows, which prompts, the prefill plan), not only on its token
count, but everything between two attentions does not: a layer's o_proj, norm, MLP and LoRA, the next
layer's norm, qkv_proj, rotary and KV write (`LlamaForCausalLM.piece`). Those pieces are captured per
token-count bucket and replayed, and only attention runs eagerly between them: vLLM's piecewise CUDA
graphs. One step then costs 33 replays and 64 attention launches of host time for 32 layers.

Every input a piece reads but the residual stream lives in a static buffer: token ids, positions, KV
slots and adapter slots (rows of one tensor), q/k/v (the projections write into one buffer all layers
share) and the attention output. Padding rows up to the bucket write their KV to the scratch block nobody
reads and use no adapter; attention runs on the real rows only. The pieces of a bucket share one memory
pool with the other buckets and replay in the order they were captured, so what one piece hands the next
(the residual stream, in the pool: the eager attention between allocates outside it) may reuse memory a
piece before freed, and a bucket may reuse another's.

A bucket's LoRA kernels take the path of its size (`lora_tuning.choose_path`), or segments below it where
every step of the bucket would take them at the slots' rank, however its rows spread over adapters
(`lora_tuning.path_for`: at ranks above 16, from 80 tokens); one capture serves both.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

import kernels
from kernels import lora_tuning

from .lora_layout import SlotRanks
from .model import AttentionInputs, LlamaForCausalLM
from .step_input import AttentionMetadata, LoRAStep, StepInput

# Steps of more tokens run eagerly: their GPU time hides the launches, and padding them would cost more.
PIECEWISE_MAX_TOKENS = 4096


def piecewise_buckets(max_tokens: int) -> list[int]:
    """Token counts captured, up to max_tokens (itself a bucket) or PIECEWISE_MAX_TOKENS: 16 and 32, then steps
    of 64 to 512 and of 128 beyond. Small steps may pad to twice as many tokens, which costs little while
    reading the weights dominates; past 512 tokens the GPU time grows with the tokens, and a step pads by
    fewer than 128 (H200, Llama-3-8B: 2080 tokens padded to 2304 took 62.3 ms against 58.4 ms eagerly)."""
    top = min(max_tokens, PIECEWISE_MAX_TOKENS)
    sizes = [16, 32, *range(64, 513, 64), *range(640, PIECEWISE_MAX_TOKENS + 1, 128)]
    return sorted({size for size in sizes if size < top} | {top})


class PiecewiseGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_caches, *, max_tokens: int, scratch_slot: int,
                 lora_slot_ranks: SlotRanks | None, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.lora_slot_ranks = lora_slot_ranks  # read by the captured metadata preparation at each replay
        self.num_lora_slots = 0 if lora_slot_ranks is None else lora_slot_ranks.num_slots
        self.buckets = piecewise_buckets(max_tokens)
        self.padding_row = (0, 0, scratch_slot, -1)  # token id, position, KV slot, adapter slot
        top = self.buckets[-1]
        attn = model.layers[0].self_attn
        dtype = model.embed_tokens.weight.dtype
        # token ids, positions, KV slots and adapter slots; a bucket's graphs read its first columns
        self.rows = torch.tensor(self.padding_row, dtype=torch.long, device=device)[:, None].repeat(1, top)
        self.qkv = torch.zeros(top, sum(attn.split), dtype=dtype, device=device)
        self.attn_out = torch.zeros(top, attn.num_heads, attn.head_dim, dtype=dtype, device=device)
        self.hidden = torch.zeros(top, model.config.hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.lora_meta: dict[int, kernels.LoRAMetadata] = {}
        self._capture_all()

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket that holds num_tokens, or None when the step runs eagerly."""
        return next((size for size in self.buckets if size >= num_tokens), None)

    def _capture_step(self, size: int) -> StepInput:
        ids, positions, slots = self.rows[:3, :size]
        lora = None
        if self.num_lora_slots:
            meta = kernels.LoRAMetadata.empty(size, self.num_lora_slots, ids.device)
            # in segments where every step of the bucket would take them, however its rows spread over adapters
            paths = {lora_tuning.path_for(size, self.lora_slot_ranks.max_rank, shared) for shared in (False, True)}
            segments = paths == {"sgmv"}
            self.lora_meta[size] = meta.in_segments() if segments else meta
            # the path by the bucket's size, not by the empty buffers' token count (0 until the capture prepares them)
            path = "sgmv" if segments else lora_tuning.choose_path(size)
            lora = LoRAStep(self.lora_meta[size], fold_into=lora_tuning.folded_ops(path))
        # the pieces read only the KV slots; attention, which reads the rest, runs outside them
        attention = AttentionMetadata(slot_mapping=slots, block_tables=slots.new_empty(0, 1),
                                      context_lens=slots.new_empty(0), query_lens=[], context_lens_list=[],
                                      num_decode=0)
        return StepInput(ids, positions, attention, lora)

    def _run_pieces(self, size: int, step: StepInput, capture: list[torch.cuda.CUDAGraph] | None,
                    pool) -> None:
        """Each piece in turn, with no attention between (its output buffer is read as it is): eagerly,
        which compiles the kernels; or each captured into the next graph of `capture`."""
        inputs: AttentionInputs | None = None
        for index in range(self.model.num_pieces):
            with nullcontext() if capture is None else torch.cuda.graph(capture[index], pool=pool):
                if index == 0 and step.lora is not None:  # the tokens grouped by adapter, from the static slots
                    kernels.prepare_lora_metadata(self.rows[3, :size], self.num_lora_slots,
                                                  slot_ranks=self.lora_slot_ranks.on_device, out=step.lora.meta)
                result = self.model.piece(index, step, self.kv_caches, self.attn_out[:size],
                                          None if inputs is None else inputs.residual, self.qkv[:size])
                if index == self.model.num_pieces - 1:
                    self.hidden[:size].copy_(result)
                else:
                    inputs = result

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.buckets):
                step = self._capture_step(size)
                self._run_pieces(size, step, None, pool)
                torch.cuda.synchronize()
                graphs = [torch.cuda.CUDAGraph() for _ in range(self.model.num_pieces)]
                self._run_pieces(size, step, graphs, pool)
                self.graphs[size] = graphs
        torch.cuda.synchronize()

    def run(self, rows: torch.Tensor, attention: AttentionMetadata, num_tokens: int) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a step whose per-token rows (ids, positions, KV slots,
        adapter slots; [4, bucket], padded with `padding_row`) are on the device: a view of a static buffer,
        which the next piecewise step overwrites."""
        size = rows.shape[1]
        graphs = self.graphs[size]
        self.rows[:, :size].copy_(rows)
        q, k, v = self.model.layers[0].self_attn.split_qkv(self.qkv[:num_tokens])
        out = self.attn_out[:num_tokens]
        graphs[0].replay()
        for layer, kv_cache, graph in zip(self.model.layers, self.kv_caches, graphs[1:]):
            layer.self_attn.attend(q, k, v, kv_cache, attention, out=out)
            graph.replay()
        return self.hidden[:num_tokens]
