"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (two or three with adapter slots).

Every input the layers read lives in static buffers (token ids, positions, KV slots, block
tables, context lengths, adapter slots); a step copies its values in and replays the graph of
the smallest bucket that fits, which also groups the tokens by adapter (the LoRA metadata).
Padding rows write their KV to a scratch block nobody reads and use no adapter. With adapter slots,
each bucket is captured twice, with the LoRA work and without it, and a step in which no row uses an
adapter replays the second (vLLM's `cudagraph_specialize_lora`): base-model traffic on a LoRA server
does not pay for launches that would do nothing. Buckets on the per-token LoRA path run each shrink
beside its base matmul; each expand is left to the fused op after it where `lora_tuning.folded_ops` says
(`LORASERVE_LORA_FOLD=0` turns that off). Below the segment path's size, a bucket's LoRA graphs run in
segments where `lora_tuning.path_for` says (ranks above 16; from fewer rows when they share few adapters;
`LORASERVE_LORA_DECODE_SEGMENTS=0` turns it off), and a step whose rows share few adapters replays a graph of its
own where that differs (`lora_key`): in segments, or with the fused ops' tiled variants
(`lora_tuning.tileable_decode_ops`: from 32 rows; `LORASERVE_LORA_DECODE_TILES=0` turns it off). Buckets of
CUBLASLT_TOKENS are captured with cuBLASLt preferred.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import torch

import kernels
from kernels import lora_tuning

from .lora_layout import SlotRanks
from .model import LlamaForCausalLM, cublaslt_preferred
from .step_input import AttentionMetadata, DeviceTokens, LoRAStep, StepInput


# Buckets of this many tokens are captured with cuBLASLt preferred for the layer GEMMs. H200, Llama-3-8B
# shapes, one layer's four GEMMs, us against torch's default choice (which splits K for gate/up and down at
# 64): 1 token 118.7 / 115.8, 16 122.9 / 117.8, 32 117.3 / 120.5, 64 121.2 / 126.1 (another run: 117.8 /
# 123.2), 128 135.6 / 134.4 (`benchmarks/gemm_settings.py`).
CUBLASLT_TOKENS = range(32, 65)


@contextmanager
def preferred_blas_for(tokens: int) -> Iterator[None]:
    """cuBLASLt preferred while a bucket of `tokens` is captured (its GEMMs are recorded in the graph)."""
    if tokens not in CUBLASLT_TOKENS:
        yield
        return
    with cublaslt_preferred():
        yield


def default_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    return sorted({min(s, max_num_seqs) for s in sizes})


def smallest_bucket(buckets: list[int], batch: int) -> int:
    """The smallest of the sorted `buckets` that holds `batch` rows."""
    return next(b for b in buckets if b >= batch)


class GraphKey(NamedTuple):
    """Which decode graph: its bucket, whether it does the LoRA work, the LoRA folds it hands to the fused
    ops' tiled variants (`LoRAStep.tiled_folds`), the rank width it reads the slots at (`LoRAStep.rank_width`;
    None: the slots' whole width), and whether its LoRA kernels run in segments (`LoRAMetadata.in_segments`)."""

    bucket: int
    with_lora: bool
    tiled_folds: frozenset[str] = frozenset()
    rank_width: int | None = None
    segments: bool = False


def lora_key(bucket: int, max_rank: int, rank_width: int | None, shared: bool) -> GraphKey:
    """The LoRA graph of a bucket at a rank width (None: the slots' whole `max_rank`) for steps whose rows share few
    adapters (`shared`) or not: in segments below the segment path's size where `lora_tuning.path_for` says, else
    with the tiled folds for shared rows where `lora_tuning.tileable_decode_ops` says."""
    rank = rank_width or max_rank
    if lora_tuning.path_for(bucket, rank, shared) != lora_tuning.choose_path(bucket):
        return GraphKey(bucket, True, rank_width=rank_width, segments=True)
    tiled = lora_tuning.tileable_decode_ops(bucket) if shared else frozenset()
    return GraphKey(bucket, True, tiled, rank_width)


def rank_widths(max_rank: int) -> list[int | None]:
    """The rank widths a bucket's LoRA graphs are captured at: the slots' whole width (None), and a narrower one
    where there is one (`lora_tuning.narrow_rank_width`)."""
    narrow = lora_tuning.narrow_rank_width(max_rank)
    return [None] if narrow is None else [None, narrow]


def bucket_keys(bucket: int, num_lora_slots: int, max_rank: int) -> list[GraphKey]:
    """The graphs captured for a bucket: without the LoRA work; with adapter slots (of rank `max_rank`) also with
    it at each rank width (`rank_widths`), for rows spread over many adapters, then for rows that share few adapters
    where that graph differs (`lora_key`)."""
    keys = [GraphKey(bucket, False)]
    if num_lora_slots:
        widths = rank_widths(max_rank)
        spread = [lora_key(bucket, max_rank, width, shared=False) for width in widths]
        shared = [lora_key(bucket, max_rank, width, shared=True) for width in widths]
        keys += spread + [key for key in shared if key not in spread]
    return keys


def captured_lora_keys(buckets: list[int], num_lora_slots: int,
                       max_rank: int) -> dict[tuple[int, int | None], tuple[GraphKey, GraphKey]]:
    """The LoRA graphs of each bucket and rank width (`bucket_keys`), for rows spread over many adapters and for rows
    that share few, as the switches say now: read once, at capture, so that a switch changed since cannot name a
    graph that does not exist."""
    if not num_lora_slots:
        return {}
    return {(bucket, width): (lora_key(bucket, max_rank, width, shared=False),
                              lora_key(bucket, max_rank, width, shared=True))
            for bucket in buckets for width in rank_widths(max_rank)}


def graph_key(buckets: list[int], num_lora_slots: int, batch: int, lora_slots: list[int],
              captured: Mapping[tuple[int, int | None], tuple[GraphKey, GraphKey]],
              rank_width: int | None = None) -> GraphKey:
    """The decode graph a step of `batch` rows with these adapter slots (-1: none) replays: the smallest
    bucket that holds it, whether the graph does the LoRA work (there are adapter slots and some row
    uses one), and of that bucket's LoRA graphs (`captured`, from `captured_lora_keys`) the one at the rank width
    of the step's adapters (`lora_tuning.rank_width`) for rows that share few adapters or not
    (`lora_tuning.shares_few_adapters`)."""
    bucket = smallest_bucket(buckets, batch)
    if num_lora_slots == 0 or max(lora_slots, default=-1) < 0:
        return GraphKey(bucket, False)
    spread, shared = captured[(bucket, rank_width)]
    return shared if shared != spread and lora_tuning.shares_few_adapters(lora_slots) else spread


def graph_path(key: GraphKey) -> str:
    """The path a LoRA graph's kernels take: in segments where its key says, else by its bucket's size. Not by its
    metadata's token count, which is 0 until the capture prepares the buffers."""
    return "sgmv" if key.segments else lora_tuning.choose_path(key.bucket)


def graph_lora_step(key: GraphKey, meta: kernels.LoRAMetadata, side_stream: torch.cuda.Stream | None) -> LoRAStep:
    """The adapters' part of the step a LoRA graph captures, over its bucket's metadata buffers (`meta`): on the path
    of `graph_path`, with the folds of that path (`lora_tuning.folded_ops`), and with the shrinks beside the base
    matmul on `side_stream` only on the per-token path: H200, Llama-3-8B, 64 adapters, batch 64 (BGMV) 7.59 against
    7.85 ms a step; batch 128 in segments (SGMV, the path 128 took then) 10.93 against 10.79."""
    path = graph_path(key)
    return LoRAStep(meta.in_segments() if key.segments else meta, side_stream if path == "bgmv" else None,
                    fold_into=lora_tuning.folded_ops(path), tiled_folds=key.tiled_folds, rank_width=key.rank_width)


class StagedBlockTables:
    """Block tables padded with a fill block, kept in a host array across steps: a step rewrites only
    the rows whose table changed (a sequence's table grows one block every block_size tokens), not
    max_blocks_per_seq entries of every row."""

    def __init__(self, array: np.ndarray, fill: int):
        self.array = array  # [rows, max_blocks_per_seq], all `fill` to begin with
        self.fill = fill
        self._rows: list[list[int]] = [[] for _ in range(array.shape[0])]  # what each row holds

    def stage(self, block_tables: list[list[int]], size: int) -> None:
        """Row i holds block_tables[i] then the fill block; rows up to `size` past them, only the fill."""
        staged, array = self._rows, self.array
        for row, table in enumerate(block_tables):
            if staged[row] != table:
                array[row, :len(table)] = table
                array[row, len(table):len(staged[row])] = self.fill
                staged[row] = list(table)  # a copy: the scheduler grows and clears tables in place
        for row in range(len(block_tables), size):
            if staged[row]:
                array[row, :len(staged[row])] = self.fill
                staged[row] = []


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_caches, *, max_num_seqs: int, max_blocks_per_seq: int,
                 scratch_block: int, block_size: int, lora_slot_ranks: SlotRanks | None, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.lora_slot_ranks = lora_slot_ranks  # read by the captured metadata preparation at each replay
        self.num_lora_slots = num_lora_slots = 0 if lora_slot_ranks is None else lora_slot_ranks.num_slots
        self.max_rank = 0 if lora_slot_ranks is None else lora_slot_ranks.max_rank
        self.narrow_width = lora_tuning.narrow_rank_width(self.max_rank) if num_lora_slots else None
        self.buckets = default_buckets(max_num_seqs)
        top = self.buckets[-1]
        # one row per per-token input (token id, position, KV slot, context length, adapter slot, and
        # the row of an input id left on the device by the previous step), all copied in one transfer;
        # a padding row's values
        self._padding_row = np.array([0, 0, scratch_block * block_size, 1, -1, 0], dtype=np.int64)[:, None]
        rows = torch.from_numpy(self._padding_row).expand(6, top).contiguous()
        self._device_rows = rows.to(device)
        (self.input_ids, self.positions, self.slot_mapping, self.context_lens, self.lora_slots,
         self.token_rows) = self._device_rows
        self.block_tables = torch.full((top, max_blocks_per_seq), scratch_block, dtype=torch.long, device=device)
        # page-locked staging, reused every step, so the host-to-device copies are asynchronous; numpy
        # views write Python lists into it without building tensors
        self._host_rows = rows.pin_memory()
        self._host_tables = torch.full((top, max_blocks_per_seq), scratch_block, dtype=torch.long).pin_memory()
        self._rows = self._host_rows.numpy()
        self._tables = StagedBlockTables(self._host_tables.numpy(), scratch_block)
        # recorded after each step's copies: the staging is rewritten only once they are done (with
        # async scheduling the host can get here before the GPU reaches the last step's copies)
        self._copied = torch.cuda.Event()
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        self.lora_keys = captured_lora_keys(self.buckets, num_lora_slots, self.max_rank)
        self.lora_meta: dict[int, kernels.LoRAMetadata] = {}
        self.lora_side_stream = torch.cuda.Stream(device) if num_lora_slots else None
        self._capture_all()

    def _step_input(self, key: GraphKey) -> StepInput:
        size = key.bucket
        attention = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size], query_lens=[1] * size, context_lens_list=[1] * size,
            num_decode=size,
        )
        lora = graph_lora_step(key, self.lora_meta[size], self.lora_side_stream) if key.with_lora else None
        return StepInput(self.input_ids[:size], self.positions[:size], attention, lora)

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):
            if self.num_lora_slots:
                self.lora_meta[size] = kernels.LoRAMetadata.empty(size, self.num_lora_slots, self.input_ids.device,
                                                                  block_m=lora_tuning.DECODE_BLOCK_M)
            for key in reversed(bucket_keys(size, self.num_lora_slots, self.max_rank)):
                self._capture(key, pool)
        torch.cuda.synchronize()

    def _capture(self, key: GraphKey, pool) -> None:
        size, with_lora = key.bucket, key.with_lora
        step = self._step_input(key)
        with torch.inference_mode(), preferred_blas_for(size):
            if with_lora:
                self._prepare_lora(step.lora.meta)
            self.model(step, self.kv_caches)  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                if with_lora:
                    self._prepare_lora(step.lora.meta)
                self.outputs[key] = self.model(step, self.kv_caches)
        self.graphs[key] = graph

    def _prepare_lora(self, meta: kernels.LoRAMetadata) -> None:
        """Groups the tokens by adapter slot from the static slot buffer into the bucket's buffers (`meta`'s);
        captured in the graph, so a replay does it without host work."""
        kernels.prepare_lora_metadata(self.lora_slots[:meta.capacity], self.num_lora_slots,
                                      slot_ranks=self.lora_slot_ranks.on_device, out=meta)

    def fits(self, batch: int) -> bool:
        return batch <= self.buckets[-1]

    def key(self, batch: int, lora_slots: list[int]) -> GraphKey:
        """The graph a step of `batch` rows with these adapter slots replays: its bucket, whether it does the
        LoRA work (some row uses an adapter), its rank width, and whether its rows share few adapters
        (`graph_key`)."""
        width = None
        if self.narrow_width is not None:
            width = lora_tuning.rank_width(self.lora_slot_ranks.largest(lora_slots), self.lora_slot_ranks.max_rank)
        return graph_key(self.buckets, self.num_lora_slots, batch, lora_slots, self.lora_keys, width)

    def run(self, input_ids: list[int], positions: list[int], block_tables: list[list[int]],
            lora_slots: list[int], device_tokens: DeviceTokens | None = None) -> torch.Tensor:
        """Hidden states [B, hidden] of one decode token per sequence. With device_tokens, the input
        ids it covers are gathered from it on the device (input_ids hold placeholders for them)."""
        batch = len(input_ids)
        key = self.key(batch, lora_slots)
        size = key.bucket
        self._copied.synchronize()
        self._tables.stage(block_tables, size)
        rows, bs = self._rows, self.block_size
        rows[0, :batch] = input_ids
        rows[1, :batch] = positions
        position = rows[1, :batch]
        rows[2, :batch] = self._tables.array[np.arange(batch), position // bs] * bs + position % bs
        rows[3, :batch] = position + 1
        rows[4, :batch] = lora_slots
        gather = device_tokens is not None and min(device_tokens.rows) >= 0  # every row from the device
        if gather:
            rows[5, :batch] = device_tokens.rows
        rows[:, batch:size] = self._padding_row
        self._device_rows.copy_(self._host_rows, non_blocking=True)  # a graph reads only its bucket's columns
        self.block_tables[:size].copy_(self._host_tables[:size], non_blocking=True)
        self._copied.record()
        if gather:
            torch.index_select(device_tokens.tokens, 0, self.token_rows[:batch], out=self.input_ids[:batch])
        elif device_tokens is not None:  # some rows are prompts admitted in this step
            device_tokens.write_into(self.input_ids[:batch], list(range(batch)))
        self.graphs[key].replay()
        return self.outputs[key][:batch]
