"""The fused decoder-layer ops at Llama-3-8B shapes on the GPU: what each replaces against the Triton kernel.

For each op and token count it checks the Triton result and times both sides (median of
`triton.testing.do_bench_cudagraph`, CUDA-graph replay), so the choice of the CUDA default rests on
a measurement. RMSNorm, SiLU·up and the rotary embedding fused with the KV-cache write are timed
against their torch chains (checked against float64). The greedy choice (argmax and its
log-probability over the 128k vocabulary, at decode batch sizes) is timed against the torch chain
on float32 logits that the engine ran before.

The `+lora` rows time each op with the LoRA expand of the projection it consumes folded in
(`lora=`), against the expand launch (`lora_expand_slices`) followed by the plain op, with every
token on a random adapter of rank 16 (`--rank`). Up to 128 tokens (the per-token path) at 64 adapters, one row
per launch shape (`LoRAOpConfig`: columns or heads per step, rank block, warps); from 129 tokens
(the segment path, where the expand is SGMV) the tiled variants (`fused_lora_tiles_triton`) at 8
and 64 adapters, one row per launch shape (`LoRATileConfig`: columns per step or heads per program,
rank block, warps, rows per program, `mtile` for the whole tile). The kernel's default is marked `*`. The check is the
relative difference from expand-then-op (zero up to summation order). `--slot-rank N` puts the adapters in slots
of max rank N, zero-padded, and gives the kernels the slots' ranks (they skip the padding); `--ignore-slot-ranks`
gives none (they read it, as before slot ranks).

    python benchmarks/fused_ops.py [--tokens 64 128 8192] [--lora-only] [--ops silu_and_mul ...] [--out DIR]
    python benchmarks/fused_ops.py --lora-only --rank 16 --slot-rank 64 [--ignore-slot-ranks]
    python benchmarks/fused_ops.py --smoke     # tiny shapes; on a CPU under the Triton interpreter
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported
    os.environ.setdefault("LORASERVE_LORA_BACKEND", "triton")  # the expand the +lora rows set against

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accuracy import relative_error  # noqa: E402
from benchmarks.timing import graph_time_us  # noqa: E402
from kernels import (  # noqa: E402
    LoRADelta,
    fused_torch,
    fused_triton,
    greedy,
    greedy_triton,
    lora_expand_slices,
    lora_tuning,
    prepare_lora_metadata,
)
from kernels.fused_lora_tiles_triton import LORA_TILE_CONFIGS, LoRATileConfig  # noqa: E402
from kernels.fused_triton import LORA_CONFIGS, LoRAOpConfig  # noqa: E402

BLOCK_SIZE = 16
MAX_GREEDY_ROWS = 256  # one row per decoding sequence
DTYPE = torch.bfloat16
TORCH_CHAIN = "torch"
FLOAT32_CHAIN = "float32 upcast, max, logsumexp"
EXPAND_THEN_OP = "expand + op"
ADAPTERS, RANK = 64, 16
SEGMENT_ADAPTERS = (8, 64)  # adapter counts of the tiled variants' rows
LaunchConfig = LoRAOpConfig | LoRATileConfig  # the launch shape of a per-token or a tiled variant
OPS = ["add_rms_norm", "silu_and_mul", "rotary_and_write_kv", "greedy"]


@dataclass(frozen=True)
class Shapes:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


LLAMA3_8B = Shapes(4096, 14336, 32, 8, 128, 128256)
SMOKE = Shapes(64, 96, 4, 2, 16, 512)

# Launch shapes of the LoRA variants that the +lora rows time (the defaults in LORA_CONFIGS are added).
LORA_VARIANTS: dict[str, list[LoRAOpConfig]] = {
    "add_rms_norm": [LoRAOpConfig(chunk, 16, warps) for chunk, warps in
                     [(512, 8), (1024, 8), (1024, 16), (2048, 8), (2048, 16), (4096, 16), (4096, 32)]],
    # (128, 1, 4) and (256, 1, 8): 32 registers a thread on sm_90 (the default, (256, 1, 4), takes 56), so 100%
    # occupancy against 56%, with the same bytes per token
    "silu_and_mul": [LoRAOpConfig(chunk, 16, warps, per_program) for chunk, per_program, warps in
                     [(128, 1, 4), (128, 2, 4), (256, 1, 4), (256, 1, 8), (256, 2, 4), (256, 4, 8), (512, 1, 4),
                      (512, 1, 8), (512, 2, 8), (512, 4, 8), (1024, 1, 8)]],
    "rotary_and_write_kv": [LoRAOpConfig(heads, 16, warps) for heads, warps in
                            [(1, 2), (1, 4), (2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (8, 4), (8, 8)]],
}
# Launch shapes of the tiled variants (segment path; the defaults in LORA_TILE_CONFIGS are added): (columns, warps,
# rows per program; 0 = the whole tile, 64 rows at 8192 tokens).
LORA_TILE_VARIANTS: dict[str, list[LoRATileConfig]] = {
    "add_rms_norm": [LoRATileConfig(chunk, 16, warps, rows) for chunk, warps, rows in
                     [(128, 4, 16), (256, 4, 16), (256, 8, 16), (512, 8, 16), (256, 8, 32), (512, 8, 32),
                      (256, 8, 0), (512, 16, 0)]],
    "silu_and_mul": [LoRATileConfig(chunk, 16, warps, rows) for chunk, warps, rows in
                     [(64, 4, 0), (128, 4, 0), (128, 8, 0), (256, 8, 0), (64, 4, 32), (128, 4, 32), (256, 8, 32),
                      (128, 4, 16), (256, 4, 16)]]
    # rank blocks of 32 and 64 (the kernel takes min(block_r, the rank's power of two)): at ranks 32 and 64 a walk
    # then keeps B loaded for all its steps
    + [LoRATileConfig(chunk, block_r, 4, rows) for chunk, block_r, rows in
       [(128, 32, 0), (64, 32, 0), (128, 64, 0), (64, 64, 0), (32, 64, 0), (64, 64, 16)]],
    # heads per program, warps, rows per program (walked 16 at a time on B loaded once); 4 heads on 4 warps take 254
    # registers a thread on sm_90 (ptxas), so only the whole tile tries it
    "rotary_and_write_kv": [LoRATileConfig(heads, 16, warps, rows) for heads, warps, rows in
                            [(1, 4, 0), (1, 8, 0), (2, 4, 0), (2, 8, 0), (4, 4, 0), (4, 8, 0), (1, 4, 32), (1, 8, 32),
                             (2, 4, 32), (2, 8, 32), (4, 8, 32)]]
    # rank blocks of 64, as the SiLU·up's (for `--rank 32` / `--rank 64`)
    + [LoRATileConfig(heads, 64, warps, rows) for heads, warps, rows in [(1, 4, 32), (1, 4, 0), (2, 8, 32)]],
}


@dataclass
class Case:
    """One op at one token count: the code it replaces, the Triton kernel, and its check."""

    baseline: str
    run_baseline: Callable[[], object]
    run_triton: Callable[[], object]
    check: Callable[[], float]


@dataclass
class Inputs:
    """One token count's random activations, rotary tables, cache slots and caches."""

    shapes: Shapes
    tokens: int
    x: torch.Tensor
    residual: torch.Tensor
    weight: torch.Tensor
    gate_up: torch.Tensor
    qkv: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    num_blocks: int
    rank: int = RANK
    slot_rank: int | None = None  # the slots' allocated rank (None: the adapters' own)
    ranks_given: bool = False  # whether the slots' ranks go to the metadata

    @classmethod
    def random(cls, shapes: Shapes, tokens: int, device: torch.device, rank: int = RANK, slot_rank: int | None = None,
               ranks_given: bool = False) -> Inputs:
        s = shapes
        gen = torch.Generator(device=device).manual_seed(tokens)
        x = torch.randn(tokens, s.hidden, device=device, dtype=DTYPE, generator=gen)
        residual = torch.randn(tokens, s.hidden, device=device, dtype=DTYPE, generator=gen)
        weight = torch.rand(s.hidden, device=device, dtype=DTYPE, generator=gen) + 0.5
        gate_up = torch.randn(tokens, 2 * s.intermediate, device=device, dtype=DTYPE, generator=gen) * 3
        qkv = torch.randn(tokens, (s.heads + 2 * s.kv_heads) * s.head_dim, device=device, dtype=DTYPE, generator=gen)
        freqs = torch.outer(torch.arange(8192.0), 1.0 / 500000 ** (torch.arange(0, s.head_dim, 2) / s.head_dim))
        emb = torch.cat((freqs, freqs), dim=-1)
        positions = torch.randint(0, 8192, (tokens,), device=device, generator=gen)
        num_blocks = tokens // BLOCK_SIZE + 2
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device, generator=gen)[:tokens]
        return cls(s, tokens, x, residual, weight, gate_up, qkv, emb.cos().to(device), emb.sin().to(device),
                   positions, slots, num_blocks, rank, slot_rank, ranks_given)

    @property
    def qkv_widths(self) -> list[int]:
        s = self.shapes
        return [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim]

    def qkv_views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, t = self.shapes, self.tokens
        q, k, v = buffer.split(self.qkv_widths, dim=-1)
        return q.view(t, s.heads, s.head_dim), k.view(t, s.kv_heads, s.head_dim), v.view(t, s.kv_heads, s.head_dim)

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.shapes
        return tuple(torch.zeros(self.num_blocks, BLOCK_SIZE, s.kv_heads, s.head_dim, device=self.x.device,
                                 dtype=DTYPE) for _ in range(2))

    def lora(self, widths: list[int], seed: int, adapters: int = ADAPTERS) -> LoRADelta:
        """Every token on a random one of `adapters` adapters of rank `self.rank`, h as the shrink leaves it, in slots
        of rank `self.slot_rank` (h and B zero past the adapters' rank)."""
        device = self.x.device
        gen = torch.Generator(device=device).manual_seed(seed)
        slots = torch.randint(0, adapters, (self.tokens,), device=device, generator=gen, dtype=torch.int32)
        width = self.slot_rank or self.rank
        h = torch.zeros(len(widths), self.tokens, width, device=device)
        h[..., :self.rank] = torch.randn(len(widths), self.tokens, self.rank, device=device, generator=gen)
        b_slices = []
        for w in widths:
            b = torch.zeros(adapters, w, width, device=device, dtype=DTYPE)
            b[..., :self.rank] = torch.randn(adapters, w, self.rank, device=device, generator=gen).div(self.rank)
            b_slices.append(b)
        ranks = torch.full((adapters,), self.rank, dtype=torch.int32, device=device) if self.ranks_given else None
        return LoRADelta(h, tuple(b_slices), prepare_lora_metadata(slots, adapters, slot_ranks=ranks))


