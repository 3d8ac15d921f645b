"""Skinny GEMM `y = x @ W^T` at Llama-3-8B decode shapes: cuBLAS (`F.linear`) against Triton configs.

For each layer linear (qkv, o, gate_up, down) and batch M it times cuBLAS and candidate
`kernels.linear_triton` configs, each checked once against cuBLAS (bf16 rel err <= 1e-2).
Weights come from HBM as in a 32-layer step, not from the 50 MB L2: one CUDA graph holds a
sequence of calls cycling over distinct copies of W (more than 256 MB in all) and the replay
time, a median of CUDA-event timings, is divided by the number of calls. The floor is W + x + y
bytes over the bandwidth of a 2 GiB device-to-device copy measured in the same run.

Compiling dominates the run, so `--jobs` processes first compile every candidate into Triton's
on-disk cache (one compile per tile height; the timed launches then only load them). Candidates
run round-robin (every shape and batch gets the first candidate before any gets the second) and
no new one starts past `--budget-s`, so a short budget still covers every row.
Results go to DIR/skinny_gemm.json and DIR/skinny_gemm.md after every round, with a per-layer
sum (cuBLAS alone against Triton where it wins); the winners that beat cuBLAS are printed last
as the `_TUNED` literal of `kernels/linear_tuning.py`.

    python benchmarks/skinny_gemm.py --out DIR [--budget-s 150]
    python benchmarks/skinny_gemm.py --smoke --out DIR   # tiny shapes; without CUDA, under the Triton interpreter
    python benchmarks/skinny_gemm.py --compile-only      # every candidate compiled for sm_90; no GPU needed
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
from dataclasses import asdict, dataclass
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
from kernels import linear_triton, linear_tuning  # noqa: E402
from kernels.linear_triton import LinearWorkspace, block_m_for, linear  # noqa: E402
from kernels.linear_tuning import LinearConfig  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16
MAX_REL_ERR = 1e-2
WEIGHT_SET_BYTES = 320 << 20  # distinct W copies per graph: well past the 50 MB L2
MIN_CALLS = 16
REPLAYS = 20
SMEM_BYTES = 227 << 10  # H200 shared memory per block
MIN_SPEEDUP = 1.02  # below this a Triton win is within noise and cuBLAS stays


@dataclass(frozen=True)
class Shape:
    name: str
    k: int
    n: int


LLAMA3_8B = (Shape("qkv", 4096, 6144), Shape("o", 4096, 4096), Shape("gate_up", 4096, 28672),
             Shape("down", 14336, 4096))
BATCHES = (1, 16, 32, 64, 128)
SMOKE_SHAPES = (Shape("qkv", 96, 48), Shape("o", 64, 64), Shape("gate_up", 64, 160), Shape("down", 160, 64))
SMOKE_BATCHES = (1, 5, 33)


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
            y = linear(self.x, self.weights[0], self.y, config=cfg, workspace=self.workspace)
            entry["first_call_s"] = time.monotonic() - began  # compiling, or loading a precompiled kernel
            err = rel_err(y, F.linear(self.x, self.weights[0]))
            entry["rel_err"] = err
            if not err <= MAX_REL_ERR:
                raise AssertionError(f"rel err {err:.3g} against cuBLAS")
            us = time_per_call([partial(linear, self.x, w, self.y, config=cfg, workspace=self.workspace)
                                for w in self.cycled()])
            entry["us"] = us
            if us < self.row.triton_us:
                self.row.triton_us, self.row.config = us, asdict(cfg)
        except Exception as exc:  # noqa: BLE001 - one broken candidate must not lose the table
            self.row.failed += 1
            entry["error"] = "".join(traceback.format_exception_only(exc))[-400:]
            self.row.error = entry["error"].strip().splitlines()[-1][:120]
        log.append(entry)


def warm_kernels(jobs: list[tuple[int, LinearConfig]]) -> int:
    """In a worker process: launch each (M, config) once on stand-in shapes that specialize as the Llama ones
    do (N, K, strides and sizes divisible by 16; K a multiple of every K block), so the compiled kernels land
    in Triton's on-disk cache and the timed process only loads them. Returns how many launched."""
    n, k = (256, 1024) if CUDA else (32, 64)
    w = torch.zeros(n, k, dtype=DTYPE, device=DEVICE)
    workspace = LinearWorkspace.create(max(m for m, _ in jobs), n, linear_tuning.MAX_SPLIT_K, DEVICE)
    launched = 0
    for m, cfg in jobs:
        try:
            linear(torch.zeros(m, k, dtype=DTYPE, device=DEVICE), w, config=cfg, workspace=workspace)
            launched += 1
        except Exception:  # noqa: BLE001 - the timed run meets and reports the same error
            continue
    if CUDA:
        torch.cuda.synchronize()
    return launched


