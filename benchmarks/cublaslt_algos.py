"""Every algorithm cuBLASLt's heuristic offers for a decode step's layer GEMMs, timed against torch's choice.

torch runs one algorithm per shape: cuBLAS's own pick, or cuBLASLt's first heuristic result when cuBLASLt is
preferred. At the decode step's skinny shapes (M = 32-128 rows against Llama-3-8B's 4096-28672-wide weights) the
qkv and o GEMMs run at 66-73% of their bytes floor (BENCHMARKS.md, "Eleventh session"). This asks whether another
algorithm the heuristic returns (other tiles, split-K, stages) is faster, through cuBLASLt's C API by ctypes
(torch does not expose the choice). Each GEMM is `y = x @ W^T` (x [M, K], W [N, K], bf16, float32 accumulation),
run over `--layers` distinct weights so that they come from HBM as in a step, captured in a CUDA graph and
replayed (`gemm_settings._time_us`). Each algorithm's y is checked against F.linear's.

    python3 benchmarks/cublaslt_algos.py --tokens 64 128 --out DIR
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accuracy import relative_error  # noqa: E402
from benchmarks.gemm_settings import GEMMS, _time_us, make_weights  # noqa: E402
from benchmarks.hbm import measure_bandwidth  # noqa: E402

CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF = 68, 0, 14
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE_BYTES = 1
# cublasLtMatmulAlgoConfigAttributes_t: the fields that tell algorithms apart
ALGO_FIELDS = {"id": 0, "tile": 1, "split_k": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6,
               "inner_shape": 7, "cluster_shape": 8}
WORKSPACE_BYTES = 32 << 20


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_cublaslt() -> ctypes.CDLL:
    """The libcublasLt of torch's CUDA major version (from the nvidia wheels beside torch, else the system's)."""
    major = torch.version.cuda.split(".")[0]
    found = []
    for root in sys.path:
        found += glob.glob(os.path.join(root, "nvidia", "**", f"libcublasLt.so.{major}*"), recursive=True)
    for path in [*sorted(found), f"libcublasLt.so.{major}", "libcublasLt.so"]:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise OSError(f"no libcublasLt.so.{major} found")


class CublasLt:
    """The few cuBLASLt calls a row-major `x @ W^T` needs, as cuBLAS's column-major `y^T = W x^T` (A = W transposed)."""

    def __init__(self) -> None:
        self.lib = load_cublaslt()
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _check(status: int, call: str) -> None:
        if status != 0:
            raise RuntimeError(f"{call} returned cuBLAS status {status}")

    def _layout(self, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), CUDA_R_16BF, ctypes.c_uint64(rows),
                                                        ctypes.c_uint64(cols), ctypes.c_int64(ld)),
                    "cublasLtMatrixLayoutCreate")
        return layout

    def problem(self, m: int, n: int, k: int) -> tuple:
        """(matmul desc, A, B, C/D layouts) for x [m, k] @ W[n, k]^T."""
        desc = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
                    "cublasLtMatmulDescCreate")
        for attr, op in ((DESC_TRANSA, CUBLAS_OP_T), (DESC_TRANSB, CUBLAS_OP_N)):
            value = ctypes.c_int32(op)
            self._check(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                        "cublasLtMatmulDescSetAttribute")
        return desc, self._layout(k, n, k), self._layout(k, m, k), self._layout(n, m, n)

    def heuristics(self, problem: tuple, count: int) -> list[HeuristicResult]:
        desc, a, b, c = problem
        pref = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        limit = ctypes.c_uint64(WORKSPACE_BYTES)
        self._check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit),
                                                                  ctypes.sizeof(limit)),
                    "cublasLtMatmulPreferenceSetAttribute")
        results = (HeuristicResult * count)()
        returned = ctypes.c_int(0)
        self._check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, c, c, pref, count, results,
                                                            ctypes.byref(returned)),
                    "cublasLtMatmulAlgoGetHeuristic")
        return [results[i] for i in range(returned.value) if results[i].state == 0]

    def describe(self, algo: Algo) -> dict[str, int | None]:
        """The algorithm's configuration fields (32-bit, or 16-bit for the shape ids; None if neither reads)."""
        fields = {}
        for name, attr in ALGO_FIELDS.items():
            fields[name] = None
            for value in (ctypes.c_uint32(0), ctypes.c_uint16(0)):
                written = ctypes.c_size_t(0)
                if self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value),
                                                                 ctypes.sizeof(value), ctypes.byref(written)) == 0:
                    fields[name] = value.value
                    break
        return fields

    def matmul(self, problem: tuple, algo: Algo, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
        desc, a, b, c = problem
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._check(self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(self.alpha), ctypes.c_void_p(weight.data_ptr()), a,
            ctypes.c_void_p(x.data_ptr()), b, ctypes.byref(self.beta), ctypes.c_void_p(out.data_ptr()), c,
            ctypes.c_void_p(out.data_ptr()), c, ctypes.byref(algo), ctypes.c_void_p(self.workspace.data_ptr()),
            ctypes.c_size_t(WORKSPACE_BYTES), stream), "cublasLtMatmul")


