"""Time per call of a kernel benchmark's launch: CUDA-graph replay on the GPU, a few eager calls on the CPU."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch


def graph_time_us(fn: Callable[[], object], device: torch.device, rep_ms: int = 20, cpu_calls: int = 3) -> float:
    """us per call: on CUDA `triton.testing.do_bench_cudagraph` over about rep_ms (replays, so no launch
    overhead); elsewhere (smoke runs under the Triton interpreter) the mean of cpu_calls calls after one."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench_cudagraph(fn, rep=rep_ms) * 1e3
    fn()
    begin = time.perf_counter()
    for _ in range(cpu_calls):
        fn()
    return (time.perf_counter() - begin) / cpu_calls * 1e6