def precompile(cases: list[Case], queues: dict[int, list[LinearConfig]], workers: int) -> None:
    """Compile every candidate once per tile height in `workers` processes at a time (compiling dominates
    the run otherwise); a failure here only means the timed run compiles for itself."""
    jobs = list(dict.fromkeys((block_m_for(case.m), cfg) for case in cases for cfg in queues[id(case)]))
    began = time.monotonic()
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            launched = sum(pool.map(warm_kernels, [jobs[i::workers] for i in range(workers)]))
    except Exception as exc:  # noqa: BLE001 - see above
        print(f"  precompile failed ({exc}); compiling as the candidates run", flush=True)
        return
    print(f"  precompiled {launched} of {len(jobs)} kernels in {workers} processes in "
          f"{time.monotonic() - began:.0f} s", flush=True)


def candidates_for(case: Case, pool: dict[int, list[LinearConfig]]) -> list[LinearConfig]:
    """The shape's default config first, then the pool, without repeats or configs past shared memory."""
    default = linear_tuning.default_config(case.m, case.shape.n, case.shape.k)
    out = []
    for cfg in [default, *pool[block_m_for(case.m)]]:
        if cfg not in out and (not CUDA or fits_smem(cfg, case.m, case.shape)):
            out.append(cfg)
    return out


# ---------------------------------------------------------------- compile only (no GPU needed)

