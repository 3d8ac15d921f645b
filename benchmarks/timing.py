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


def median_replay_us(step: Callable[[], object], replays: int) -> float:
    """µs of one replay of `step` captured in a CUDA graph: the median of `replays` replays, each between two
    events and synchronised, after a warm call and a first replay."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    times = []
    for _ in range(replays):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) * 1e3)
    return sorted(times)[replays // 2]
