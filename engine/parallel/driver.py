"""The engine side of tensor parallelism: rank 0's shard in the engine process, and its worker processes.

Every call the engine makes on the model (a forward pass, compute_logits, an adapter slot load) is
first sent to the workers, then run on rank 0, so all ranks enter the same collectives in the same
order. The scheduler, sampler, detokenizer and KV block allocator never leave the engine.
"""
from __future__ import annotations

import multiprocessing
import time
import weakref
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from ..config import EngineConfig
from ..lora_request import LoRARequest
from .group import TensorParallelGroup, disable_multicast, master_store
from .layers import ShardedLlamaForCausalLM, build_shard
from .messages import ComputeLogits, EnableLoRA, LoadAdapter, Ready, Shutdown, Started, WorkerFailed, encode_step
from .sharding import check_tensor_parallel_size, shard_adapter
from .worker import WorkerSpec, run_worker

START_TIMEOUT_S = 120.0
READY_TIMEOUT_S = 600.0
JOIN_TIMEOUT_S = 10.0


class WorkerGroup:
    """Ranks 1..N-1 as spawned processes, each with a pipe; stopped on close() or when garbage-collected."""

    def __init__(self, specs: list[WorkerSpec]):
        context = multiprocessing.get_context("spawn")
        self.processes: list[multiprocessing.Process] = []
        self.conns: list[Connection] = []
        for spec in specs:
            ours, theirs = context.Pipe()
            process = context.Process(target=run_worker, args=(spec, theirs), name=f"loraserve-tp{spec.rank}",
                                      daemon=True)
            process.start()
            theirs.close()
            self.processes.append(process)
            self.conns.append(ours)
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.conns)

    def send(self, message) -> None:
        for conn in self.conns:
            conn.send(message)

    def load_adapter(self, lora_request: LoRARequest, slot: int) -> None:
        self.send(LoadAdapter(lora_request, slot))

    def wait_for(self, kind: type, timeout: float) -> None:
        """Wait for every worker's `kind` message (Started, Ready); a worker that dies or fails raises."""
        deadline = time.monotonic() + timeout
        for conn, process in zip(self.conns, self.processes):
            while not conn.poll(0.1):
                if not process.is_alive():
                    raise self.failure(grace_s=1.0)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel worker {process.name} sent no {kind.__name__} "
                                       f"within {timeout:.0f}s")
            try:
                message = conn.recv()
            except EOFError:  # it closed its pipe: it is exiting
                message = None
            if not isinstance(message, kind):
                raise self.failure(message, grace_s=5.0) or RuntimeError(f"{process.name} sent {message!r}")

    def failure(self, *messages, grace_s: float = 0.0) -> RuntimeError | None:
        """What went wrong on the workers as one error (their tracebacks, else exit codes); None if none did.

        grace_s: how long to wait for a worker that is going down (its sockets close before it exits).
        """
        reports = [m for m in messages if isinstance(m, WorkerFailed)]
        for conn in self.conns:
            try:
                while conn.poll(grace_s if not reports else 0):
                    message = conn.recv()
                    if isinstance(message, WorkerFailed):
                        reports.append(message)
            except (EOFError, OSError):
                continue
        if reports:
            details = "\n".join(f"rank {r.rank}:\n{r.traceback}" for r in reports)
            return RuntimeError(f"a tensor-parallel worker failed: {details}")
        for process in self.processes:
            process.join(grace_s)
        dead = [p for p in self.processes if not p.is_alive()]
        if dead:
            codes = ", ".join(f"{p.name} exit code {p.exitcode}" for p in dead)
            return RuntimeError(f"a tensor-parallel worker failed: {codes} (a script that starts a "
                                f"tensor-parallel engine needs an `if __name__ == \"__main__\":` guard)")
        return None

    def close(self) -> None:
        self._finalizer()


def _stop(processes: list[multiprocessing.Process], conns: list[Connection]) -> None:
    for conn in conns:
        try:
            conn.send(Shutdown())
        except OSError:
            pass
    for process in processes:
        process.join(JOIN_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()
    for conn in conns:
        conn.close()


class DriverModel(ShardedLlamaForCausalLM):
    """Rank 0's shard; each call is announced to the workers before rank 0 runs its part."""

    workers: WorkerGroup

    def forward(self, step, kv_caches):
        self._announce(encode_step(step, kv_caches))
        return self._collective(super().forward, step, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._announce(ComputeLogits(hidden.shape[0]))
        return self._collective(super().compute_logits, hidden)

    def lora_hooks(self, model_info) -> dict:
        """LoRAManager arguments that keep every rank's slots in lockstep with the engine's manager."""
        self._announce(EnableLoRA(model_info))
        return {"adapter_transform": partial(shard_adapter, rank=0, size=self.group.size),
                "on_slot_load": self.workers.load_adapter}

    def close(self) -> None:
        self.workers.close()

    def _announce(self, message) -> None:
        try:
            self.workers.send(message)
        except OSError as exc:
            raise (self.workers.failure(grace_s=1.0) or exc) from exc

    def _collective(self, fn, *args):
        try:
            return fn(*args)
        except RuntimeError as exc:
            failure = self.workers.failure(grace_s=1.0)
            if failure is None:
                raise
            raise failure from exc


def launch_tensor_parallel(config: EngineConfig, hf_config, model_dir: Path, *, dtype: torch.dtype,
                           device: torch.device, max_model_len: int) -> DriverModel:
    """Spawn ranks 1..N-1, build rank 0's shard here, and return it once every rank is ready."""
    size = config.tensor_parallel_size
    check_tensor_parallel_size(hf_config, size)
    devices = _rank_devices(device, size)
    disable_multicast()
    store = master_store(size)
    workers = WorkerGroup([WorkerSpec(rank=rank, size=size, store_port=store.port, device=str(devices[rank]),
                                      dtype=dtype, model_dir=str(model_dir), max_model_len=max_model_len,
                                      config=config) for rank in range(1, size)])
    try:
        workers.wait_for(Started, START_TIMEOUT_S)  # before joining the group, which blocks until all join
        if device.type == "cuda":
            torch.cuda.set_device(devices[0])
        group = TensorParallelGroup(store, 0, size, devices[0])
        model = build_shard(DriverModel, hf_config, model_dir, load_format=config.load_format,
                            max_positions=max_model_len, group=group, dtype=dtype, seed=config.seed)
        model.workers = workers
        workers.wait_for(Ready, READY_TIMEOUT_S)
    except BaseException:
        workers.close()
        raise
    return model


def _rank_devices(device: torch.device, size: int) -> list[torch.device]:
    if device.type != "cuda":
        return [torch.device("cpu")] * size
    first = device.index if device.index is not None else torch.cuda.current_device()
    if first + size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {size} needs GPUs {first}..{first + size - 1}, but only "
                         f"{torch.cuda.device_count()} are visible")
    return [torch.device("cuda", first + rank) for rank in range(size)]
