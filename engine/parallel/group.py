"""The collectives one tensor-parallel group needs, over a process group that owns no global state.

The group is built straight from a c10d backend (gloo on the CPU, NCCL on CUDA) instead of
`init_process_group`, so one process may hold several engines, one after another or side by side.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) and symmetric-memory multicast are unreliable on the lent machines: keep them off
# in every process that may touch NCCL.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
STORE_HOST = "127.0.0.1"
CONNECT_TIMEOUT = datetime.timedelta(minutes=2)
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


def disable_multicast() -> None:
    os.environ.update(MULTICAST_OFF)


def master_store(size: int) -> dist.TCPStore:
    """The rendezvous store, served by rank 0 on a free local port (`store.port`)."""
    return dist.TCPStore(STORE_HOST, 0, size, is_master=True, wait_for_workers=False, timeout=CONNECT_TIMEOUT)


def client_store(port: int, size: int) -> dist.TCPStore:
    return dist.TCPStore(STORE_HOST, port, size, is_master=False, timeout=CONNECT_TIMEOUT)


class TensorParallelGroup:
    """rank/size plus in-place all-reduce, all-gather and broadcast on one device."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device):
        self.rank = rank
        self.size = size
        self.device = device
        self.store = dist.PrefixStore("loraserve-tp", store)  # NCCL reads it again when its communicator starts
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COLLECTIVE_TIMEOUT
            self.backend = dist.ProcessGroupNCCL(self.store, rank, size, options)
        else:
            self.backend = dist.ProcessGroupGloo(self.store, rank, size, COLLECTIVE_TIMEOUT)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        self.backend.allreduce([tensor]).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's tensor, concatenated along `dim` in rank order."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.backend.allgather([parts], [tensor.contiguous()]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `tensor` with rank `src`'s, in place."""
        self.backend.broadcast(tensor, src).wait()
        return tensor
