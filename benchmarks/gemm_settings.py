"""Decode-shaped layer GEMMs at Llama-3-8B shapes under different cuBLAS / torch settings.

A decode step's four base GEMMs per layer (`F.linear(x, W)`, W [N, K] bf16: qkv 6144×4096,
o 4096×4096, gate_up 28672×4096, down 4096×14336) run near, but not at, the bytes floor. This
asks whether any setting makes cuBLAS pick faster kernels at these skinny shapes. For every
variant and token count M it times the four GEMMs of `--layers` distinct layers (so the weights
come from HBM, not the 60 MB L2) in CUDA graphs replayed between CUDA events: one graph per GEMM
kind and one for the whole layer in order. It reports us per layer, the fraction of the bytes
floor (weights, x and y moved once at the copy bandwidth of `benchmarks.hbm`), the relative error
of layer 0 against float32, the time of the first eager call per shape (where TunableOp tunes),
and the kernels each GEMM launched (torch.profiler), so a setting that changes nothing shows as
the same kernels.

Settings that must precede CUDA initialisation (environment variables) run each in a subprocess
of this script (`--worker NAME`); the others run in this process and are restored afterwards.
TunableOp's documentation says CUDA builds offer only its 'Default' (plain cuBLAS) solution, so
that variant shows what tuning costs and whether it changes anything (`tunable_results` in the JSON).
About 90 s on an H200 (32 layers of weights, 14 GB); `--budget-s` skips what is left after it.

    python benchmarks/gemm_settings.py [--out DIR] [--tokens 1 16 32 64 128] [--budget-s 150]
    python benchmarks/gemm_settings.py --smoke     # tiny shapes on the CPU, eager timing, no graphs
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accuracy import relative_error  # noqa: E402
from benchmarks.hbm import measure_bandwidth  # noqa: E402

GEMMS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SMOKE_GEMMS = {"qkv": (96, 64), "o": (64, 64), "gate_up": (448, 64), "down": (64, 224)}
DTYPE = torch.bfloat16
REPLAYS = 20
MARKER = "spin_kernel"
GIB_IN_KIB = str(1 << 20)


@dataclass(frozen=True)
class Variant:
    """One way of running the layer's GEMMs: a call form plus the settings around it."""

    name: str
    about: str
    form: str = "linear"  # linear: F.linear(x, W); transposed: x @ Wt; mm_out / addmm_out: out= preallocated
    blas: str | None = None  # torch.backends.cuda.preferred_blas_library
    bf16_reduction: bool | tuple[bool, bool] | None = None  # matmul.allow_bf16_reduced_precision_reduction
    env: dict[str, str] = field(default_factory=dict)  # set before CUDA initialises: runs in a subprocess
    tunable: bool = False  # read torch.cuda.tunable's chosen solutions after the run
    cuda_only: bool = False


