"""Paged decode attention at Llama-3-8B shapes: single pass vs split context.

For each batch × context it checks the Triton decode (one pass, `num_splits=1`, and the default
split count) against float64 torch on a few rows, times both inside CUDA graphs
(`triton.testing.do_bench_cudagraph`) and sets them against the bytes floor: K and V of every
context token read once, at the bandwidth of a 2 GiB device-to-device copy measured in the same
run. Block tables are random; `--table-tokens` makes them wider than the context (padded with a
scratch block), as the engine's graphs are. `--splits` also times the given split counts (for tuning the default).
Small shapes stay in the 60 MB L2 across graph replays, so their fraction of the floor can pass 1.

`--sweep` tunes `kernels.paged_attention_triton.DECODE_CONFIGS` instead: per shape class (dtype, batch x KV
heads bucket) of the `--sweep-batches`, it times every candidate tile / warps / stages with each
split target (the programs per SM that give 1, 2 or 4 splits) at the first of the `--sweep-contexts`,
re-times the best few at every context, checks the winner against float64 and prints it as the
table's line, with each shape's fraction of the bytes floor against the table's current config.
Tiles too large for the warps' registers are not tried; candidates that fail to compile or launch
(out of shared memory) score nothing. Expected to take about a minute on an H200 (some 70 compiles,
300 graph timings of ~60 ms); `--sweep-budget-s` stops the screen early if it runs long.

    python benchmarks/decode_attention.py [--out DIR]
    python benchmarks/decode_attention.py --sweep [--sweep-batches 32 64 128] [--sweep-contexts 544 1024 2048]
    python benchmarks/decode_attention.py --smoke [--sweep]  # tiny shapes; on a CPU under the Triton interpreter
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accuracy import relative_error  # noqa: E402
from benchmarks.hbm import measure_bandwidth  # noqa: E402
from benchmarks.timing import graph_time_us  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
SMOKE_HEADS, SMOKE_KV_HEADS, SMOKE_HEAD_DIM = 4, 2, 16
SCALE = HEAD_DIM ** -0.5
CHECK_ROWS = 4
CHECK_TOLERANCE = 1e-2  # relative error against float64; bf16 outputs land near 2e-3

# Sweep candidates: (tokens, num_warps, num_stages), each with the split targets of SWEEP_SPLITS. Not 4 stages:
# Triton 3.6 compiles the kernel for sm_90 at these shapes (bf16, D 128, group 4) to the same PTX as with 3.
SWEEP_TILES = list(itertools.product((16, 32, 64, 128), (2, 4, 8), (1, 2, 3)))
SMOKE_SWEEP_TILES = [(16, 2, 1), (32, 4, 2)]
SWEEP_SPLITS = (1, 2, 4)
MAX_TILE_ELEMENTS_PER_THREAD = 128  # one K tile spread over the warps; more spills registers
MAX_PROGRAMS_PER_SM = 16  # split counts past this many programs per multiprocessor are not tried
SHORTLIST = 6  # the screen's best, re-timed at every context
SWEEP_REP_MS = 5


class Shapes:
    def __init__(self, smoke: bool):
        self.heads = SMOKE_HEADS if smoke else HEADS
        self.kv_heads = SMOKE_KV_HEADS if smoke else KV_HEADS
        self.head_dim = SMOKE_HEAD_DIM if smoke else HEAD_DIM


@dataclass
class Case:
    """One batch x context: inputs, the output buffer, the checked rows' float64 reference and the bytes floor."""

    batch: int
    context: int
    q: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    out: torch.Tensor
    rows: slice
    ref: torch.Tensor
    floor_us: float