def _cases(inp: Inputs) -> dict[str, Case]:
    """op name -> its Case against the torch chain, on fresh random inputs."""
    x, residual, weight, gate_up, qkv = inp.x, inp.residual, inp.weight, inp.gate_up, inp.qkv
    cos, sin, positions, slots = inp.cos, inp.sin, inp.positions, inp.slots

    def check_norm() -> float:
        out, _ = fused_triton.add_rms_norm(x, residual, weight, 1e-5)
        want, _ = fused_torch.add_rms_norm(x.double(), residual.double(), weight.double(), 1e-5)
        return relative_error(out, want)

    def check_silu() -> float:
        return relative_error(fused_triton.silu_and_mul(gate_up), fused_torch.silu_and_mul(gate_up.double()))

    def check_rotary_and_write_kv() -> float:
        got, (k_cache, v_cache) = qkv.clone(), inp.caches()
        fused_triton.rotary_and_write_kv(*inp.qkv_views(got), cos, sin, positions, k_cache, v_cache, slots)
        want_q, want_k, _ = inp.qkv_views(qkv.double())
        want_q, want_k = fused_torch.rotary(want_q, want_k, cos.double(), sin.double(), positions)
        got_q, got_k, _ = inp.qkv_views(got)
        cached_k, cached_v = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]
        return max(relative_error(got_q, want_q), relative_error(got_k, want_k), relative_error(cached_k, want_k),
                   relative_error(cached_v, inp.qkv_views(qkv)[2]))

    q, k, v = inp.qkv_views(qkv.clone())
    k_cache, v_cache = inp.caches()
    vocab = inp.shapes.vocab
    gen = torch.Generator(device=x.device).manual_seed(inp.tokens)
    logits = torch.randn(min(inp.tokens, MAX_GREEDY_ROWS), vocab, device=x.device, dtype=DTYPE, generator=gen) * 4

    def check_greedy() -> float:
        token_ids, logprobs = greedy_triton.greedy(logits, vocab)
        reference = logits.double()
        if not torch.equal(token_ids, reference.argmax(dim=-1)):
            return float("inf")
        return relative_error(logprobs, reference.log_softmax(dim=-1).gather(1, token_ids[:, None]).squeeze(1))

    cases = {
        "add_rms_norm": Case(TORCH_CHAIN, lambda: fused_torch.add_rms_norm(x, residual, weight, 1e-5),
                             lambda: fused_triton.add_rms_norm(x, residual, weight, 1e-5), check_norm),
        "silu_and_mul": Case(TORCH_CHAIN, lambda: fused_torch.silu_and_mul(gate_up),
                             lambda: fused_triton.silu_and_mul(gate_up), check_silu),
        "rotary_and_write_kv": Case(
            TORCH_CHAIN, lambda: fused_torch.rotary_and_write_kv(q, k, v, cos, sin, positions, k_cache, v_cache, slots),
            lambda: fused_triton.rotary_and_write_kv(q, k, v, cos, sin, positions, k_cache, v_cache, slots),
            check_rotary_and_write_kv,
        ),
    }
    if inp.tokens <= MAX_GREEDY_ROWS:
        cases["greedy"] = Case(FLOAT32_CHAIN, lambda: greedy.greedy_torch(logits.float(), vocab),
                               lambda: greedy_triton.greedy(logits, vocab), check_greedy)
    return cases