_TUNABLE_ENV = {"PYTORCH_TUNABLEOP_ENABLED": "1", "PYTORCH_TUNABLEOP_TUNING": "1"}
VARIANTS = (
    Variant("default", "F.linear(x, W), torch defaults"),
    Variant("blas_cublaslt", 'preferred_blas_library("cublaslt")', blas="cublaslt", cuda_only=True),
    Variant("blas_cublas", 'preferred_blas_library("cublas")', blas="cublas", cuda_only=True),
    Variant("bf16_rr_off", "allow_bf16_reduced_precision_reduction = False", bf16_reduction=False),
    Variant("bf16_rr_on", "allow_bf16_reduced_precision_reduction = True", bf16_reduction=True),
    Variant("no_splitk", "allow_bf16_reduced_precision_reduction = (False, False): no split-K either "
            "(torch refuses allow_splitk=False with reduced precision allowed)", bf16_reduction=(False, False)),
    Variant("cublaslt_no_splitk", "cublaslt and (False, False)", blas="cublaslt", bf16_reduction=(False, False),
            cuda_only=True),
    Variant("transposed", "weights stored [K, N] contiguous, x @ Wt", form="transposed"),
    Variant("mm_out", "torch.mm(x, W.t(), out=y), y preallocated", form="mm_out"),
    Variant("addmm_out", "torch.addmm(zero bias, x, W.t(), out=y): the cuBLASLt bias-epilogue path",
            form="addmm_out"),
    Variant("ws_32m_env", "env CUBLAS_WORKSPACE_CONFIG=:4096:8, CUBLASLT_WORKSPACE_SIZE=1 GiB "
            "(Lt capped at the cuBLAS 32 MiB by the unified workspace)",
            env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "CUBLASLT_WORKSPACE_SIZE": GIB_IN_KIB}),
    Variant("ws_1g_env", "env CUBLAS_WORKSPACE_CONFIG=:1048576:1 and CUBLASLT_WORKSPACE_SIZE: both 1 GiB",
            env={"CUBLAS_WORKSPACE_CONFIG": f":{GIB_IN_KIB}:1", "CUBLASLT_WORKSPACE_SIZE": GIB_IN_KIB}),
    Variant("ws_1g_lt_env", "both workspaces 1 GiB and TORCH_BLAS_PREFER_CUBLASLT=1",
            env={"CUBLAS_WORKSPACE_CONFIG": f":{GIB_IN_KIB}:1", "CUBLASLT_WORKSPACE_SIZE": GIB_IN_KIB,
                 "TORCH_BLAS_PREFER_CUBLASLT": "1"}, cuda_only=True),
    Variant("tunableop", "TunableOp with tuning on (PYTORCH_TUNABLEOP_ENABLED/TUNING=1); tunes on the first call",
            env=_TUNABLE_ENV, tunable=True, cuda_only=True),
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def _settings(variant: Variant) -> Iterator[None]:
    """Applies the variant's in-process settings and restores the previous ones on exit."""
    matmul = torch.backends.cuda.matmul
    saved_blas = torch.backends.cuda.preferred_blas_library() if variant.blas else None
    # (allow_reduced_precision, allow_splitk) where torch has the split-K switch, a bool where it has not
    saved_reduction = (torch._C._get_cublas_allow_bf16_reduced_precision_reduction()
                       if variant.bf16_reduction is not None else None)
    try:
        if variant.blas:
            torch.backends.cuda.preferred_blas_library(variant.blas)
        if variant.bf16_reduction is not None:
            matmul.allow_bf16_reduced_precision_reduction = variant.bf16_reduction
        yield
    finally:
        if saved_blas is not None:
            torch.backends.cuda.preferred_blas_library(saved_blas)
        if saved_reduction is not None:
            matmul.allow_bf16_reduced_precision_reduction = saved_reduction


def make_weights(gemms: dict[str, tuple[int, int]], layers: int, device: torch.device) -> dict[str, list[torch.Tensor]]:
    """gemm -> one [N, K] weight per layer, seeded so every process builds the same ones."""
    gen = torch.Generator(device=device).manual_seed(0)
    return {name: [torch.randn(n, k, generator=gen, device=device, dtype=DTYPE) * 0.02 for _ in range(layers)]
            for name, (n, k) in gemms.items()}


def _bind(form: str, x: torch.Tensor, weight: torch.Tensor, prepared: torch.Tensor | None) -> Callable[[], torch.Tensor]:
    """The GEMM of one layer as a call with no arguments, in the variant's form."""
    if form == "linear":
        return lambda: F.linear(x, weight)
    if form == "transposed":
        return lambda: x @ prepared
    out = torch.empty(x.shape[0], weight.shape[0], device=x.device, dtype=DTYPE)
    if form == "mm_out":
        return lambda: torch.mm(x, weight.t(), out=out)
    if form == "addmm_out":
        return lambda: torch.addmm(prepared, x, weight.t(), out=out)
    raise ValueError(f"unknown form {form!r}")


def _prepare(form: str, weights: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor | None]]:
    """Per weight, what the form needs besides it: the transposed copy, or a zero bias."""
    if form == "transposed":
        return {name: [w.t().contiguous() for w in ws] for name, ws in weights.items()}
    if form == "addmm_out":
        return {name: [torch.zeros(w.shape[0], device=w.device, dtype=DTYPE) for w in ws] for name, ws in weights.items()}
    return {name: [None] * len(ws) for name, ws in weights.items()}


def _time_us(fn: Callable[[], object], device: torch.device, stream: torch.cuda.Stream | None) -> float:
    """us per call of `fn`: the mean of CUDA-graph replays between two events (warm-up and capture on `stream`,
    so the cuBLAS workspace of that stream exists before capture); on the CPU, the best of five eager calls."""
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(5):
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
        return min(times) * 1e6
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / REPLAYS