def make_case(shapes: Shapes, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: int, context: int,
              table_tokens: int, bandwidth: float) -> Case:
    device = k_cache.device
    gen = torch.Generator(device=device).manual_seed(batch * 100003 + context)
    scratch = k_cache.shape[0] - 1
    used = -(-context // BLOCK_SIZE)
    width = max(used, table_tokens // BLOCK_SIZE)
    tables = torch.full((batch, width), scratch, dtype=torch.long, device=device)
    tables[:, :used] = torch.randperm(scratch, generator=gen, device=device)[:batch * used].view(batch, used)
    lens = torch.full((batch,), context, dtype=torch.long, device=device)
    q = torch.randn(batch, shapes.heads, shapes.head_dim, generator=gen, device=device, dtype=k_cache.dtype)
    rows = slice(0, min(batch, CHECK_ROWS))
    floor_us = 2 * batch * context * shapes.kv_heads * shapes.head_dim * k_cache.element_size() / bandwidth * 1e6
    return Case(batch, context, q, tables, lens, torch.empty_like(q), rows,
                _reference_rows(q, k_cache, v_cache, tables, lens, rows), floor_us)


def _runner(case: Case, k_cache: torch.Tensor, v_cache: torch.Tensor, **kwargs) -> Callable[[], torch.Tensor]:
    from kernels.paged_attention_triton import paged_attention_decode

    return lambda: paged_attention_decode(case.q, k_cache, v_cache, case.tables, case.lens, SCALE, out=case.out,
                                          **kwargs)


def decode_row(shapes: Shapes, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: int, context: int,
               table_tokens: int, splits: list[int], bandwidth: float) -> dict:
    from kernels.device import multiprocessor_count
    from kernels.paged_attention_triton import default_num_splits

    case = make_case(shapes, k_cache, v_cache, batch, context, table_tokens, bandwidth)
    width = case.tables.shape[1]
    default = default_num_splits(batch, shapes.kv_heads, width * BLOCK_SIZE, multiprocessor_count(k_cache.device))
    times, errors = {}, {}
    for count in dict.fromkeys([1, default, *splits]):
        run = _runner(case, k_cache, v_cache, num_splits=count)
        errors[count] = relative_error(run()[case.rows], case.ref)
        times[count] = graph_time_us(run, k_cache.device)
    return dict(batch=batch, context=context, table_tokens=width * BLOCK_SIZE, default_splits=default,
                single_us=times[1], split_us=times[default], floor_us=case.floor_us,
                rel_err=max(errors.values()), times_by_splits={str(k): v for k, v in times.items()})


def _reference_rows(q, k_cache, v_cache, tables, lens, rows) -> torch.Tensor:
    """float64 torch on the checked rows only, gathering just their blocks (the whole cache in float64 is too big)."""
    from kernels.attention import paged_attention_decode as torch_decode

    needed = tables[rows]
    blocks, local = torch.unique(needed, return_inverse=True)
    return torch_decode(q[rows].double(), k_cache[blocks].double(), v_cache[blocks].double(), local, lens[rows], SCALE)


def sweep_tiles(shapes: Shapes, smoke: bool) -> list[tuple[int, int, int]]:
    """The candidate (tokens, num_warps, num_stages) whose K tile spreads to at most
    MAX_TILE_ELEMENTS_PER_THREAD per thread (more spills registers)."""
    if smoke:
        return SMOKE_SWEEP_TILES
    return [(tokens, warps, stages) for tokens, warps, stages in SWEEP_TILES
            if tokens * shapes.head_dim <= MAX_TILE_ELEMENTS_PER_THREAD * 32 * warps]


def programs_per_sm_for(splits: int, batch: int, kv_heads: int, multiprocessors: int) -> int:
    """The smallest split target that gives `batch` this many splits (for a table wider than a single pass)."""
    return max(1, -(-splits * batch * kv_heads // multiprocessors))


class Sweeper:
    """Times candidate configs on prepared cases; a candidate that fails to compile or launch scores inf."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, log: list):
        self.k_cache, self.v_cache, self.log = k_cache, v_cache, log
        self.failed: set = set()
        self.times: dict = {}

    def time_us(self, case: Case, config) -> float:
        key = (case.batch, case.context, config)
        if key not in self.times:
            self.times[key] = self._measure(case, config)
        return self.times[key]

    def _measure(self, case: Case, config) -> float:
        if config in self.failed:
            return math.inf
        run = _runner(case, self.k_cache, self.v_cache, config=config)
        try:
            run()
            us = graph_time_us(run, self.k_cache.device, rep_ms=SWEEP_REP_MS)
        except Exception as exc:  # noqa: BLE001 - out of shared memory or registers: just not a winner
            self.failed.add(config)
            self.log.append({"cfg": asdict(config), "error": str(exc)[:300]})
            return math.inf
        self.log.append({"batch": case.batch, "context": case.context, "cfg": asdict(config), "us": us})
        return us

    def score(self, cases: list[Case], config) -> float:
        """Summed time over the bytes floor, so every context counts alike."""
        return sum(self.time_us(case, config) / case.floor_us for case in cases)

    def checked(self, cases: list[Case], config) -> float:
        """The largest relative error against float64 over the cases."""
        return max(relative_error(_runner(case, self.k_cache, self.v_cache, config=config)()[case.rows], case.ref)
                   for case in cases)


@dataclass
class SweepClass:
    """One shape class: its cases (every batch of the class at every context), split targets and screen scores."""

    key: tuple[str, int]
    cases: list[Case]
    targets: list[int]
    screened: list = field(default_factory=list)

    @property
    def screen_cases(self) -> list[Case]:
        return [case for case in self.cases if case.context == self.cases[0].context]


def split_targets(batches: list[int], kv_heads: int, splits: list[int], multiprocessors: int) -> list[int]:
    """Programs per SM that give the class's largest batch each split count (none past MAX_PROGRAMS_PER_SM)."""
    top = max(batches)
    return sorted({programs_per_sm_for(s, top, kv_heads, multiprocessors) for s in splits
                   if s == 1 or s * top * kv_heads <= MAX_PROGRAMS_PER_SM * multiprocessors})


def screen(sweeper: Sweeper, classes: list[SweepClass], tiles: list[tuple[int, int, int]], deadline: float) -> None:
    """Score every tile with every split target of every class at the first context; tile by tile, across all
    classes, so a deadline cuts the same candidates from each."""
    from kernels.paged_attention_triton import DecodeConfig

    for tokens, warps, stages in tiles:
        if time.time() > deadline:
            print(f"  sweep: out of time, screening stopped before tokens={tokens} warps={warps} stages={stages}",
                  flush=True)
            return
        for cls in classes:
            for target in cls.targets:
                config = DecodeConfig(tokens=tokens, num_warps=warps, num_stages=stages, programs_per_sm=target)
                cls.screened.append((sweeper.score(cls.screen_cases, config), config))


def pick(sweeper: Sweeper, cls: SweepClass, current) -> tuple[object, float]:
    """Re-time the screen's SHORTLIST best and the table's current config at every context; the fastest that
    matches float64 wins. Returns it and its largest relative error."""
    finalists = [config for us, config in sorted(cls.screened, key=lambda s: s[0]) if math.isfinite(us)][:SHORTLIST]
    scores = {config: sweeper.score(cls.cases, config) for config in dict.fromkeys([*finalists, current])}
    for config in sorted((config for config in scores if math.isfinite(scores[config])), key=scores.get):
        error = sweeper.checked(cls.cases, config)
        if error < CHECK_TOLERANCE:
            return config, error
        print(f"  sweep: {config} is off float64 by {error:.1e}, skipped", flush=True)
    raise RuntimeError(f"no candidate of {cls.key} matched float64")


def run_sweep(shapes: Shapes, k_cache: torch.Tensor, v_cache: torch.Tensor, batches: list[int],
              contexts: list[int], table_tokens: int, splits: list[int], bandwidth: float, smoke: bool,
              budget_s: float) -> dict:
    """Sweep each shape class of `batches`; print per shape the winner against the table's config, then the
    winners as the table's lines."""
    from kernels.device import multiprocessor_count
    from kernels.paged_attention_triton import decode_class, decode_config, default_num_splits

    began = time.time()
    dtype = k_cache.dtype
    sms = multiprocessor_count(k_cache.device)
    tiles = sweep_tiles(shapes, smoke)
    members: dict = {}
    for batch in batches:
        members.setdefault(decode_class(dtype, batch, shapes.kv_heads), []).append(batch)
    classes = [SweepClass(key, [make_case(shapes, k_cache, v_cache, batch, context, table_tokens, bandwidth)
                                for batch in group for context in contexts],
                          split_targets(group, shapes.kv_heads, splits, sms))
               for key, group in sorted(members.items())]
    log: list = []
    sweeper = Sweeper(k_cache, v_cache, log)
    print(f"sweep: {len(tiles)} tiles; split targets (programs per SM) "
          + ", ".join(f"{cls.key}: {cls.targets}" for cls in classes), flush=True)
    screen(sweeper, classes, tiles, began + budget_s)
    print(f"{'class':>16}{'batch':>6}{'context':>8}{'splits':>7}{'table us':>10}{'best us':>9}{'floor us':>10}"
          f"{'table/fl':>9}{'best/fl':>8}{'rel err':>9}")
    winners, rows = {}, []
    for cls in classes:
        current = decode_config(dtype, max(case.batch for case in cls.cases), shapes.kv_heads)
        best, error = pick(sweeper, cls, current)
        winners[cls.key] = best
        for case in cls.cases:
            table_config = decode_config(dtype, case.batch, shapes.kv_heads)
            width = case.tables.shape[1] * BLOCK_SIZE
            count = default_num_splits(case.batch, shapes.kv_heads, width, sms, best.programs_per_sm)
            table_us, best_us = sweeper.time_us(case, table_config), sweeper.time_us(case, best)
            rows.append(dict(cls=list(cls.key), batch=case.batch, context=case.context, splits=count,
                             table_us=table_us, best_us=best_us, floor_us=case.floor_us, rel_err=error,
                             best=asdict(best), table=asdict(table_config)))
            print(f"{cls.key!s:>16}{case.batch:>6}{case.context:>8}{count:>7}{table_us:>10.1f}{best_us:>9.1f}"
                  f"{case.floor_us:>10.1f}{case.floor_us / table_us:>9.2f}{case.floor_us / best_us:>8.2f}"
                  f"{error:>9.1e}", flush=True)
    source = "\n".join(f'    ("{name}", {bucket}): {config!r},' for (name, bucket), config in sorted(winners.items()))
    print(f"sweep winners ({time.time() - began:.0f} s; lines of DECODE_CONFIGS in "
          f"kernels/paged_attention_triton.py):\n{source}", flush=True)
    return dict(rows=rows, winners=source, seconds=time.time() - began, log=log)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64, 128, 256])
    parser.add_argument("--contexts", type=int, nargs="*", default=[128, 512, 2048, 8192])
    parser.add_argument("--table-tokens", type=int, default=0,
                        help="block-table width in tokens (default: the context)")
    parser.add_argument("--splits", type=int, nargs="*", default=[], help="also time these split counts")
    parser.add_argument("--sweep", action="store_true", help="tune the config table instead (see above)")
    parser.add_argument("--sweep-batches", type=int, nargs="*", default=[32, 64, 128])
    parser.add_argument("--sweep-contexts", type=int, nargs="*", default=[544, 1024, 2048],
                        help="the first one screens every candidate")
    parser.add_argument("--sweep-splits", type=int, nargs="*", default=list(SWEEP_SPLITS))
    parser.add_argument("--sweep-budget-s", type=float, default=120.0,
                        help="stop screening candidates after this many seconds (the finalists take a few more)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, fp16; runs on a CPU (Triton interpreter)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.batches, args.contexts = [1, 3], [16, 80]
        args.splits = args.splits or [2]
        # 300 tokens: wider than a single pass, so the split targets split
        args.sweep_batches, args.sweep_contexts, args.sweep_splits = [1, 3], [80, 300], [1, 2]
    shapes = Shapes(args.smoke)
    dtype = torch.float16 if args.smoke else torch.bfloat16
    bandwidth = measure_bandwidth(device)
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    batches = args.sweep_batches if args.sweep else args.batches
    contexts = args.sweep_contexts if args.sweep else args.contexts
    num_blocks = max(batches) * -(-max(contexts) // BLOCK_SIZE) + 1  # and a scratch block to pad tables with
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, shapes.kv_heads, shapes.head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    result = dict(device=str(device), dtype=str(dtype), bandwidth_bytes_per_s=bandwidth)
    if args.sweep:
        result["sweep"] = run_sweep(shapes, k_cache, v_cache, batches, contexts, args.table_tokens,
                                    args.sweep_splits, bandwidth, args.smoke, args.sweep_budget_s)
    else:
        result["decode"] = decode_table(shapes, k_cache, v_cache, batches, contexts, args.table_tokens, args.splits,
                                        bandwidth)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "decode_attention_sweep.json" if args.sweep else "decode_attention.json"
        (args.out / name).write_text(json.dumps(result, indent=1))


def decode_table(shapes: Shapes, k_cache: torch.Tensor, v_cache: torch.Tensor, batches: list[int],
                 contexts: list[int], table_tokens: int, splits: list[int], bandwidth: float) -> list[dict]:
    """Single pass against the default split count (and `splits`) per batch x context, printed as they come."""
    decode = []
    print(f"{'batch':>6}{'context':>8}{'splits':>7}{'single us':>11}{'split us':>10}{'floor us':>10}"
          f"{'of floor':>9}{'speedup':>9}{'rel err':>9}")
    for batch in batches:
        for context in contexts:
            row = decode_row(shapes, k_cache, v_cache, batch, context, table_tokens, splits, bandwidth)
            decode.append(row)
            others = "  " + " ".join(f"{k}:{v:.1f}" for k, v in row["times_by_splits"].items()) if splits else ""
            print(f"{batch:>6}{context:>8}{row['default_splits']:>7}{row['single_us']:>11.1f}{row['split_us']:>10.1f}"
                  f"{row['floor_us']:>10.1f}{row['floor_us'] / row['split_us']:>9.2f}"
                  f"{row['single_us'] / row['split_us']:>8.2f}x{row['rel_err']:>9.1e}{others}", flush=True)
    return decode


if __name__ == "__main__":
    main()
