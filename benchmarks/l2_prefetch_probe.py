"""Does prefetching o_proj's weights into L2 on a side stream, while decode attention streams the KV cache,
shorten a decode layer? (H200, eleventh session: no, 172 -> 176-180 us a layer; BENCHMARKS.md.)

The base decode layer's chain (norm, qkv, rotary + KV write, decode attention, o, norm, gate/up, SiLU·up,
down) at batch 64 over a 560-token context, Llama-3-8B shapes, 32 distinct layers in one CUDA graph so that
weights and KV come from HBM. Modes: base; the prefetch of W_o forked beside the attention (pf_attn) or
beside the rotary and the attention (pf_rot), each with plain and evict_last (`_last`) prefetches.

    python3 benchmarks/l2_prefetch_probe.py --out DIR
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hbm import measure_bandwidth  # noqa: E402
from benchmarks.timing import median_replay_us  # noqa: E402
from kernels import fused  # noqa: E402
from kernels.attention import decode_attention  # noqa: E402

BATCH, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, BLOCK, CONTEXT = 64, 4096, 32, 8, 128, 14336, 32, 16, 560
MODES = ("base", "pf_attn", "pf_attn_last", "pf_rot", "pf_rot_last")
LINE_ELEMS = 64  # bf16 elements in a 128-byte line


@triton.jit
def _prefetch_kernel(ptr, n_lines, LINES: tl.constexpr, EVICT_LAST: tl.constexpr):
    lines = tl.program_id(0) * LINES + tl.arange(0, LINES)
    addr = ptr + tl.minimum(lines, n_lines - 1).to(tl.int64) * 64
    if EVICT_LAST:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; // $0", "=r,l", [addr], dtype=tl.int32,
                                  is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [addr], dtype=tl.int32,
                                  is_pure=False, pack=1)


def prefetch(w: torch.Tensor, evict_last: bool, lines_per_program: int = 1024) -> None:
    """Ask L2 for every line of w (one prefetch instruction per 128-byte line)."""
    n = w.numel() // LINE_ELEMS
    _prefetch_kernel[(triton.cdiv(n, lines_per_program),)](w, n, LINES=lines_per_program, EVICT_LAST=evict_last,
                                                           num_warps=4)


class LayerChain:
    """32 distinct decode layers' weights and KV caches, and the step that runs them in one mode."""

    def __init__(self, device: torch.device) -> None:
        bf = torch.bfloat16

        def weight(n: int, k: int) -> torch.Tensor:
            return torch.randn(n, k, device=device, dtype=bf) * k ** -0.5

        qkv_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.layers = [dict(qkv=weight(qkv_width, HIDDEN), o=weight(HIDDEN, HEADS * HEAD_DIM),
                            gate_up=weight(2 * INTER, HIDDEN), down=weight(HIDDEN, INTER))
                       for _ in range(LAYERS)]
        self.norm = torch.ones(HIDDEN, device=device, dtype=bf)
        width = CONTEXT // BLOCK + 1
        blocks = BATCH * width
        self.caches = [tuple(torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=bf) for _ in "kv")
                       for _ in range(LAYERS)]
        self.tables = torch.randperm(blocks, device=device).view(BATCH, width).to(torch.int32)
        self.lens = torch.full((BATCH,), CONTEXT, device=device, dtype=torch.int32)
        self.positions = self.lens.long() - 1
        self.slots = self.tables[:, (CONTEXT - 1) // BLOCK].long() * BLOCK + (CONTEXT - 1) % BLOCK
        angles = (torch.arange(8192, device=device, dtype=torch.float)[:, None]
                  * 10000 ** (-torch.arange(0, HEAD_DIM, 2, device=device) / HEAD_DIM)[None])
        self.cos, self.sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        self.x = torch.randn(BATCH, HIDDEN, device=device, dtype=bf)
        self.attn_out = torch.empty(BATCH, HEADS, HEAD_DIM, device=device, dtype=bf)
        self.side = torch.cuda.Stream(device)

    def floor_us_per_layer(self, bandwidth: float) -> float:
        weights = sum(t.numel() * 2 for t in self.layers[0].values())
        return (weights + BATCH * CONTEXT * KV_HEADS * HEAD_DIM * 4) / bandwidth * 1e6

    def fork_prefetch(self, w: torch.Tensor, mode: str) -> None:
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            prefetch(w, mode.endswith("_last"))

    def run(self, mode: str) -> torch.Tensor:
        x, residual = self.x, None
        split = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
        for w, (k_cache, v_cache) in zip(self.layers, self.caches):
            h, residual = fused.add_rms_norm(x, residual, self.norm, 1e-5)
            q, k, v = (h @ w["qkv"].t()).split(split, -1)
            q, k, v = (t.view(BATCH, -1, HEAD_DIM) for t in (q, k, v))
            if mode.startswith("pf_rot"):
                self.fork_prefetch(w["o"], mode)
            fused.rotary_and_write_kv(q, k, v, self.cos, self.sin, self.positions, k_cache, v_cache, self.slots)
            if mode.startswith("pf_attn"):
                self.fork_prefetch(w["o"], mode)
            decode_attention(q, k_cache, v_cache, self.tables, self.lens, HEAD_DIM ** -0.5, out=self.attn_out)
            if mode != "base":
                torch.cuda.current_stream().wait_stream(self.side)
            h, residual = fused.add_rms_norm(self.attn_out.view(BATCH, -1) @ w["o"].t(), residual, self.norm, 1e-5)
            x = fused.silu_and_mul(h @ w["gate_up"].t()) @ w["down"].t()
        return x


def time_us_per_layer(chain: LayerChain, mode: str) -> tuple[float, torch.Tensor]:
    """Median of 7 replays of the mode's 32-layer graph, per layer, and the chain's output."""
    y = chain.run(mode)
    return median_replay_us(lambda: chain.run(mode), 7) / LAYERS, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.backends.cuda.preferred_blas_library("cublaslt")  # as the engine's 32-64-row decode graphs
    chain = LayerChain(device)
    floor = chain.floor_us_per_layer(measure_bandwidth("cuda"))
    results: dict = {"floor_us_per_layer": floor}
    reference = None
    with torch.inference_mode():
        for mode in (*MODES, "base"):
            us, y = time_us_per_layer(chain, mode)
            reference = y.clone() if reference is None else reference
            results.setdefault(mode, []).append(us)
            print(f"{mode:14} {us:7.1f} us a layer (floor {floor:.1f}), output as base: {torch.equal(y, reference)}",
                  flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "l2_prefetch_probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