def _kernels(calls: list[tuple[int, str, Callable[[], object]]]) -> dict[int, dict[str, list[str]]]:
    """M -> gemm -> names of the GPU kernels its call launched, one profiled eager call each,
    told apart by a spin kernel launched after every call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _, _, call in calls:
            call()
            torch.cuda._sleep(100)
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    groups, current = [], []
    for event in events:
        if MARKER in event.name:
            groups.append(current)
            current = []
        else:
            current.append(event.name)
    if len(groups) != len(calls):
        raise RuntimeError(f"profiled {len(groups)} marked groups for {len(calls)} calls")
    found: dict[int, dict[str, list[str]]] = {}
    for (m, name, _), names in zip(calls, groups):
        found.setdefault(m, {})[name] = names
    return found


def _workspace_bytes() -> dict[str, int]:
    """The cuBLAS / cuBLASLt workspace sizes torch reports (getters present in newer torch only)."""
    getters = {"cublas": "_cuda_getCublasWorkspaceSize", "cublaslt": "_cuda_getCublasLtWorkspaceSize"}
    return {name: getattr(torch._C, getter)() for name, getter in getters.items() if hasattr(torch._C, getter)}


def run_variant(variant: Variant, weights: dict[str, list[torch.Tensor]], tokens: list[int],
                device: torch.device) -> dict:
    """Times, checks and profiles one variant at every token count, in this process."""
    began = time.perf_counter()
    layers = len(next(iter(weights.values())))
    stream = torch.cuda.Stream() if device.type == "cuda" else None
    gen = torch.Generator(device=device).manual_seed(1)
    rows, profiled = {}, []
    with _settings(variant):
        prepared = _prepare(variant.form, weights)
        for m in tokens:
            xs = {name: torch.randn(m, ws[0].shape[1], generator=gen, device=device, dtype=DTYPE)
                  for name, ws in weights.items()}
            calls = {name: [_bind(variant.form, xs[name], w, p) for w, p in zip(ws, prepared[name])]
                     for name, ws in weights.items()}
            first_call_s, errors = {}, {}
            for name, per_layer in calls.items():
                start = time.perf_counter()
                got = per_layer[0]()
                _sync(device)
                first_call_s[name] = time.perf_counter() - start
                errors[name] = relative_error(got, xs[name].float() @ weights[name][0].float().t())
            per_gemm_us = {name: _time_us(lambda c=per_layer: [f() for f in c], device, stream) / layers
                           for name, per_layer in calls.items()}
            in_order = [f for layer in zip(*calls.values()) for f in layer]
            layer_us = _time_us(lambda fs=in_order: [f() for f in fs], device, stream) / layers
            rows[m] = {"layer_us": layer_us, "per_gemm_us": per_gemm_us, "rel_err": max(errors.values()),
                       "first_call_s": first_call_s}
            profiled += [(m, name, per_layer[0]) for name, per_layer in calls.items()]
        kernels_error = None
        if device.type == "cuda":
            try:  # the timings stand without the kernel names
                for m, by_gemm in _kernels(profiled).items():
                    rows[m]["kernels"] = by_gemm
            except RuntimeError as error:
                kernels_error = f"{type(error).__name__}: {error}"
    result = {"variant": asdict(variant), "rows": {str(m): row for m, row in rows.items()},
              "seconds": time.perf_counter() - began}
    if kernels_error:
        result["kernels_error"] = kernels_error
    if device.type == "cuda":
        result["workspace_bytes"] = _workspace_bytes()
    if variant.tunable:
        result["tunable_results"] = [list(r) for r in torch.cuda.tunable.get_results()]
    return result


def run_in_subprocess(variant: Variant, args: argparse.Namespace, timeout_s: float) -> dict:
    """Runs one environment-variable variant in a fresh process of this script and reads its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        env = {**os.environ, **variant.env}
        if variant.tunable:
            env["PYTORCH_TUNABLEOP_FILENAME"] = str(Path(tmp) / "tunableop_results%d.csv")
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", variant.name, "--result", str(result_path),
                   "--layers", str(args.layers), "--tokens", *map(str, args.tokens)] + (["--smoke"] if args.smoke else [])
        began = time.perf_counter()
        done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"worker exited {done.returncode}: {done.stderr[-2000:]}")
        result = json.loads(result_path.read_text())
        result["process_seconds"] = time.perf_counter() - began
        return result


def _floors_us(gemms: dict[str, tuple[int, int]], tokens: list[int], bandwidth: float) -> dict[int, dict[str, float]]:
    """M -> weights-only and total (weights + x + y) bytes floor of one layer, in us."""
    size = torch.tensor([], dtype=DTYPE).element_size()
    weights = sum(n * k for n, k in gemms.values()) * size
    return {m: {"weights_us": weights / bandwidth * 1e6,
                "total_us": (weights + sum(m * (n + k) for n, k in gemms.values()) * size) / bandwidth * 1e6}
            for m in tokens}


