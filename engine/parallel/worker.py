"""A tensor-parallel worker process: one rank's shard, replaying the driver's calls in order.

The worker holds no scheduler and no sampler. It blocks on its pipe, runs each message's part of the
collective (a forward pass, a logits gather, an adapter slot load), and exits on Shutdown or when the
driver's end of the pipe closes.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from ..config import EngineConfig
from ..kv_cache import allocate_kv_caches
from ..lora_manager import LoRAManager
from ..model_loader import load_hf_config
from .group import TensorParallelGroup, client_store, disable_multicast
from .layers import ShardedLlamaForCausalLM, build_shard
from .messages import (ComputeLogits, EnableLoRA, LoadAdapter, Ready, Shutdown, Started, Step, WorkerFailed,
                       decode_step)
from .sharding import shard_adapter


@dataclass
class WorkerSpec:
    rank: int
    size: int
    store_port: int
    device: str
    dtype: torch.dtype
    model_dir: str  # local Hugging Face directory (config.json, safetensors)
    max_model_len: int
    config: EngineConfig


class Worker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:  # the ranks share the host's cores
            torch.set_num_threads(max(1, torch.get_num_threads() // spec.size))
        store = client_store(spec.store_port, spec.size)
        self.group = TensorParallelGroup(store, spec.rank, spec.size, self.device)
        model_dir = Path(spec.model_dir)
        self.model = build_shard(ShardedLlamaForCausalLM, load_hf_config(model_dir), model_dir,
                                 load_format=spec.config.load_format, max_positions=spec.max_model_len,
                                 group=self.group, dtype=spec.dtype, seed=spec.config.seed)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.lora_manager = None

    def handle(self, message) -> None:
        if isinstance(message, Step):
            if self.lora_manager is not None:
                self.lora_manager.wait_for_loads()
            slot_ranks = None if self.lora_manager is None else self.lora_manager.slot_ranks.on_device
            self.model(decode_step(message, self.device, slot_ranks), self._kv_caches(message))
        elif isinstance(message, ComputeLogits):
            hidden = torch.empty(message.num_rows, self.model.config.hidden_size, device=self.device,
                                 dtype=self.spec.dtype)
            self.model.compute_logits(hidden)
        elif isinstance(message, LoadAdapter):
            self.lora_manager.load_slot(message.lora_request, message.slot)
        elif isinstance(message, EnableLoRA):
            self._enable_lora(message)
        else:
            raise TypeError(f"unexpected message {message!r}")

    def _kv_caches(self, step: Step) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's KV heads for the same block ids as the driver's cache; allocated on first use."""
        if not self.kv_caches or self.kv_caches[0][0].shape[:2] != (step.num_kv_blocks, step.block_size):
            attn = self.model.layers[0].self_attn
            self.kv_caches = allocate_kv_caches(len(self.model.layers), step.num_kv_blocks, step.block_size,
                                                attn.num_kv_heads, attn.head_dim, self.spec.dtype, self.device)
        return self.kv_caches

    def _enable_lora(self, message: EnableLoRA) -> None:
        cfg = self.spec.config
        self.lora_manager = LoRAManager(
            self.model, message.model_info, max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank,
            max_cpu_loras=cfg.max_cpu_loras, device=self.device, dtype=self.spec.dtype,
            allow_pickle=cfg.allow_pickle_adapters,
            adapter_transform=partial(shard_adapter, rank=self.group.rank, size=self.group.size),
        )


def run_worker(spec: WorkerSpec, conn: Connection) -> None:
    """Process entry point (spawned): build the shard, say Ready, then serve messages until told to stop."""
    disable_multicast()
    try:
        conn.send(Started(spec.rank))
        worker = Worker(spec)
        conn.send(Ready(spec.rank))
        with torch.inference_mode():
            while True:
                try:
                    message = conn.recv()
                except EOFError:
                    return
                if isinstance(message, Shutdown):
                    return
                worker.handle(message)
    except Exception:
        try:
            conn.send(WorkerFailed(spec.rank, traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1)