def time_torch(xs: torch.Tensor, weights: list[torch.Tensor], stream: torch.cuda.Stream, blas: str) -> float:
    saved = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(blas)
    try:
        return _time_us(lambda: [F.linear(xs, w) for w in weights], xs.device, stream) / len(weights)
    finally:
        torch.backends.cuda.preferred_blas_library(saved)


def measure(lt: CublasLt, name: str, weights: list[torch.Tensor], m: int, count: int,
            stream: torch.cuda.Stream) -> dict:
    n, k = weights[0].shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x, weights[0])
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    problem = lt.problem(m, n, k)
    row = dict(gemm=name, m=m, n=n, k=k, torch_us=time_torch(x, weights, stream, "cublas"),
               torch_cublaslt_us=time_torch(x, weights, stream, "cublaslt"), algos=[])
    for rank, result in enumerate(lt.heuristics(problem, count)):
        algo = result.algo
        lt.matmul(problem, algo, x, weights[0], out)
        err = relative_error(out, want)  # before the timing runs, which leave the last weight's product in `out`
        us = _time_us(lambda algo=algo: [lt.matmul(problem, algo, x, w, out) for w in weights], x.device,
                      stream) / len(weights)
        row["algos"].append(dict(rank=rank, us=us, rel_err=err, waves=result.waves_count,
                                 workspace=result.workspace_size, **lt.describe(algo)))
    return row


def summary(row: dict) -> str:
    line = (f"M={row['m']:4} {row['gemm']:8} floor {row['floor_us']:6.1f}  torch {row['torch_us']:6.1f}  "
            f"torch+lt {row['torch_cublaslt_us']:6.1f}")
    if not row["algos"]:
        return line + "  no algorithm"
    best = min(row["algos"], key=lambda a: a["us"])
    shape = {k: best[k] for k in ("tile", "split_k", "stages", "reduction")}
    return (line + f"  lt[0] {row['algos'][0]['us']:6.1f}  best {best['us']:6.1f} (rank {best['rank']}, {shape}, "
            f"err {best['rel_err']:.1e}) of {len(row['algos'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--gemms", nargs="+", choices=list(GEMMS), default=list(GEMMS))
    parser.add_argument("--layers", type=int, default=8, help="distinct weights per GEMM, so they come from HBM")
    parser.add_argument("--algos", type=int, default=32, help="heuristic results asked for")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    lt = CublasLt()
    gemms = {name: GEMMS[name] for name in args.gemms}
    weights = make_weights(gemms, args.layers, device)
    bandwidth = measure_bandwidth("cuda")
    stream = torch.cuda.Stream()
    rows = []
    for m in args.tokens:
        for name in gemms:
            row = measure(lt, name, weights[name], m, args.algos, stream)
            n, k = gemms[name]
            row["floor_us"] = (n * k + m * (n + k)) * 2 / bandwidth * 1e6
            rows.append(row)
            print(summary(row), flush=True)
            (args.out / "cublaslt_algos.json").write_text(json.dumps(dict(bandwidth=bandwidth, rows=rows), indent=1))


if __name__ == "__main__":
    main()