def _kernel_changes(result: dict, default: dict) -> str:
    """How many (M, gemm) launch other kernels than the default variant did."""
    pairs = [(m, name) for m, row in result["rows"].items() if "kernels" in row for name in row["kernels"]]
    if not pairs or any("kernels" not in default["rows"].get(m, {}) for m, _ in pairs):
        return "-"
    changed = sum(result["rows"][m]["kernels"][name] != default["rows"][m]["kernels"][name] for m, name in pairs)
    return f"{changed}/{len(pairs)}"


def print_table(results: dict[str, dict], floors: dict[int, dict[str, float]], tokens: list[int]) -> None:
    width = 17
    print("\nus per layer (4 GEMMs), fraction of the bytes floor; kernels: (M, gemm) launching other kernels than default")
    print(f"{'variant':<20}" + "".join(f"{'M=' + str(m):>{width}}" for m in tokens) + f"{'kernels':>9}{'max err':>9}")
    print(f"{'floor (w / all)':<20}" + "".join(
        f"{floors[m]['weights_us']:>{width - 8}.1f} /{floors[m]['total_us']:>6.1f}" for m in tokens))
    default = results.get("default")
    for name, result in results.items():
        if "error" in result or "skipped" in result:
            print(f"{name:<20}  {result.get('error') or result['skipped']}"[:200])
            continue
        cells = ""
        for m in tokens:
            row = result["rows"][str(m)]
            cells += f"{row['layer_us']:>{width - 7}.1f} ({floors[m]['total_us'] / row['layer_us']:.2f})"
        err = max(row["rel_err"] for row in result["rows"].values())
        changes = _kernel_changes(result, default) if default and "rows" in default else "-"
        print(f"{name:<20}{cells}{changes:>9}{err:>9.1e}")


def worker(args: argparse.Namespace) -> None:
    """Subprocess side of `run_in_subprocess`: one variant, its JSON to --result."""
    variant = next(v for v in VARIANTS if v.name == args.worker)
    device = torch.device("cpu" if args.smoke else "cuda")
    weights = make_weights(SMOKE_GEMMS if args.smoke else GEMMS, args.layers, device)
    args.result.write_text(json.dumps(run_variant(variant, weights, args.tokens, device)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 16, 32, 64, 128])
    parser.add_argument("--layers", type=int, default=32, help="distinct layers' weights cycled per replay")
    parser.add_argument("--variants", nargs="*", help="run only these (default: all that fit the device)")
    parser.add_argument("--budget-s", type=float, default=150.0, help="skip the variants left after this many seconds")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, eager timing")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.layers = [1, 4], 4
        torch.set_num_threads(1)  # tiny GEMMs: threads only add contention noise to the eager timings
    if args.worker:
        worker(args)
        return
    began = time.monotonic()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    gemms = SMOKE_GEMMS if args.smoke else GEMMS
    bandwidth = measure_bandwidth(device)
    floors = _floors_us(gemms, args.tokens, bandwidth)
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, copy bandwidth {bandwidth / 1e12:.2f} TB/s, {args.layers} layers cycled")
    weights = make_weights(gemms, args.layers, device)
    chosen = [v for v in VARIANTS if (not args.variants or v.name in args.variants)
              and (device.type == "cuda" or not v.cuda_only)]
    results: dict[str, dict] = {}
    for variant in chosen:
        left = args.budget_s - (time.monotonic() - began)
        if left <= 0:
            results[variant.name] = {"skipped": "over --budget-s"}
            continue
        try:
            if variant.env:
                results[variant.name] = run_in_subprocess(variant, args, timeout_s=left)
            else:
                results[variant.name] = run_variant(variant, weights, args.tokens, device)
        except (RuntimeError, TypeError, subprocess.TimeoutExpired) as error:  # one variant's failure costs only its row
            results[variant.name] = {"error": f"{type(error).__name__}: {error}"}
        result = results[variant.name]
        status = result.get("error") or f"{result['seconds']:.1f} s" + (
            f" ({result['process_seconds']:.1f} s with process start)" if "process_seconds" in result else "")
        print(f"  {variant.name}: {status}"[:300], flush=True)
    print_table(results, floors, args.tokens)
    tuned = results.get("tunableop", {})
    if "rows" in tuned:
        tuning_s = sum(sum(row["first_call_s"].values()) for row in tuned["rows"].values())
        print(f"tunableop: first calls (tuning) {tuning_s:.2f} s; solutions "
              f"{sorted({r[2] for r in tuned['tunable_results'] if len(r) > 2})}")
    print(f"total {time.monotonic() - began:.1f} s")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        summary = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda,
                   "bandwidth_bytes_per_s": bandwidth, "layers": args.layers, "gemms": gemms,
                   "floors_us": {str(m): f for m, f in floors.items()}, "results": results}
        (args.out / "gemm_settings.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
