"""Multi-LoRA kernels at Llama-3-8B shapes: correctness against float64, time, bytes floor, base-linear ratio.

For every (rank, tokens, distinct adapters) scenario and every LoRA group of a decoder layer
(q/k/v, o, gate/up, down), it checks the bf16 LoRA delta against float64 and times each
shrink and expand, the whole layer (8 launches in one CUDA graph) and the base linears
(`x @ W^T`) of the same layer. Each replay runs after an L2 flush, so adapter weights come
from HBM as they would in a real step; the time is the median of CUDA-event timings.
The floor is the bytes that must move (x once, each distinct adapter's A and B once, h,
y read and written once) over the HBM bandwidth measured here with a large copy.

    python benchmarks/lora_kernels.py --out DIR [--sweep [CLASS ...]] [--budget-s S]
    python benchmarks/lora_kernels.py --out DIR --ranks 16 --slot-rank 64 [--ignore-slot-ranks]

`--sweep` first times candidate launch configs per shape class and uses the winners (it
prints them as the table for `kernels/lora_tuning.py`); `--sweep bgmv` sweeps only the classes
named (bgmv, sgmv_small, sgmv) and keeps the committed configs of the others. Results go to
DIR/lora_kernels.json and DIR/lora_kernels.md as they come; a short per-layer table is printed last. Without CUDA
(`TRITON_INTERPRET=1`, `--smoke`) it runs tiny shapes to check the script itself.

`--slot-rank N` allocates the slots at max rank N, as a server started with `--max-lora-rank N` does: each
scenario's adapters keep their rank, zero-padded to N, and the slots' ranks go to `prepare_lora_metadata`, so the
kernels skip the padding; with `--ignore-slot-ranks` they are not given and the kernels read the padding too (as
before slot ranks). The floor stays that of the adapters' own rank. Each result row records its slot rank and
whether the ranks were given.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hbm import measure_bandwidth  # noqa: E402

from kernels import LoRAMetadata, lora_triton, lora_tuning, prepare_lora_metadata  # noqa: E402
from kernels.lora_tuning import ExpandConfig, ShrinkConfig  # noqa: E402

NUM_SLOTS = 64
DTYPE = torch.bfloat16
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@dataclass(frozen=True)
class Group:
    name: str
    k: int
    widths: tuple[int, ...]


LLAMA3_8B = (
    Group("qkv", 4096, (4096, 1024, 1024)),
    Group("o", 4096, (4096,)),
    Group("gate_up", 4096, (14336, 14336)),
    Group("down", 14336, (4096,)),
)
SMOKE = (Group("qkv", 96, (64, 16, 16)), Group("o", 64, (64,)), Group("gate_up", 64, (80, 80)), Group("down", 80, (64,)))

# Candidates for --sweep, per path (block_r and block_k are capped at the rank and K at launch).
# BGMV shrink (4, 2048, 1, 4): reads each token's x 4 times at rank 16 where block_r 1 reads it 16 times, at 48
# registers a thread on sm_90 (the committed multi-slice config takes 37).
BGMV_SHRINK = [
    ShrinkConfig(block_r=br, block_k=bk, split_k=sk, num_warps=w, num_stages=1)
    for br, bk, sk, w in [(1, 2048, 1, 4), (1, 16384, 1, 4), (1, 16384, 1, 8), (2, 8192, 1, 8), (4, 4096, 1, 8),
                          (4, 2048, 1, 4), (4, 512, 1, 4), (8, 2048, 1, 8), (2, 4096, 2, 4)]
]
BGMV_EXPAND = [
    ExpandConfig(block_n=bn, block_r=br, num_warps=w, num_stages=1, n_blocks=g)
    for bn, br, w, g in [(64, 64, 2, 1), (256, 32, 4, 1), (256, 64, 4, 1), (512, 16, 4, 1), (128, 64, 4, 2),
                         (256, 64, 8, 2), (128, 64, 4, 4), (512, 64, 8, 1)]
]
SGMV_BLOCK_M = [32, 64, 128]
SGMV_SHRINK_SMALL = [
    ShrinkConfig(block_r=br, block_k=bk, split_k=sk, num_warps=w, num_stages=s)
    for br, bk, sk, w, s in [(64, 64, 4, 4, 4), (64, 128, 4, 4, 3), (64, 128, 8, 4, 3), (64, 256, 8, 4, 2),
                             (64, 128, 16, 4, 2), (64, 256, 4, 8, 3), (64, 256, 2, 4, 3), (64, 512, 1, 8, 2)]
]
# split_k 3 and 6: at 8192 tokens over few adapters (128 tiles) split_k 4 makes 512 programs, which the committed
# configs' 61 KB of shared memory fit 396 at a time on an H200 (`sm90_audit.py --batches 8192`): 1.3 waves.
SGMV_SHRINK = [
    ShrinkConfig(block_r=br, block_k=bk, split_k=sk, num_warps=w, num_stages=s)
    for br, bk, sk, w, s in [(64, 128, 1, 8, 3), (64, 64, 4, 4, 4), (64, 128, 2, 8, 3), (64, 128, 4, 8, 3),
                             (64, 64, 2, 4, 4), (64, 256, 4, 8, 2), (64, 128, 3, 8, 3), (64, 128, 6, 8, 3),
                             (64, 64, 3, 4, 4), (64, 64, 6, 4, 4), (64, 128, 8, 8, 3)]
]
SGMV_EXPAND = [
    ExpandConfig(block_n=bn, block_r=br, num_warps=w, num_stages=s, n_blocks=g)
    for bn, br, w, s, g in [(64, 64, 4, 2, 1), (128, 64, 4, 2, 1), (64, 64, 4, 3, 4), (128, 64, 4, 3, 4),
                            (128, 32, 8, 3, 8), (64, 32, 4, 3, 8), (256, 32, 8, 3, 4), (128, 64, 8, 2, 2)]
]


# ---------------------------------------------------------------- timing


class Timer:
    """Median CUDA-event time of a captured graph, replayed after an L2 flush each time."""

    def __init__(self, iters: int) -> None:
        self.iters = iters
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE) if CUDA else None

    def __call__(self, fn: Callable[[], None]) -> float:
        """Microseconds per call of fn (fn must only touch static buffers)."""
        fn()  # compile and warm up outside the capture
        if not CUDA:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        events = []
        for i in range(self.iters + 3):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            if i >= 3:
                events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3


# ---------------------------------------------------------------- data


class Weights:
    """A and B stacks for NUM_SLOTS adapter slots of adapters at one rank, allocated at `slot_rank` (at least the
    rank): A's rows and B's columns past the rank are zero padding."""

    def __init__(self, groups: tuple[Group, ...], rank: int, slot_rank: int) -> None:
        self.rank = rank
        self.a = {g.name: [padded(rand(NUM_SLOTS, rank, g.k, scale=g.k ** -0.5), slot_rank, dim=1)
                           for _ in g.widths] for g in groups}
        self.b = {g.name: [padded(rand(NUM_SLOTS, w, rank, scale=rank ** -0.5), slot_rank, dim=2)
                           for w in g.widths] for g in groups}


def padded(stack: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """`stack` zero-padded along `dim` to `size`."""
    if stack.shape[dim] == size:
        return stack
    shape = list(stack.shape)
    shape[dim] = size
    out = torch.zeros(shape, dtype=stack.dtype, device=stack.device)
    out.narrow(dim, 0, stack.shape[dim]).copy_(stack)
    return out


def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).mul_(scale).to(DTYPE)


@dataclass
class Scenario:
    rank: int
    tokens: int
    adapters: int

    @property
    def kind(self) -> str:
        return "decode" if self.tokens <= 256 else "prefill"

    @property
    def label(self) -> str:
        return f"r{self.rank} T{self.tokens} A{self.adapters}"


def assign_slots(tokens: int, adapters: int, in_slot_order: bool = False) -> torch.Tensor:
    """Tokens spread evenly over `adapters` slots, in shuffled order, or sorted by slot (so that the per-token
    kernels' neighbouring programs share an adapter)."""
    slots = torch.arange(tokens, device=DEVICE) % adapters
    slots = slots[torch.randperm(tokens, device=DEVICE)]
    return (slots.sort().values if in_slot_order else slots).to(torch.int32)


# ---------------------------------------------------------------- bytes


def shrink_bytes(g: Group, tokens: int, adapters: int, rank: int) -> int:
    return tokens * g.k * 2 + adapters * len(g.widths) * rank * g.k * 2 + len(g.widths) * tokens * rank * 4


def expand_bytes(g: Group, tokens: int, adapters: int, rank: int) -> int:
    n = sum(g.widths)
    return len(g.widths) * tokens * rank * 4 + adapters * n * rank * 2 + 2 * tokens * n * 2


def base_bytes(g: Group, tokens: int) -> int:
    n = sum(g.widths)
    return tokens * g.k * 2 + n * g.k * 2 + tokens * n * 2


# ---------------------------------------------------------------- one scenario


@dataclass
class Result:
    label: str
    kind: str
    rank: int
    tokens: int
    adapters: int
    path: str
    slot_rank: int = 0  # the slots' allocated (max) rank
    ranks_given: bool = False  # whether the slots' ranks went to the metadata (the kernels skip the padding)
    rel_err: float = math.nan
    layer_us: float = math.nan
    floor_us: float = math.nan
    base_us: float = math.nan
    other_path_us: float = math.nan
    ops: dict = field(default_factory=dict)
    error: str = ""

    @property
    def pct_floor(self) -> float:
        return 100 * self.floor_us / self.layer_us

    @property
    def base_ratio(self) -> float:
        return self.layer_us / self.base_us


class Bench:
    def __init__(self, groups: tuple[Group, ...], timer: Timer, bandwidth: float, in_slot_order: bool = False,
                 slot_rank: int | None = None, ranks_given: bool = False) -> None:
        """slot_rank: the slots' allocated rank (None: each scenario's own); ranks_given: the slots' ranks go to
        the metadata."""
        self.groups = groups
        self.in_slot_order = in_slot_order
        self.slot_rank = slot_rank
        self.ranks_given = ranks_given
        self.timer = timer
        self.bandwidth = bandwidth
        self.weights: dict[int, Weights] = {}
        self.base_w = {g.name: rand(sum(g.widths), g.k, scale=g.k ** -0.5) for g in groups}
        self.base_cache: dict[int, float] = {}

    def slot_rank_for(self, rank: int) -> int:
        return self.slot_rank or rank

    def label(self, sc: Scenario) -> str:
        """The scenario's label, with the slots' rank and `read-all` (ranks not given) where they are padded."""
        slot_rank = self.slot_rank_for(sc.rank)
        if slot_rank == sc.rank:
            return sc.label
        return f"{sc.label} s{slot_rank}{'' if self.ranks_given else ' read-all'}"

    def weights_for(self, rank: int) -> Weights:
        if rank not in self.weights:
            self.weights.clear()
            self.weights[rank] = Weights(self.groups, rank, self.slot_rank_for(rank))
        return self.weights[rank]

    def floor_us(self, g: Group, sc: Scenario, op: str) -> float:
        used = min(sc.adapters, sc.tokens)
        nbytes = (shrink_bytes if op == "shrink" else expand_bytes)(g, sc.tokens, used, sc.rank)
        return nbytes / self.bandwidth * 1e6

    def buffers(self, sc: Scenario, block_m: int | None = None):
        slot_ranks = torch.full((NUM_SLOTS,), sc.rank, dtype=torch.int32, device=DEVICE) if self.ranks_given else None
        meta = prepare_lora_metadata(
            assign_slots(sc.tokens, sc.adapters, self.in_slot_order), NUM_SLOTS, slot_ranks=slot_ranks,
            out=LoRAMetadata.empty(sc.tokens, NUM_SLOTS, DEVICE, block_m=block_m),
        )
        xs = {g.name: rand(sc.tokens, g.k) for g in self.groups}
        ys = {g.name: rand(sc.tokens, sum(g.widths)) for g in self.groups}
        width = self.slot_rank_for(sc.rank)
        hs = {g.name: torch.empty(len(g.widths), sc.tokens, width, device=DEVICE) for g in self.groups}
        return meta, xs, ys, hs

    def check(self, sc: Scenario, path: str) -> float:
        """Largest relative error of the bf16 LoRA delta (shrink then expand) against float64, over the groups."""
        w = self.weights_for(sc.rank)
        meta, xs, ys, hs = self.buffers(sc)
        slots = meta.slots[: sc.tokens].long()
        worst = 0.0
        for g in self.groups:
            y0 = ys[g.name].double()
            hs[g.name].fill_(float("nan"))
            lora_triton.shrink_slices(xs[g.name], w.a[g.name], meta, hs[g.name], path=path)
            lora_triton.expand_slices(ys[g.name], hs[g.name], w.b[g.name], meta, path=path)
            ref = torch.zeros_like(y0)
            x64 = xs[g.name].double()
            for slot in range(min(sc.adapters, NUM_SLOTS)):
                rows = (slots == slot).nonzero().squeeze(1)
                col = 0
                for a, b in zip(w.a[g.name], w.b[g.name]):
                    ref[rows, col : col + b.shape[1]] = (x64[rows] @ a[slot].double().T) @ b[slot].double().T
                    col += b.shape[1]
            delta = ys[g.name].double() - y0
            worst = max(worst, ((delta - ref).norm() / ref.norm()).item())
        return worst

    def layer_fn(self, sc: Scenario, path: str, buffers, cfgs: dict | None = None) -> Callable[[], None]:
        w = self.weights_for(sc.rank)
        meta, xs, ys, hs = buffers
        cfgs = cfgs or {}

        def run() -> None:
            for g in self.groups:
                lora_triton.shrink_slices(xs[g.name], w.a[g.name], meta, hs[g.name], path=path,
                                          config=cfgs.get(("shrink", g.name)))
                lora_triton.expand_slices(ys[g.name], hs[g.name], w.b[g.name], meta, path=path,
                                          config=cfgs.get(("expand", g.name)))

        return run

    def op_fn(self, sc: Scenario, g: Group, op: str, path: str, buffers, cfg=None) -> Callable[[], None]:
        w = self.weights_for(sc.rank)
        meta, xs, ys, hs = buffers
        if op == "shrink":
            return lambda: lora_triton.shrink_slices(xs[g.name], w.a[g.name], meta, hs[g.name], path=path, config=cfg)
        return lambda: lora_triton.expand_slices(ys[g.name], hs[g.name], w.b[g.name], meta, path=path, config=cfg)

    def base_us(self, tokens: int) -> float:
        if tokens not in self.base_cache:
            xs = {g.name: rand(tokens, g.k) for g in self.groups}
            ys = {g.name: torch.empty(tokens, sum(g.widths), device=DEVICE, dtype=DTYPE) for g in self.groups}

            def run() -> None:
                for g in self.groups:
                    torch.matmul(xs[g.name], self.base_w[g.name].T, out=ys[g.name])

            self.base_cache[tokens] = self.timer(run)
        return self.base_cache[tokens]

    def scenario(self, sc: Scenario) -> Result:
        # the path the engine's step would take (tokens spread evenly over the adapters; the slots' width)
        slots = [t % sc.adapters for t in range(sc.tokens)]
        path = lora_tuning.step_path(sc.tokens, self.slot_rank_for(sc.rank), slots)
        res = Result(self.label(sc), sc.kind, sc.rank, sc.tokens, sc.adapters, path, self.slot_rank_for(sc.rank),
                     self.ranks_given)
        try:
            res.rel_err = self.check(sc, path)
            buffers = self.buffers(sc)
            res.floor_us = sum(self.floor_us(g, sc, op) for g in self.groups for op in ("shrink", "expand"))
            for g in self.groups:
                for op in ("shrink", "expand"):
                    us = self.timer(self.op_fn(sc, g, op, path, buffers))
                    res.ops[f"{g.name}.{op}"] = {"us": us, "floor_us": self.floor_us(g, sc, op)}
            res.layer_us = self.timer(self.layer_fn(sc, path, buffers))
            res.base_us = self.base_us(sc.tokens)
            if sc.kind == "decode" and sc.tokens >= 16:
                other = "sgmv" if path == "bgmv" else "bgmv"
                res.other_path_us = self.timer(self.layer_fn(sc, other, buffers))
        except Exception:  # noqa: BLE001 - one broken shape must not lose the table
            res.error = traceback.format_exc(limit=3)[-800:]
        return res


# ---------------------------------------------------------------- sweep

# Shape classes of --sweep: the per-token path, the 16-row segment tiles, the larger tiles (their height swept too).
SWEEP_CLASSES = ("bgmv", "sgmv_small", "sgmv")


def sweep_class(key: tuple) -> str:
    """The sweep class of a `lora_tuning` table key (path, block_m, ...)."""
    if key[0] == "bgmv":
        return "bgmv"
    return "sgmv_small" if key[1] == 16 else "sgmv"


def sweep(bench: Bench, log: list, classes: dict, ranks: tuple[int, ...] = (16, 64)) -> dict:
    """Time candidate configs per shape class, install the winners for the rest of the run and return the table.

    `classes` maps some of SWEEP_CLASSES to the (tokens, adapters) scenarios that score them; the classes it
    leaves out keep their committed configs.
    """
    groups = {g.name: g for g in bench.groups}
    iters, bench.timer.iters = bench.timer.iters, 10
    shrink_wins: dict = {}
    expand_wins: dict = {}

    def best(cands, op, path, names, buffer_sets, rank, label) -> tuple[object, float]:
        scored = []
        for cfg in cands:
            cfg = replace(cfg, block_r=max(1 if path == "bgmv" else 16, min(cfg.block_r, rank)))
            try:
                us = sum(bench.timer(bench.op_fn(sc, groups[n], op, path, buf, cfg))
                         for sc, buf in buffer_sets for n in names)
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile is just not a winner
                us = math.inf
                log.append({"sweep": label, "op": op, "cfg": asdict(cfg), "error": str(exc)[:300]})
            scored.append((us, cfg))
            log.append({"sweep": label, "op": op, "groups": names, "cfg": asdict(cfg), "us": us})
            print(f"  sweep {label} {op} {'+'.join(names)} {asdict(cfg)}: {us:.1f} us", flush=True)
        us, cfg = min(scored, key=lambda s: s[0])
        return cfg, us

    def tune(path: str, block_m: int, shrink_cands, expand_cands, scenarios) -> float:
        total = 0.0
        for rank in ranks:
            sets = [(sc, bench.buffers(sc, block_m or None)) for sc in (Scenario(rank, t, a) for t, a in scenarios)]
            label = f"{path} block_m={block_m} r{rank}"
            for multi, names in ((True, ["qkv"]), (False, ["down"])):
                cfg, us = best(shrink_cands, "shrink", path, names, sets, rank, label)
                shrink_wins[(path, block_m, rank, multi)] = cfg
                total += us
            cfg, us = best(expand_cands, "expand", path, ["gate_up", "o"], sets, rank, label)
            expand_wins[(path, block_m, rank)] = cfg
            total += us
        return total

    if "bgmv" in classes:
        tune("bgmv", 0, BGMV_SHRINK, BGMV_EXPAND, classes["bgmv"])
    if "sgmv_small" in classes:
        tune("sgmv", 16, SGMV_SHRINK_SMALL, SGMV_EXPAND, classes["sgmv_small"])
    totals = {bm: tune("sgmv", bm, SGMV_SHRINK, SGMV_EXPAND, classes["sgmv"]) for bm in SGMV_BLOCK_M} \
        if "sgmv" in classes else {}
    block_m = min(totals, key=totals.get) if totals else lora_tuning.SGMV_BLOCK_M
    for table, wins in ((lora_tuning._SHRINK, shrink_wins), (lora_tuning._EXPAND, expand_wins)):
        kept = {k: v for k, v in table.items() if sweep_class(k) not in classes}
        table.clear()
        table.update(kept | {k: v for k, v in wins.items() if k[1] in (0, 16, block_m)})
    lora_tuning.SGMV_BLOCK_M = block_m
    lora_tuning.shrink_config.cache_clear()
    lora_tuning.expand_config.cache_clear()
    bench.timer.iters = iters
    return {"block_m": block_m, "block_m_totals_us": totals, "shrink": dict(lora_tuning._SHRINK),
            "expand": dict(lora_tuning._EXPAND)}


def table_source(winners: dict) -> str:
    """The winners as the Python literals of kernels/lora_tuning.py."""
    lines = [f"SGMV_BLOCK_M = {winners['block_m']}", "_SHRINK = {"]
    lines += [f"    {k!r}: {v!r}," for k, v in sorted(winners["shrink"].items())]
    lines += ["}", "_EXPAND = {"]
    lines += [f"    {k!r}: {v!r}," for k, v in sorted(winners["expand"].items())]
    return "\n".join(lines + ["}"])


# ---------------------------------------------------------------- report


def fmt(v: float, digits: int = 1) -> str:
    return "-" if v is None or (isinstance(v, float) and (math.isnan(v) or math.isinf(v))) else f"{v:.{digits}f}"


def markdown(results: list[Result], meta: dict) -> str:
    out = [
        f"Device: {meta['device']}; measured HBM copy bandwidth {meta['bandwidth_tbs']:.2f} TB/s; "
        f"torch {meta['torch']}, triton {meta['triton']}; bf16; per decoder layer = q/k/v + o + gate/up + down."
        + (f" Slots at rank {meta['slot_rank']}, adapters zero-padded to it; the slots' ranks "
           f"{'given (the padding is skipped)' if meta['ranks_given'] else 'not given (the padding is read)'}; "
           "the floor is the adapters' own rank's." if meta.get("slot_rank") else ""),
        "",
        "| scenario | path | rel err | LoRA layer µs | floor µs | % floor | base linears µs | LoRA/base | other path µs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.error:
            out.append(f"| {r.label} | {r.path} | error: {r.error.splitlines()[-1][:80]} | | | | | | |")
            continue
        out.append(
            f"| {r.label} | {r.path} | {r.rel_err:.1e} | {fmt(r.layer_us)} | {fmt(r.floor_us)} | {fmt(r.pct_floor, 0)} "
            f"| {fmt(r.base_us)} | {fmt(r.base_ratio, 2)} | {fmt(r.other_path_us)} |"
        )
    out += ["", "Per op (µs measured / µs floor):", "",
            "| scenario | " + " | ".join(f"{g}.{op}" for g in ("qkv", "o", "gate_up", "down")
                                          for op in ("shrink", "expand")) + " |",
            "|---" * 9 + "|"]
    for r in results:
        if r.ops:
            cells = [f"{fmt(v['us'])} / {fmt(v['floor_us'])}" for v in r.ops.values()]
            out.append(f"| {r.label} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def scenarios(ranks: list[int], smoke: bool) -> list[Scenario]:
    # (128, 32) and (128, 64): the decode graphs' top bucket in serving workloads (d) and (c)
    decode = [(1, 1), (16, 1), (16, 8), (64, 1), (64, 8), (64, 64), (128, 32), (128, 64), (256, 1), (256, 8),
              (256, 64)]
    prefill = [(1024, 1), (1024, 8), (1024, 64), (4096, 8), (8192, 1), (8192, 8), (8192, 64)]
    if smoke:
        decode, prefill = [(1, 1), (16, 8), (64, 64)], [(300, 8)]
    first = [Scenario(16, 64, 64), Scenario(16, 8192, 8)] if not smoke else []
    rest = [Scenario(r, t, a) for r in ranks for t, a in decode + prefill]
    return first + [s for s in rest if s not in first]


def run_sweep(bench: Bench, sweep_log: list, meta: dict, smoke: bool,
              wanted: tuple[str, ...] = SWEEP_CLASSES) -> None:
    """Sweep the `wanted` classes at the shapes that score them and record the resulting table in meta."""
    if smoke:
        for name in ("BGMV_SHRINK", "BGMV_EXPAND", "SGMV_SHRINK_SMALL", "SGMV_SHRINK", "SGMV_EXPAND"):
            globals()[name] = globals()[name][:2]
        classes = {"bgmv": [(8, 8)], "sgmv_small": [(40, 4)], "sgmv": [(40, 4)]}
        winners = sweep(bench, sweep_log, {c: classes[c] for c in wanted}, ranks=(16,))
    else:
        # BGMV is scored at the decode graphs' top bucket too (128 tokens, serving workloads (c) and (d))
        classes = {"bgmv": [(128, 64), (64, 64), (16, 8)], "sgmv_small": [(256, 64), (256, 8)],
                   "sgmv": [(8192, 8), (1024, 64)]}
        winners = sweep(bench, sweep_log, {c: classes[c] for c in wanted})
    meta["sweep_winners"] = table_source(winners)
    meta["sweep_block_m_totals_us"] = winners["block_m_totals_us"]
    print("sweep winners:\n" + meta["sweep_winners"], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--sweep", nargs="*", choices=SWEEP_CLASSES, metavar="CLASS",
                        help=f"sweep launch configs first: of the classes named ({', '.join(SWEEP_CLASSES)}), or all")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new scenarios after this")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script without a GPU")
    parser.add_argument("--in-slot-order", action="store_true",
                        help="tokens sorted by adapter slot instead of shuffled")
    parser.add_argument("--slot-rank", type=int, metavar="N",
                        help="slots allocated at max rank N, each scenario's adapters zero-padded to it, the slots' "
                             "ranks given to the kernels (which skip the padding)")
    parser.add_argument("--ignore-slot-ranks", action="store_true",
                        help="with --slot-rank: give the kernels no slot ranks, so they read the padding too")
    args = parser.parse_args()
    if args.ignore_slot_ranks and args.slot_rank is None:
        parser.error("--ignore-slot-ranks needs --slot-rank")
    if args.slot_rank is not None:
        if args.sweep is not None:
            parser.error("--slot-rank times the committed launch configs; sweep without it")
        if max(args.ranks) > args.slot_rank:
            parser.error(f"every rank of --ranks must fit the slots' rank {args.slot_rank}, got {args.ranks}")
    began = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    import triton

    meta = {
        "device": torch.cuda.get_device_name() if CUDA else "cpu (interpreter)",
        "torch": torch.__version__, "triton": triton.__version__,
        "command": " ".join(sys.argv),
        "slot_rank": args.slot_rank, "ranks_given": args.slot_rank is not None and not args.ignore_slot_ranks,
    }
    bandwidth = measure_bandwidth(DEVICE)
    meta["bandwidth_tbs"] = bandwidth / 1e12
    print(f"{meta['device']}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    bench = Bench(SMOKE if args.smoke else LLAMA3_8B, Timer(args.iters), bandwidth, args.in_slot_order,
                  args.slot_rank, meta["ranks_given"])
    sweep_log: list = []
    if args.sweep is not None:
        try:
            run_sweep(bench, sweep_log, meta, args.smoke, tuple(args.sweep) or SWEEP_CLASSES)
        except Exception:  # noqa: BLE001 - without winners the committed table still gives a full run
            meta["sweep_error"] = traceback.format_exc(limit=4)
            print(meta["sweep_error"], flush=True)
        meta["sweep_s"] = time.time() - began
    results: list[Result] = []

    def save() -> None:
        (args.out / "lora_kernels.json").write_text(json.dumps(
            {"meta": meta, "results": [asdict(r) for r in results], "sweep": sweep_log}, indent=1, default=str))
        (args.out / "lora_kernels.md").write_text(markdown(results, meta))

    save()
    for sc in scenarios(args.ranks, args.smoke):
        if time.time() - began > args.budget_s:
            print(f"budget reached; skipping {sc.label} and later", flush=True)
            break
        res = bench.scenario(sc)
        results.append(res)
        print(f"{res.label:18} {res.path} err {res.rel_err:.1e} layer {fmt(res.layer_us)} us floor {fmt(res.floor_us)} "
              f"base {fmt(res.base_us)} other {fmt(res.other_path_us)} {res.error.splitlines()[-1] if res.error else ''}",
              flush=True)
        save()
    print("\n" + markdown(results, meta).split("\n\nPer op")[0])
    print(f"total {time.time() - began:.0f} s")


if __name__ == "__main__":
    main()