def _expand(y: torch.Tensor, lora: LoRADelta) -> torch.Tensor:
    lora_expand_slices(y, lora.h, lora.b_slices, lora.meta)
    return y


def _variants(op: str) -> list[tuple[str, LoRAOpConfig]]:
    default = LORA_CONFIGS[op]
    configs = [default] + [c for c in LORA_VARIANTS[op] if c != default]
    return [(f"{op}+lora c{c.chunk}x{c.chunks_per_program} r{c.block_r} w{c.num_warps}{'*' if c == default else ''}",
             c) for c in configs]


def _tile_variants(op: str, adapters: int) -> list[tuple[str, LoRATileConfig]]:
    default = LORA_TILE_CONFIGS[op]
    configs = [default] + [c for c in LORA_TILE_VARIANTS[op] if c != default]
    return [(f"{op}+lora a{adapters} tile c{c.chunk} r{c.block_r} w{c.num_warps} m{c.rows or 'tile'}"
             f"{'*' if c == default else ''}", c) for c in configs]


def _lora_cases(inp: Inputs) -> dict[str, Case]:
    """'op+lora <launch shape>' -> the op with the expand folded in against the expand launch, then the op: on the
    per-token path the per-token variants against the per-token expand, on the segment path the tiled ones
    ('op+lora a<adapters> tile <launch shape>') against the SGMV expand."""
    if lora_tuning.choose_path(inp.tokens) == "sgmv":
        cases = {}
        for adapters in SEGMENT_ADAPTERS:
            cases.update(_folded_cases(inp, adapters, partial(_tile_variants, adapters=adapters), "tile_config"))
        return cases
    return _folded_cases(inp, ADAPTERS, _variants, "config")


