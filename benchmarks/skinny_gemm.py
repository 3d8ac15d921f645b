"""Skinny GEMM `y = x @ W^T` at Llama-3-8B decode shapes: cuBLAS (`F.linear`) against the Triton linear,
alone and in a decoder layer's kernel chain, with and without programmatic dependent launch (PDL).

Sweep. For each layer linear (qkv, o, gate_up, down) and batch M it times cuBLAS and candidate
`kernels.linear_triton` configs, each checked once against cuBLAS (bf16 rel err <= 1e-2).
Weights come from HBM as in a 32-layer step, not from the 50 MB L2: one CUDA graph holds a
sequence of calls cycling over distinct copies of W (more than 256 MB in all) and the replay
time, a median of CUDA-event timings, is divided by the number of calls. The floor is W + x + y
bytes over the bandwidth of a 2 GiB device-to-device copy measured in the same run.

Chain. One CUDA graph of `--layers` decoder layers, each `add_rms_norm -> qkv -> rotary_and_write_kv
(q and k rotated in place, k and v to a cache) -> o (on the rotated q: attention left out) ->
add_rms_norm -> gate_up -> silu_and_mul -> down`, the small ops being the fused Triton kernels
(`kernels.fused_triton`, unmodified: with PDL where they launch with it themselves). The GEMMs are
cuBLAS, the Triton linear, the Triton linear with PDL (W's first K blocks prefetched into L2 before
its wait) and with PDL but no prefetch; each Triton GEMM takes the sweep's best config for its shape
and M (or `linear_tuning.choose_config` without a sweep). Time: µs per layer, the median of graph
replays divided by the layers; L2 is not flushed, but a layer's weights (436 MB) are nine times the
L2, so every GEMM reads its W from HBM while the activations stay in L2, as in the engine's step.
Correctness: the last layer's output against a float64 chain (torch ops on float64 copies of the
same weights) for two fresh inputs copied in (and the GEMMs' outputs filled with NaN) before two
replays, and the split-K counters back at zero.

Compiling dominates the run, so `--jobs` processes first compile every candidate into Triton's
on-disk cache (one compile per tile height; the timed launches then only load them), and the PDL
variants of the configs the chain uses once the sweep has picked them. Candidates run round-robin
(every shape and batch gets the first candidate before any gets the second) and no new one starts
past `--budget-s`, so a short budget still covers every row. Results go to DIR/skinny_gemm.json and
DIR/skinny_gemm.md, with a per-layer sum; the sweep's winners that beat cuBLAS are printed last as the
`_TUNED` literal of `kernels/linear_tuning.py`.

    python benchmarks/skinny_gemm.py --out DIR                # sweep + chain, about 1.5 min on an H200
    python benchmarks/skinny_gemm.py --out DIR --chain-only   # chain with the default configs
    python benchmarks/skinny_gemm.py --smoke --out DIR        # tiny shapes; without CUDA, under the Triton interpreter
    python benchmarks/skinny_gemm.py --compile-only           # every candidate compiled for sm_90, with and
                                                              # without PDL, PTX order checked; no GPU needed
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
# Decided before Triton is imported: --compile-only needs the kernel compiled, never interpreted.
if "--compile-only" in sys.argv:
    os.environ.pop("TRITON_INTERPRET", None)
elif not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from benchmarks.hbm import measure_bandwidth  # noqa: E402
from kernels import fused_torch, fused_triton, linear_triton, linear_tuning  # noqa: E402
from kernels.device import multiprocessor_count  # noqa: E402
from kernels.linear_triton import LinearWorkspace, block_m_for, skinny_linear  # noqa: E402
from kernels.linear_tuning import LinearConfig  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16
MAX_REL_ERR = 1e-2
WEIGHT_SET_BYTES = 320 << 20  # distinct W copies per graph: well past the 50 MB L2
MIN_CALLS = 16
REPLAYS = 20
SMEM_BYTES = 227 << 10  # H200 shared memory per block
MIN_SPEEDUP = 1.02  # below this a Triton win is within noise and cuBLAS stays
# The chain's last output against float64: the bf16 roundings of four layers come to about 2% with any GEMM (cuBLAS
# too; 3% under the interpreter, which truncates float32 to bfloat16); a GEMM reading x before the previous kernel
# wrote it, or a kernel reading a GEMM's NaN-filled output early, is off by O(1) or NaN.
CHAIN_MAX_REL_ERR = 5e-2


@dataclass(frozen=True)
class Shape:
    name: str
    k: int
    n: int


LLAMA3_8B = (Shape("qkv", 4096, 6144), Shape("o", 4096, 4096), Shape("gate_up", 4096, 28672),
             Shape("down", 14336, 4096))
BATCHES = (16, 64, 128)
SMOKE_SHAPES = (Shape("qkv", 96, 48), Shape("o", 64, 64), Shape("gate_up", 64, 160), Shape("down", 160, 64))
SMOKE_BATCHES = (1, 5, 33)
# Llama-3-8B's attention heads (qkv = 32 query, 8 key and 8 value heads of 128) and the smoke run's.
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SMOKE_HEADS, SMOKE_KV_HEADS, SMOKE_HEAD_DIM = 4, 1, 16


def _cfg(block_n: int, block_k: int, split_k: int, warps: int, stages: int, swap: bool = False,
         tma: bool = False) -> LinearConfig:
    return LinearConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=warps, num_stages=stages,
                        swap_ab=swap, tma=tma)


# Per tile height (BLOCK_M, from M), most promising first: the budget cuts the tail. Each list holds the
# default configs of its batches and fits the H200's shared memory (checked with --compile-only); the
# last ones of the 64 and 128 lists take under half of it, so two programs share an SM.
CANDIDATES = {
    16: [_cfg(*c) for c in [
        (64, 256, 2, 4, 4), (64, 256, 2, 4, 4, False, True), (32, 256, 2, 4, 4), (64, 256, 4, 4, 4), (32, 256, 4, 4, 4, False, True),
        (64, 256, 4, 4, 4, False, True), (64, 256, 2, 4, 4, True), (128, 256, 4, 8, 3), (128, 128, 4, 4, 4, True, True),
        (64, 512, 2, 8, 3), (32, 512, 2, 4, 3), (64, 256, 1, 4, 4), (64, 256, 1, 4, 4, False, True), (128, 256, 2, 4, 3, True),
        (64, 128, 4, 4, 6), (32, 256, 4, 4, 5), (64, 256, 8, 4, 4), (128, 128, 4, 4, 4, True), (16, 512, 2, 4, 4),
        (128, 256, 1, 8, 3), (32, 256, 1, 4, 5), (128, 128, 2, 8, 4),
    ]],
    32: [_cfg(*c) for c in [
        (64, 256, 2, 4, 4), (64, 256, 2, 4, 4, False, True), (32, 256, 2, 4, 4), (64, 256, 4, 4, 4), (32, 256, 4, 4, 4, False, True),
        (64, 256, 4, 4, 4, False, True), (64, 256, 2, 4, 4, True), (128, 256, 4, 8, 3), (64, 512, 2, 8, 3), (32, 512, 2, 4, 3),
        (64, 256, 1, 4, 4), (64, 256, 1, 4, 4, False, True), (128, 128, 2, 4, 4, True), (64, 128, 4, 4, 6), (32, 256, 4, 4, 5),
        (64, 256, 8, 4, 4), (128, 128, 4, 4, 4, True), (16, 512, 2, 4, 4), (128, 256, 1, 8, 3), (32, 256, 1, 4, 5),
        (128, 128, 2, 8, 4),
    ]],
    64: [_cfg(*c) for c in [
        (64, 256, 2, 4, 3), (64, 256, 2, 4, 3, False, True), (32, 256, 2, 4, 4), (64, 256, 4, 4, 3), (64, 256, 4, 4, 3, False, True),
        (64, 128, 4, 4, 4, False, True), (64, 128, 4, 4, 6), (128, 128, 2, 8, 4), (128, 128, 2, 8, 4, False, True),
        (64, 256, 2, 4, 3, True), (32, 256, 4, 4, 4), (128, 128, 4, 4, 4), (64, 128, 2, 4, 6), (64, 256, 1, 4, 3),
        (64, 256, 1, 4, 3, False, True), (128, 128, 1, 8, 4), (128, 128, 2, 4, 4, True), (64, 256, 8, 4, 3), (64, 128, 2, 4, 3),
        (64, 128, 2, 4, 3, False, True), (64, 128, 4, 4, 3), (32, 128, 4, 4, 4),
    ]],
    128: [_cfg(*c) for c in [
        (64, 128, 2, 4, 4), (64, 128, 2, 4, 4, False, True), (64, 128, 4, 4, 4), (64, 128, 4, 4, 4, False, True), (32, 128, 4, 4, 5),
        (128, 128, 2, 8, 3), (64, 128, 1, 4, 4), (64, 128, 1, 4, 4, False, True), (128, 128, 1, 8, 3), (32, 128, 2, 4, 5),
        (16, 256, 4, 4, 3), (64, 128, 8, 4, 4), (128, 64, 2, 8, 4), (64, 64, 2, 4, 4), (64, 64, 2, 4, 4, False, True),
    ]],
}
SMOKE_CANDIDATES = {bm: [_cfg(16, 32, 1, 4, 1), _cfg(32, 64, 2, 4, 1), _cfg(16, 32, 3, 4, 1, True),
                         _cfg(16, 32, 2, 4, 2, tma=True), _cfg(32, 32, 3, 4, 2, True, True)] for bm in CANDIDATES}


def fits_smem(cfg: LinearConfig, m: int, shape: Shape) -> bool:
    """Whether the pipelined x and W tiles fit: num_stages buffers of each on the wgmma path (swapped, or 64+
    rows), num_stages - 1 on the mma path (as Triton 3.9 compiles them for sm_90)."""
    bm = block_m_for(m)
    block_k = min(cfg.block_k, triton.next_power_of_2(shape.k))
    buffers = cfg.num_stages if cfg.swap_ab or bm >= 64 else cfg.num_stages - 1
    return buffers * block_k * (cfg.block_n + bm) * DTYPE.itemsize <= SMEM_BYTES


def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).mul_(scale).to(DTYPE)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def time_per_call(calls: list[Callable[[], object]]) -> float:
    """Microseconds per call: on CUDA the median of REPLAYS replays of one graph of all the calls."""
    for call in calls:  # compile and warm up outside the capture
        call()
    if not CUDA:
        began = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - began) / len(calls) * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    events = []
    for i in range(REPLAYS + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        if i >= 3:
            events.append((start, end))
    torch.cuda.synchronize()
    us = statistics.median(s.elapsed_time(e) for s, e in events) * 1e3 / len(calls)
    del graph
    return us


@dataclass
class Row:
    shape: str
    m: int
    n: int
    k: int
    floor_us: float
    cublas_us: float = math.nan
    triton_us: float = math.inf
    config: dict | None = None
    tried: int = 0
    failed: int = 0
    error: str = ""

    @property
    def speedup(self) -> float:
        return self.cublas_us / self.triton_us if math.isfinite(self.triton_us) else math.nan

    def pct(self, us: float) -> float:
        return 100 * self.floor_us / us if math.isfinite(us) else math.nan


class Case:
    """One (shape, M): distinct W copies cycled over a graph's calls, a static x, y and split-K workspace."""

    def __init__(self, shape: Shape, m: int, weights: list[torch.Tensor], workspace: LinearWorkspace,
                 bandwidth: float) -> None:
        self.shape, self.m, self.weights, self.workspace = shape, m, weights, workspace
        self.x = rand(m, shape.k)
        self.y = torch.empty(m, shape.n, dtype=DTYPE, device=DEVICE)
        self.calls = len(weights) * -(-MIN_CALLS // len(weights)) if CUDA else len(weights)
        nbytes = (shape.n * shape.k + m * shape.k + m * shape.n) * DTYPE.itemsize
        self.row = Row(shape.name, m, shape.n, shape.k, nbytes / bandwidth * 1e6)

    def cycled(self) -> list[torch.Tensor]:
        """The weight of each call in the graph: the copies in turn, so no call finds its W in L2."""
        return [self.weights[i % len(self.weights)] for i in range(self.calls)]

    def cublas(self) -> None:
        self.row.cublas_us = time_per_call([partial(F.linear, self.x, w) for w in self.cycled()])

    def triton(self, cfg: LinearConfig, log: list) -> None:
        entry = {"shape": self.shape.name, "m": self.m, "config": asdict(cfg)}
        self.row.tried += 1
        try:
            began = time.monotonic()
            y = skinny_linear(self.x, self.weights[0], out=self.y, config=cfg, workspace=self.workspace)
            entry["first_call_s"] = time.monotonic() - began  # compiling, or loading a precompiled kernel
            err = rel_err(y, F.linear(self.x, self.weights[0]))
            entry["rel_err"] = err
            if not err <= MAX_REL_ERR:
                raise AssertionError(f"rel err {err:.3g} against cuBLAS")
            us = time_per_call([partial(skinny_linear, self.x, w, out=self.y, config=cfg, workspace=self.workspace)
                                for w in self.cycled()])
            entry["us"] = us
            if us < self.row.triton_us:
                self.row.triton_us, self.row.config = us, asdict(cfg)
        except Exception as exc:  # noqa: BLE001 - one broken candidate must not lose the table
            self.row.failed += 1
            entry["error"] = "".join(traceback.format_exception_only(exc))[-400:]
            self.row.error = entry["error"].strip().splitlines()[-1][:120]
        log.append(entry)


@dataclass(frozen=True)
class Job:
    """One kernel to compile: a launch of `config` at M rows and depth K, with PDL or not."""

    m: int
    k: int
    config: LinearConfig
    use_pdl: bool = False


def warm_kernels(jobs: list[Job]) -> int:
    """In a worker process: launch each job once on a stand-in W of 256 rows and the job's K (N, K, strides and
    sizes specialize as the Llama ones do; K sets the split and prefetch depth), so the compiled kernels land
    in Triton's on-disk cache and the timed process only loads them. Returns how many launched."""
    n = 256 if CUDA else 32
    weights = {k: torch.zeros(n, k, dtype=DTYPE, device=DEVICE) for k in {job.k for job in jobs}}
    workspace = LinearWorkspace.create(max(job.m for job in jobs), n, linear_tuning.MAX_SPLIT_K, DEVICE)

    def launches(job: Job) -> bool:
        try:
            skinny_linear(torch.zeros(job.m, job.k, dtype=DTYPE, device=DEVICE), weights[job.k], config=job.config,
                          workspace=workspace, use_pdl=job.use_pdl)
        except Exception:  # noqa: BLE001 - the timed run meets and reports the same error
            return False
        return True

    launched = sum(launches(job) for job in jobs)
    if CUDA:
        torch.cuda.synchronize()
    return launched


def compile_key(job: Job) -> tuple:
    """What a compiled kernel depends on: the tile height, the config, PDL, and through K the split count, the
    prefetch depth and whether K blocks divide K."""
    block_k = max(16, min(job.config.block_k, triton.next_power_of_2(job.k)))
    blocks = triton.cdiv(job.k, block_k)
    per_split = triton.cdiv(blocks, job.config.split_k)
    prefetch = min(per_split, job.config.prefetch) if job.use_pdl else 0
    return block_m_for(job.m), job.config, job.use_pdl, triton.cdiv(blocks, per_split), prefetch, job.k % block_k == 0


def precompile(jobs: list[Job], workers: int, what: str) -> None:
    """Compile each distinct kernel once in `workers` processes at a time (compiling dominates the run
    otherwise); a failure here only means the timed run compiles for itself."""
    jobs = list({compile_key(job): job for job in jobs}.values())
    if workers <= 0 or not jobs:
        return
    workers = min(workers, len(jobs))
    began = time.monotonic()
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            launched = sum(pool.map(warm_kernels, [jobs[i::workers] for i in range(workers)]))
    except Exception as exc:  # noqa: BLE001 - see above
        print(f"  precompile failed ({exc}); compiling as the kernels run", flush=True)
        return
    print(f"  precompiled {launched} of {len(jobs)} {what} kernels in {workers} processes in "
          f"{time.monotonic() - began:.0f} s", flush=True)


def candidates_for(case: Case, pool: dict[int, list[LinearConfig]]) -> list[LinearConfig]:
    """The shape's default config first, then the pool, without repeats or configs past shared memory."""
    default = linear_tuning.default_config(case.m, case.shape.n, case.shape.k, multiprocessor_count(DEVICE))
    out = []
    for cfg in [default, *pool[block_m_for(case.m)]]:
        if cfg not in out and (not CUDA or fits_smem(cfg, case.m, case.shape)):
            out.append(cfg)
    return out


# ---------------------------------------------------------------- chain: a decoder layer's kernels in one graph


@dataclass(frozen=True)
class Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    @property
    def qkv(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim


LLAMA3_8B_DIMS = Dims(4096, HEADS, KV_HEADS, HEAD_DIM, 14336)
SMOKE_DIMS = Dims(64, SMOKE_HEADS, SMOKE_KV_HEADS, SMOKE_HEAD_DIM, 80)
EPS = 1e-5
GEMMS = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class Variant:
    """How the chain's GEMMs run: cuBLAS, or the Triton linear with PDL (and its prefetch) or not."""

    name: str
    triton: bool
    use_pdl: bool = False
    prefetch: bool = True


VARIANTS = (Variant("cublas", False), Variant("triton", True), Variant("triton_pdl", True, True),
            Variant("triton_pdl_no_prefetch", True, True, False))
VARIANTS_NAMES = [v.name for v in VARIANTS]


class LayerChain:
    """One layer's weights (shared by every layer of the graph: 436 MB at Llama-3-8B widths, so each GEMM still
    reads its W from HBM), the static input and the GEMMs' outputs and workspace, for M rows."""

    def __init__(self, dims: Dims, m: int, layers: int) -> None:
        self.dims, self.m, self.layers = dims, m, layers
        d = dims
        self.weights = {"qkv": rand(d.qkv, d.hidden, scale=d.hidden ** -0.5),
                        "o": rand(d.hidden, d.heads * d.head_dim, scale=(d.heads * d.head_dim) ** -0.5),
                        "gate_up": rand(2 * d.intermediate, d.hidden, scale=d.hidden ** -0.5),
                        "down": rand(d.hidden, d.intermediate, scale=d.intermediate ** -0.5)}
        self.norms = [torch.ones(d.hidden, device=DEVICE).add_(rand(d.hidden, scale=0.1)).to(DTYPE) for _ in range(2)]
        self.x = rand(m, d.hidden)
        self.outs = {name: torch.empty(m, w.shape[0], dtype=DTYPE, device=DEVICE) for name, w in self.weights.items()}
        positions = torch.randint(0, 4096, (m,), device=DEVICE)
        angles = positions.double()[:, None] * 500000.0 ** (-torch.arange(0, d.head_dim, 2, device=DEVICE) / d.head_dim)
        self.cos = torch.cat([angles.cos()] * 2, dim=1).float()  # per row: the tables indexed by position `row`
        self.sin = torch.cat([angles.sin()] * 2, dim=1).float()
        self.positions = torch.arange(m, device=DEVICE)
        self.slots = torch.arange(m, device=DEVICE)
        self.k_cache = torch.zeros(m, 1, d.kv_heads, d.head_dim, dtype=DTYPE, device=DEVICE)
        self.v_cache = torch.zeros_like(self.k_cache)
        max_n = max(w.shape[0] for w in self.weights.values())
        self.workspace = LinearWorkspace.create(m, max_n, linear_tuning.MAX_SPLIT_K, DEVICE)
        self.configs: dict[str, LinearConfig] = {}
        self.output = torch.empty(m, d.hidden, dtype=DTYPE, device=DEVICE)

    def floor_us(self, bandwidth: float) -> float:
        """A layer's GEMM bytes (W, x, y) at the copy bandwidth."""
        nbytes = sum(w.numel() + self.m * (w.shape[0] + w.shape[1]) for w in self.weights.values())
        return nbytes * DTYPE.itemsize / bandwidth * 1e6

    def gemm(self, variant: Variant, name: str, x: torch.Tensor) -> torch.Tensor:
        w = self.weights[name]
        if not variant.triton:
            return F.linear(x, w)
        config = self.configs[name] if variant.prefetch else replace(self.configs[name], prefetch=0)
        return skinny_linear(x, w, out=self.outs[name], workspace=self.workspace, config=config,
                             use_pdl=variant.use_pdl)

    def run(self, variant: Variant) -> None:
        """`layers` decoder layers (attention left out: o reads the rotated q); the last one's output to
        `self.output`."""
        d, m = self.dims, self.m
        hidden, residual = self.x, None
        for _ in range(self.layers):
            normed, residual = fused_triton.add_rms_norm(hidden, residual, self.norms[0], EPS)
            qkv = self.gemm(variant, "qkv", normed)
            q, k, v = qkv.split([d.heads * d.head_dim, d.kv_heads * d.head_dim, d.kv_heads * d.head_dim], dim=1)
            q = q.view(m, d.heads, d.head_dim)
            fused_triton.rotary_and_write_kv(q, k.view(m, d.kv_heads, d.head_dim), v.view(m, d.kv_heads, d.head_dim),
                                             self.cos, self.sin, self.positions, self.k_cache, self.v_cache,
                                             self.slots)
            o = self.gemm(variant, "o", q.view(m, d.heads * d.head_dim))
            normed, residual = fused_triton.add_rms_norm(o, residual, self.norms[1], EPS)
            gate_up = self.gemm(variant, "gate_up", normed)
            hidden = self.gemm(variant, "down", fused_triton.silu_and_mul(gate_up))
        self.output.copy_(hidden)

    def reference(self) -> torch.Tensor:
        """The same layers on float64 copies of x and the weights (the torch ops: float32 inside the norm and
        the rotation)."""
        d, m = self.dims, self.m
        w = {name: t.double() for name, t in self.weights.items()}
        norms = [t.double() for t in self.norms]
        hidden, residual = self.x.double(), None
        for _ in range(self.layers):
            normed, residual = fused_torch.add_rms_norm(hidden, residual, norms[0], EPS)
            qkv = normed @ w["qkv"].T
            q, k, _ = qkv.split([d.heads * d.head_dim, d.kv_heads * d.head_dim, d.kv_heads * d.head_dim], dim=1)
            q, _ = fused_torch.rotary(q.reshape(m, d.heads, d.head_dim), k.reshape(m, d.kv_heads, d.head_dim),
                                      self.cos.double(), self.sin.double(), self.positions)
            normed, residual = fused_torch.add_rms_norm(q.reshape(m, -1) @ w["o"].T, residual, norms[1], EPS)
            hidden = fused_torch.silu_and_mul(normed @ w["gate_up"].T) @ w["down"].T
        return hidden


@dataclass
class ChainRow:
    m: int
    layers: int
    floor_us: float
    us: dict[str, float]
    rel_err: dict[str, float]
    error: dict[str, str]
    configs: dict[str, dict]


def time_graph_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """The median of `replays` CUDA-event timed replays, after three untimed ones."""
    events = []
    for i in range(replays + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        if i >= 3:
            events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3


def chain_variant(chain: LayerChain, variant: Variant, replays: int) -> tuple[float, float]:
    """(µs per layer, worst rel err of two fresh inputs against float64) of one variant: eager on the CPU
    (the interpreter), replays of one captured graph on CUDA."""
    run = partial(chain.run, variant)
    run()  # compiles, outside any capture
    graph = None
    if CUDA:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
    err = 0.0
    for _ in range(2):
        chain.x.copy_(rand(*chain.x.shape))
        for t in (chain.output, *chain.outs.values()):
            t.fill_(float("nan"))
        graph.replay() if graph is not None else run()
        err = max(err, rel_err(chain.output, chain.reference()))
        if chain.workspace.counters.any():
            raise AssertionError("split-K counters left nonzero")
    if graph is None:
        began = time.perf_counter()
        run()
        return (time.perf_counter() - began) * 1e6 / chain.layers, err
    us = time_graph_us(graph, replays) / chain.layers
    del graph
    return us, err


def run_chain(dims: Dims, batches: tuple[int, ...], layers: int, replays: int, bandwidth: float,
              best: dict[tuple[str, int], LinearConfig]) -> list[ChainRow]:
    """Every variant of the chain at every batch, each GEMM with the sweep's best config for its shape and M
    (`best`) or the tuned/default one."""
    rows = []
    for m in batches:
        chain = LayerChain(dims, m, layers)
        for name, w in chain.weights.items():
            chain.configs[name] = best.get((name, m)) or linear_tuning.choose_config(
                m, w.shape[0], w.shape[1], multiprocessor_count(DEVICE))
        row = ChainRow(m, layers, chain.floor_us(bandwidth), {}, {}, {},
                       {name: asdict(c) for name, c in chain.configs.items()})
        for variant in VARIANTS:
            try:
                row.us[variant.name], row.rel_err[variant.name] = chain_variant(chain, variant, replays)
            except Exception as exc:  # noqa: BLE001 - one broken variant must not lose the others
                row.error[variant.name] = "".join(traceback.format_exception_only(exc)).strip()[-300:]
            print(f"  chain M={m} {variant.name}: {fmt(row.us.get(variant.name, math.nan))} us/layer, rel err "
                  f"{row.rel_err.get(variant.name, math.nan):.2g} {row.error.get(variant.name, '')}", flush=True)
        rows.append(row)
        del chain
    return rows


def chain_jobs(dims: Dims, batches: tuple[int, ...], best: dict[tuple[str, int], LinearConfig]) -> list[Job]:
    """The chain's Triton kernels: per GEMM and batch its config plain, with PDL, and with PDL but no prefetch."""
    shapes = {"qkv": (dims.qkv, dims.hidden), "o": (dims.hidden, dims.heads * dims.head_dim),
              "gate_up": (2 * dims.intermediate, dims.hidden), "down": (dims.hidden, dims.intermediate)}
    jobs = []
    for m in batches:
        for name, (n, k) in shapes.items():
            cfg = best.get((name, m)) or linear_tuning.choose_config(m, n, k, multiprocessor_count(DEVICE))
            jobs += [Job(m, k, cfg), Job(m, k, cfg, True), Job(m, k, replace(cfg, prefetch=0), True)]
    return jobs


# ---------------------------------------------------------------- compile only (no GPU needed)

H200 = GPUTarget("cuda", 90, 32)
H200_SMS = 132
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def pdl_order(ptx: str, prefetch: bool) -> str:
    """'' when the PTX keeps PDL's order: the L2 prefetches of W (if `prefetch`) and no global load before
    griddepcontrol.wait, and griddepcontrol.launch_dependents after the last MMA of the K loop; else what is
    wrong."""
    lines = [line.strip() for line in ptx[ptx.index(".entry"):].splitlines()]
    at = {name: [i for i, line in enumerate(lines) if re.match(rf"(@!?%p\d+\s+)?{pattern}", line)]
          for name, pattern in [("wait", r"griddepcontrol\.wait"), ("dependents", r"griddepcontrol\.launch_dependents"),
                                ("prefetch", r"prefetch\.global\.L2"), ("load", r"(ld\.global|cp\.async)"),
                                ("mma", r"(wgmma\.mma_async|mma\.sync)")]}
    if len(at["wait"]) != 1 or len(at["dependents"]) != 1:
        return f"{len(at['wait'])} waits and {len(at['dependents'])} launch_dependents"
    wait, dependents = at["wait"][0], at["dependents"][0]
    problems = []
    if prefetch and not at["prefetch"]:
        problems.append("no prefetch before the wait")
    if any(i > wait for i in at["prefetch"]) or (at["prefetch"] and not prefetch):
        problems.append("a prefetch after the wait or not asked for")
    if any(i < wait for i in at["load"]):
        problems.append("a load before the wait")
    if at["mma"] and dependents < max(at["mma"]):
        problems.append("launch_dependents before the last MMA")
    return ", ".join(problems)


def compile_sm90(job: Job) -> dict:
    """Compile the kernel for sm_90 as `skinny_linear` would launch this job (16-divisible pointers, N, K and
    strides), and report its shared memory, registers, spill stack and, with PDL, the PTX order."""
    cfg = job.config
    split = cfg.split_k > 1
    outputs = ["*bf16", "*fp32" if split else "*bf16", "*i32" if split else "*bf16"]
    _, _, _, split_k, prefetch, even_k = compile_key(job)
    block_m, block_k = block_m_for(job.m), max(16, min(cfg.block_k, triton.next_power_of_2(job.k)))
    line_elems = min(block_k, linear_triton.L2_LINE_BYTES // DTYPE.itemsize)
    constants = {"BLOCK_M": block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": block_k, "SPLIT_K": split_k,
                 "SWAP_AB": cfg.swap_ab, "DOT_F32": False, "LINES": block_k // line_elems, "LINE_ELEMS": line_elems,
                 "PREFETCH": prefetch, "USE_PDL": job.use_pdl}
    if cfg.tma:
        kernel = linear_triton._linear_tma_kernel
        types = [f"tensordesc<bf16[{block_m},{block_k}]>", f"tensordesc<bf16[{cfg.block_n},{block_k}]>", "*bf16",
                 *outputs] + ["i32"] * 7
    else:
        kernel = linear_triton._linear_kernel
        types = ["*bf16", "*bf16", *outputs] + ["i32"] * 8
        constants["EVEN_K"] = even_k
    names = kernel.arg_names
    signature = dict(zip(names, types)) | {name: "constexpr" for name in constants}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(zip(names, types))
             if name != "M" and not ty.startswith("tensordesc")}
    row = {"block_m": block_m, "even_k": even_k, "split_k": split_k, "use_pdl": job.use_pdl, "config": asdict(cfg)}
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages} | ({"launch_pdl": True} if job.use_pdl else {})
    try:
        compiled = triton.compile(ASTSource(kernel, signature, constants, attrs), target=H200, options=options)
    except Exception as exc:  # noqa: BLE001 - reported, and the run fails
        return row | {"error": str(exc).strip().splitlines()[-1][:200]}
    ptx = compiled.asm["ptx"]
    row |= {"shared": compiled.metadata.shared, "wgmma": "wgmma" in ptx}
    if job.use_pdl:
        row["pdl_order"] = pdl_order(ptx, prefetch > 0)
    elif "griddepcontrol" in ptx or "prefetch.global" in ptx:
        row["pdl_order"] = "griddepcontrol or prefetch without PDL"
    if CUOBJDUMP.exists():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            usage = subprocess.run([str(CUOBJDUMP), "-res-usage", cubin.name], capture_output=True, text=True,
                                   check=False).stdout
        found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
        if found:
            row |= {"registers": int(found[1]), "stack": int(found[2])}
    return row


def compile_only(shapes: tuple[Shape, ...], batches: tuple[int, ...], pool: dict[int, list[LinearConfig]]) -> bool:
    """Compile every candidate (and default) config for sm_90 in parallel, plain, with PDL, and with PDL without
    the prefetch; True when all compile, fit and keep PDL's order."""
    jobs = {}
    for shape in shapes:
        for m in batches:
            for cfg in [linear_tuning.default_config(m, shape.n, shape.k, H200_SMS), *pool[block_m_for(m)]]:
                for job in (Job(m, shape.k, cfg), Job(m, shape.k, cfg, True),
                            Job(m, shape.k, replace(cfg, prefetch=0), True)):
                    jobs.setdefault(compile_key(job), job)
    ok = True
    with ProcessPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool_:
        for row in pool_.map(compile_sm90, jobs.values()):
            bad = "error" in row or row["shared"] > SMEM_BYTES or bool(row.get("pdl_order"))
            ok &= not bad
            detail = row.get("error") or (f"smem {row['shared'] >> 10} KiB, {'wgmma' if row['wgmma'] else 'mma'}, "
                                          f"regs {row.get('registers', '?')}, stack {row.get('stack', '?')}"
                                          + (f", PDL order: {row['pdl_order'] or 'ok'}" if "pdl_order" in row else ""))
            print(f"{'FAIL' if bad else 'ok  '} block_m {row['block_m']:3d} even_k {row['even_k']:d} "
                  f"split {row['split_k']} pdl {row['use_pdl']:d} {cfg_text(row['config'])}: {detail}", flush=True)
    print(f"{len(jobs)} kernels compiled for sm_90 by Triton {triton.__version__}: "
          f"{'all fit and keep the PDL order' if ok else 'some FAILED'}")
    return ok


# ---------------------------------------------------------------- report


def fmt(v: float, digits: int = 1) -> str:
    return "-" if math.isnan(v) or math.isinf(v) else f"{v:.{digits}f}"


def cfg_text(cfg: dict | None) -> str:
    if cfg is None:
        return "-"
    text = f"n{cfg['block_n']} k{cfg['block_k']} s{cfg['split_k']} w{cfg['num_warps']} st{cfg['num_stages']}"
    return text + (" swap" if cfg["swap_ab"] else "") + (" tma" if cfg["tma"] else "") + f" pf{cfg['prefetch']}"


def chain_markdown(rows: list[ChainRow]) -> list[str]:
    names = [v.name for v in VARIANTS]
    out = ["", (f"Decoder-layer chain ({rows[0].layers} layers per graph; small ops: fused Triton kernels"
                f"{', launched with PDL' if small_ops_pdl() else ''}): µs per layer, median of replays, L2 not "
                "flushed (a layer's weights are 9x the L2); rel err of the last layer's output against float64."), "",
           "| M | GEMM floor µs | " + " | ".join(f"{n} µs" for n in names) + " | PDL saves µs | "
           + " | ".join(f"{n} err" for n in names) + " |", "|---" * (3 + 2 * len(names)) + "|"]
    for r in rows:
        saved = r.us.get("triton", math.nan) - r.us.get("triton_pdl", math.nan)
        out.append(f"| {r.m} | {fmt(r.floor_us)} | " + " | ".join(fmt(r.us.get(n, math.nan)) for n in names)
                   + f" | {fmt(saved)} | " + " | ".join(fmt(r.rel_err.get(n, math.nan) * 100, 2) + "%" for n in names)
                   + " |")
    out += ["", "Chain configs per M: " + "; ".join(
        f"M={r.m}: " + ", ".join(f"{g} {cfg_text(c)}" for g, c in r.configs.items()) for r in rows)]
    errors = [f"- chain M={r.m} {n}: {e}" for r in rows for n, e in r.error.items()]
    return out + (["", "Chain errors:", *errors] if errors else [])


def markdown(rows: list[Row], chain: list[ChainRow], meta: dict) -> str:
    out = [
        (f"Device: {meta['device']}; copy bandwidth {meta['bandwidth_gbs']:.0f} GB/s; torch {meta['torch']}, "
         f"triton {meta['triton']}; bf16; {meta['elapsed_s']:.0f} s, budget {meta['budget_s']:.0f} s."),
    ]
    if chain:
        out += chain_markdown(chain)
    if not rows:
        return "\n".join(out)
    out += [
        "",
        "Sweep. Floor: W + x + y bytes at the copy bandwidth; per call, W from HBM.",
        "",
        ("| linear | M | N | K | floor µs | cuBLAS µs | cuBLAS % floor | Triton µs | Triton % floor | speed-up "
         "| best config | tried (failed) |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r.shape} | {r.m} | {r.n} | {r.k} | {fmt(r.floor_us)} | {fmt(r.cublas_us)} | {fmt(r.pct(r.cublas_us), 0)} "
            f"| {fmt(r.triton_us)} | {fmt(r.pct(r.triton_us), 0)} | {fmt(r.speedup, 2)} | {cfg_text(r.config)} "
            f"| {r.tried} ({r.failed}) |"
        )
    out += ["", "Per decoder layer (the four linears; Triton where it wins by the table's margin):", "",
            "| M | cuBLAS µs | with Triton µs | saved µs | saved per 32-layer step µs |", "|---|---|---|---|---|"]
    for m in sorted({r.m for r in rows}):
        layer = [r for r in rows if r.m == m]
        cublas = sum(r.cublas_us for r in layer)
        mixed = sum(r.triton_us if r.speedup >= MIN_SPEEDUP else r.cublas_us for r in layer)
        out.append(f"| {m} | {fmt(cublas)} | {fmt(mixed)} | {fmt(cublas - mixed)} | {fmt(32 * (cublas - mixed))} |")
    errors = [r for r in rows if r.error]
    if errors:
        out += ["", "Last error per row:"] + [f"- {r.shape} M={r.m}: {r.error}" for r in errors]
    return "\n".join(out)


def table_source(rows: list[Row]) -> str:
    """The winners as the `_TUNED` literal of kernels/linear_tuning.py: entries where Triton beat cuBLAS by
    MIN_SPEEDUP, the others as comments."""
    lines = ["_TUNED: dict[tuple[int, int, int], LinearConfig] = {"]
    for r in rows:
        bucket = linear_tuning.m_bucket(r.m)
        if r.config is None or bucket is None:
            continue
        entry = (f"({bucket}, {r.n}, {r.k}): {LinearConfig(**r.config)!r},  # {r.shape}: cuBLAS {r.cublas_us:.1f} us, "
                 f"Triton {r.triton_us:.1f} us")
        lines.append(f"    {entry}" if r.speedup >= MIN_SPEEDUP else f"    # cuBLAS wins: {entry}")
    return "\n".join(lines + ["}"])


def finite(value: object) -> object:
    """JSON-safe: non-finite floats become null, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def write(out_dir: Path | None, rows: list[Row], chain: list[ChainRow], meta: dict, log: list) -> None:
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "chain": [asdict(r) for r in chain],
            "rows": [asdict(r) | {"speedup": r.speedup} for r in rows], "candidates": log, "table": table_source(rows)}
    (out_dir / "skinny_gemm.json").write_text(json.dumps(finite(data), indent=1))
    (out_dir / "skinny_gemm.md").write_text(markdown(rows, chain, meta) + "\n")


# ---------------------------------------------------------------- main


def sweep(shapes: tuple[Shape, ...], batches: tuple[int, ...], pool: dict[int, list[LinearConfig]], bandwidth: float,
          args: argparse.Namespace, began: float, report: Callable[[list[Row], list], None]) -> tuple[list[Row], list]:
    """cuBLAS and the candidates per (shape, M), round-robin until the budget; returns the rows and the log."""
    cases = []
    for shape in shapes:
        w_bytes = shape.n * shape.k * DTYPE.itemsize
        copies = max(2, -(-WEIGHT_SET_BYTES // w_bytes)) if CUDA else 2
        weights = [rand(shape.n, shape.k, scale=shape.k ** -0.5) for _ in range(copies)]
        max_split = max(linear_tuning.MAX_SPLIT_K, *(c.split_k for cs in pool.values() for c in cs))
        workspace = LinearWorkspace.create(max(batches), shape.n, max_split, DEVICE)
        cases += [Case(shape, m, weights, workspace, bandwidth) for m in batches]
    log: list = []
    for case in cases:
        case.cublas()
        print(f"  cuBLAS {case.shape.name} M={case.m}: {case.row.cublas_us:.1f} us "
              f"(floor {case.row.floor_us:.1f} us)", flush=True)
    rows = [case.row for case in cases]
    queues = {id(case): candidates_for(case, pool)[:args.candidates] for case in cases}
    precompile([Job(case.m, case.shape.k, cfg) for case in cases for cfg in queues[id(case)]], args.jobs, "sweep")
    for rank in range(max(len(q) for q in queues.values())):
        for case in cases:
            queue = queues[id(case)]
            if rank >= len(queue) or time.monotonic() - began > args.budget_s:
                continue
            case.triton(queue[rank], log)
            last = log[-1]
            print(f"  {case.shape.name} M={case.m} {cfg_text(last['config'])}: {fmt(last.get('us', math.nan))} us "
                  f"(first call {last.get('first_call_s', math.nan):.2f} s)"
                  f"{'  ' + last['error'].strip()[-100:] if 'error' in last else ''}", flush=True)
        report(rows, log)
    for case in cases:  # the sweep's weights go before the chain's
        case.weights.clear()
    return rows, log


def small_ops_pdl() -> bool:
    """Whether the fused ops launch with PDL here (`kernels.device.use_pdl`, where the tree has it)."""
    from kernels import device

    use_pdl = getattr(device, "use_pdl", None)
    return bool(use_pdl is not None and use_pdl(DEVICE))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--budget-s", type=float, default=60.0,
                        help="start no new sweep candidate past this many seconds from the start")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and configs (a CPU runs them interpreted)")
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes M (default: 16 64 128; smoke: 1 5 33)")
    parser.add_argument("--candidates", type=int, default=6, help="sweep candidates per shape and M, best first")
    parser.add_argument("--chain-only", action="store_true", help="no sweep: the chain with the default configs")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers in the chain's graph")
    parser.add_argument("--replays", type=int, default=30, help="timed replays of each graph")
    parser.add_argument("--jobs", type=int, default=max(1, min(14, (os.cpu_count() or 1) - 2)),
                        help="processes compiling the kernels ahead of timing (0: compile as they run)")
    parser.add_argument("--compile-only", action="store_true",
                        help="only compile every candidate for sm_90 (plain and with PDL) and report shared memory, "
                             "registers and the PTX order; no GPU needed")
    args = parser.parse_args()
    began = time.monotonic()
    torch.manual_seed(0)
    shapes, pool, dims = (SMOKE_SHAPES, SMOKE_CANDIDATES, SMOKE_DIMS) if args.smoke else \
        (LLAMA3_8B, CANDIDATES, LLAMA3_8B_DIMS)
    batches = tuple(args.batches or (SMOKE_BATCHES if args.smoke else BATCHES))
    if args.compile_only:
        sys.exit(0 if compile_only(shapes, batches, pool) else 1)
    bandwidth = measure_bandwidth(DEVICE)
    meta = {"device": torch.cuda.get_device_name() if CUDA else "cpu (Triton interpreter)",
            "bandwidth_gbs": bandwidth / 1e9, "torch": torch.__version__, "triton": triton.__version__,
            "budget_s": args.budget_s, "elapsed_s": 0.0, "smoke": args.smoke, "layers": args.layers,
            "replays": args.replays, "small_ops_pdl": small_ops_pdl(), "l2_flushed": False}
    print(f"{meta['device']}: copy bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)

    def report(rows: list[Row], chain: list[ChainRow], log: list) -> None:
        meta["elapsed_s"] = time.monotonic() - began
        write(args.out, rows, chain, meta, log)

    rows, log = [], []
    if not args.chain_only:
        rows, log = sweep(shapes, batches, pool, bandwidth, args, began, lambda r, lg: report(r, [], lg))
    best = {(r.shape, r.m): LinearConfig(**r.config) for r in rows if r.config is not None}
    precompile(chain_jobs(dims, batches, best), args.jobs, "chain")
    chain = run_chain(dims, batches, args.layers, args.replays, bandwidth, best)
    report(rows, chain, log)
    print()
    print(markdown(rows, chain, meta))
    if rows:
        print()
        print(table_source(rows))
    failed = [n for r in chain for n in VARIANTS_NAMES if n in r.error or not r.rel_err.get(n, 0) <= CHAIN_MAX_REL_ERR]
    if failed:
        print(f"chain variants failed or off float64 by more than {CHAIN_MAX_REL_ERR}: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    main()
