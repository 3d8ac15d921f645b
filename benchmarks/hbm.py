"""The bandwidth every bytes floor divides by: one large copy, measured in the same run as the kernels."""
from __future__ import annotations

import statistics
import time

import torch


def measure_bandwidth(device: torch.device | str) -> float:
    """Bytes per second (read + written) of a copy: 2 GiB on CUDA, the median of 10 timed on the stream after
    two warm-ups (a graph's copy node runs slower); 64 MiB on the CPU, for smoke runs."""
    device = torch.device(device)
    size = (2 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    if device.type != "cuda":
        began = time.perf_counter()
        dst.copy_(src)
        return 2 * size / (time.perf_counter() - began)
    times = []
    for i in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * size / statistics.median(times)