H200 = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def compile_sm90(job: tuple[int, int, LinearConfig]) -> dict:
    """Compile the kernel for sm_90 as a launch with these M, K and config would (16-divisible pointers,
    N, K and strides), and report its shared memory, registers and spill stack."""
    m, k, cfg = job
    split = cfg.split_k > 1
    outputs = ["*bf16", "*fp32" if split else "*bf16", "*i32" if split else "*bf16"]
    block_m, block_k = block_m_for(m), max(16, min(cfg.block_k, triton.next_power_of_2(k)))
    constants = {"BLOCK_M": block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": block_k, "SPLIT_K": cfg.split_k,
                 "SWAP_AB": cfg.swap_ab, "DOT_F32": False}
    if cfg.tma:
        kernel = linear_triton._linear_tma_kernel
        types = [f"tensordesc<bf16[{block_m},{block_k}]>", f"tensordesc<bf16[{cfg.block_n},{block_k}]>", *outputs]
        types += ["i32"] * 6
    else:
        kernel = linear_triton._linear_kernel
        types = ["*bf16", "*bf16", *outputs] + ["i32"] * 8
        constants["EVEN_K"] = k % block_k == 0
    names = kernel.arg_names
    signature = dict(zip(names, types)) | {name: "constexpr" for name in constants}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(zip(names, types))
             if name != "M" and not ty.startswith("tensordesc")}
    row = {"block_m": block_m, "even_k": k % block_k == 0, "config": asdict(cfg)}
    try:
        compiled = triton.compile(ASTSource(kernel, signature, constants, attrs), target=H200,
                                  options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    except Exception as exc:  # noqa: BLE001 - reported, and the run fails
        return row | {"error": str(exc).strip().splitlines()[-1][:200]}
    row |= {"shared": compiled.metadata.shared, "wgmma": "wgmma" in compiled.asm["ptx"]}
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
    """Compile every candidate (and default) config for sm_90 in parallel; True when all compile and fit."""
    jobs = {}
    for shape in shapes:
        for m in batches:
            for cfg in [linear_tuning.default_config(m, shape.n, shape.k), *pool[block_m_for(m)]]:
                block_k = max(16, min(cfg.block_k, triton.next_power_of_2(shape.k)))
                jobs.setdefault((block_m_for(m), shape.k % block_k == 0, cfg), (m, shape.k, cfg))
    ok = True
    with ProcessPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool_:
        for row in pool_.map(compile_sm90, jobs.values()):
            bad = "error" in row or row["shared"] > SMEM_BYTES
            ok &= not bad
            detail = row.get("error") or (f"smem {row['shared'] >> 10} KiB, {'wgmma' if row['wgmma'] else 'mma'}, "
                                          f"regs {row.get('registers', '?')}, stack {row.get('stack', '?')}")
            print(f"{'FAIL' if bad else 'ok  '} block_m {row['block_m']:3d} even_k {row['even_k']:d} "
                  f"{cfg_text(row['config'])}: {detail}", flush=True)
    print(f"{len(jobs)} kernels compiled for sm_90: {'all fit' if ok else 'some FAILED'}")
    return ok


# ---------------------------------------------------------------- report


def fmt(v: float, digits: int = 1) -> str:
    return "-" if math.isnan(v) or math.isinf(v) else f"{v:.{digits}f}"


def cfg_text(cfg: dict | None) -> str:
    if cfg is None:
        return "-"
    text = f"n{cfg['block_n']} k{cfg['block_k']} s{cfg['split_k']} w{cfg['num_warps']} st{cfg['num_stages']}"
    return text + (" swap" if cfg["swap_ab"] else "") + (" tma" if cfg["tma"] else "")


def markdown(rows: list[Row], meta: dict) -> str:
    out = [
        f"Device: {meta['device']}; copy bandwidth {meta['bandwidth_gbs']:.0f} GB/s; torch {meta['torch']}, "
        f"triton {meta['triton']}; bf16; {meta['elapsed_s']:.0f} s, budget {meta['budget_s']:.0f} s. "
        "Floor: W + x + y bytes at the copy bandwidth; per call, W from HBM.",
        "",
        "| linear | M | N | K | floor µs | cuBLAS µs | cuBLAS % floor | Triton µs | Triton % floor | speed-up "
        "| best config | tried (failed) |",
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


def write(out_dir: Path | None, rows: list[Row], meta: dict, log: list) -> None:
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "rows": [asdict(r) | {"speedup": r.speedup} for r in rows], "candidates": log,
            "table": table_source(rows)}
    (out_dir / "skinny_gemm.json").write_text(json.dumps(finite(data), indent=1))
    (out_dir / "skinny_gemm.md").write_text(markdown(rows, meta) + "\n")


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--budget-s", type=float, default=150.0, help="start no new candidate past this")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and configs (a CPU runs them interpreted)")
    parser.add_argument("--jobs", type=int, default=max(1, min(8, (os.cpu_count() or 1) - 2)),
                        help="processes compiling the candidates ahead of timing (0: compile as they run)")
    parser.add_argument("--compile-only", action="store_true",
                        help="only compile every candidate for sm_90 and report shared memory and registers; no GPU needed")
    args = parser.parse_args()
    began = time.monotonic()
    torch.manual_seed(0)
    shapes, batches, pool = (SMOKE_SHAPES, SMOKE_BATCHES, SMOKE_CANDIDATES) if args.smoke else \
        (LLAMA3_8B, BATCHES, CANDIDATES)
    if args.compile_only:
        sys.exit(0 if compile_only(shapes, batches, pool) else 1)
    bandwidth = measure_bandwidth(DEVICE)
    meta = {"device": torch.cuda.get_device_name() if CUDA else "cpu (Triton interpreter)",
            "bandwidth_gbs": bandwidth / 1e9, "torch": torch.__version__, "triton": triton.__version__,
            "budget_s": args.budget_s, "elapsed_s": 0.0, "smoke": args.smoke}
    print(f"{meta['device']}: copy bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)

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
    queues = {id(case): candidates_for(case, pool) for case in cases}
    if args.jobs > 0:
        precompile(cases, queues, args.jobs)
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
        meta["elapsed_s"] = time.monotonic() - began
        write(args.out, rows, meta, log)
    meta["elapsed_s"] = time.monotonic() - began
    write(args.out, rows, meta, log)
    print()
    print(markdown(rows, meta))
    print()
    print(table_source(rows))


if __name__ == "__main__":
    main()