def _folded_cases(inp: Inputs, adapters: int, variants: Callable[[str], list[tuple[str, LaunchConfig]]],
                  launch: str) -> dict[str, Case]:
    """For each op, the row of each of `variants(op)`: the op with the expand folded in, its launch shape passed
    as the keyword `launch`, against the expand launch, then the plain op (one baseline an op, timed once)."""
    x, residual, weight, gate_up, qkv = inp.x, inp.residual, inp.weight, inp.gate_up, inp.qkv
    cos, sin, positions, slots = inp.cos, inp.sin, inp.positions, inp.slots
    hidden_lora = inp.lora([inp.shapes.hidden], seed=1, adapters=adapters)
    gate_up_lora = inp.lora([inp.shapes.intermediate] * 2, seed=2, adapters=adapters)
    qkv_lora = inp.lora(inp.qkv_widths, seed=3, adapters=adapters)
    x_scratch, gate_up_scratch, qkv_scratch = x.clone(), gate_up.clone(), qkv.clone()
    q, k, v = inp.qkv_views(qkv_scratch)
    k_cache, v_cache = inp.caches()

    def expand_then_norm():
        return fused_triton.add_rms_norm(_expand(x_scratch, hidden_lora), residual, weight, 1e-5)

    def expand_then_silu():
        return fused_triton.silu_and_mul(_expand(gate_up_scratch, gate_up_lora))

    def expand_then_rotary():
        _expand(qkv_scratch, qkv_lora)
        fused_triton.rotary_and_write_kv(q, k, v, cos, sin, positions, k_cache, v_cache, slots)

    def norm(config: LaunchConfig) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_triton.add_rms_norm(x, residual, weight, 1e-5, hidden_lora, **{launch: config})

    def silu(config: LaunchConfig) -> torch.Tensor:
        return fused_triton.silu_and_mul(gate_up, gate_up_lora, **{launch: config})

    def rotary(config: LaunchConfig) -> None:
        fused_triton.rotary_and_write_kv(q, k, v, cos, sin, positions, k_cache, v_cache, slots, qkv_lora,
                                         **{launch: config})

    def check_norm(config: LaunchConfig) -> float:
        want = fused_triton.add_rms_norm(_expand(x.clone(), hidden_lora), residual, weight, 1e-5)
        return max(relative_error(a, b) for a, b in zip(norm(config), want))

    def check_silu(config: LaunchConfig) -> float:
        return relative_error(silu(config), fused_triton.silu_and_mul(_expand(gate_up.clone(), gate_up_lora)))

    def check_rotary(config: LaunchConfig) -> float:
        results = []
        for fold in (True, False):
            buffer, caches = qkv.clone(), inp.caches()
            if not fold:
                _expand(buffer, qkv_lora)
            fused_triton.rotary_and_write_kv(*inp.qkv_views(buffer), cos, sin, positions, *caches, slots,
                                             qkv_lora if fold else None, **{launch: config})
            results.append((buffer, *caches))
        return max(relative_error(a, b) for a, b in zip(*results))

    ops = [("add_rms_norm", expand_then_norm, norm, check_norm), ("silu_and_mul", expand_then_silu, silu, check_silu),
           ("rotary_and_write_kv", expand_then_rotary, rotary, check_rotary)]
    return {name: Case(EXPAND_THEN_OP, baseline, partial(run, config), partial(check, config))
            for op, baseline, run, check in ops for name, config in variants(op)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 16, 64, 256, 2048, 8192])
    parser.add_argument("--lora-only", action="store_true", help="only the +lora rows")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=OPS, metavar="OP",
                        help=f"only these ops' rows, of {OPS}")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on a CPU (Triton interpreter)")
    parser.add_argument("--rank", type=int, default=RANK, help="the adapters' rank (default %(default)s)")
    parser.add_argument("--slot-rank", type=int, metavar="N",
                        help="slots of max rank N, the adapters zero-padded to it, the slots' ranks given to the "
                             "kernels")
    parser.add_argument("--ignore-slot-ranks", action="store_true",
                        help="with --slot-rank: give the kernels no slot ranks, so they read the padding too")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.ignore_slot_ranks and args.slot_rank is None:
        parser.error("--ignore-slot-ranks needs --slot-rank")
    if args.slot_rank is not None and args.slot_rank < args.rank:
        parser.error(f"--slot-rank {args.slot_rank} cannot hold adapters of rank {args.rank}")
    ranks_given = args.slot_rank is not None and not args.ignore_slot_ranks
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = SMOKE if args.smoke else LLAMA3_8B
    if args.smoke:
        args.tokens = [3, lora_tuning.SGMV_MIN_TOKENS]  # the per-token path and the segment path
    rows = []
    print(f"{'op':<52}{'tokens':>7}{'baseline us':>13}{'triton us':>11}{'speedup':>9}{'rel err':>10}  baseline")
    for tokens in args.tokens:
        inp = Inputs.random(shapes, tokens, device, args.rank, args.slot_rank, ranks_given)
        cases = {} if args.lora_only else _cases(inp)
        cases.update(_lora_cases(inp))
        cases = {name: case for name, case in cases.items() if name.split("+")[0] in args.ops}
        baseline_us: dict[Callable, float] = {}
        for name, case in cases.items():
            err = case.check()
            if case.run_baseline not in baseline_us:
                baseline_us[case.run_baseline] = graph_time_us(case.run_baseline, device, rep_ms=50, cpu_calls=2)
            before = baseline_us[case.run_baseline]
            triton_us = graph_time_us(case.run_triton, device, rep_ms=50, cpu_calls=2)
            rows.append(dict(op=name, tokens=tokens, baseline=case.baseline, baseline_us=before, triton_us=triton_us,
                             rel_err=err, rank=args.rank, slot_rank=args.slot_rank or args.rank,
                             ranks_given=ranks_given))
            print(f"{name:<52}{tokens:>7}{before:>13.1f}{triton_us:>11.1f}{before / triton_us:>8.2f}x"
                  f"{err:>10.1e}  {case.baseline}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fused_ops.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
