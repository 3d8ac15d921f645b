"""Skinny GEMM `y = x @ w^T` for small M (decode batches): streams W at close to HBM bandwidth.

One program per (N block, K split, M block). With M small (decode, up to ~128 rows) the time is
W's bytes, so the kernel keeps many bytes of W in flight (deep K blocks, several pipeline stages)
and splits K until there are enough programs to fill every SM. Splits reduce inside the same
launch: each writes float32 partials to a workspace, then bumps a per-tile counter; the program
that arrives last sums the partials, writes y and puts the counter back to zero, so the next
call and every CUDA-graph replay find it zero. No memset, no second launch, no host sync, no
allocation once `out` and `workspace` are given: the calls can be captured in a CUDA graph.
A workspace serves one stream at a time (calls on one stream run one after another).

With `use_pdl` (programmatic dependent launch, Hopper and later) the kernel may start while the kernel
before it in the stream is still running. W is never written during a step, so each program first
asks L2 for its first `config.prefetch` K blocks of W (the pointer math and the prefetches need nothing
the previous kernel writes), then waits for that kernel (`gdc_wait`), and only then reads x and runs the
pipelined K loop, whose first W loads find their lines in L2 or on the way (a prefetch, not a load into
registers: the software-pipelined loop stays as it is and holds no tile across the wait). After the K loop,
before its stores and the split-K reduction, it lets the next kernel launch (`gdc_launch_dependents`). Every program
waits before its first read of x and its first write, so nothing is read early or overwritten while the
previous kernel still uses it. Under the Triton interpreter (no inline asm) `use_pdl` is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import linear_tuning
from kernels.device import multiprocessor_count
from kernels.linear_tuning import LinearConfig

MAX_BLOCK_M = 128
MIN_BLOCK = 16  # tl.dot's smallest dimension
L2_LINE_BYTES = 128


@triton.jit
def _tile_offsets(offs_m, offs_n, stride_m, SWAP_AB: tl.constexpr):
    """Offsets of an [M, N] row-major tile, laid out as the accumulator is: [N, M] when swapped."""
    if SWAP_AB:
        offs = offs_n[:, None] + offs_m[None, :].to(tl.int64) * stride_m
    else:
        offs = offs_m[:, None].to(tl.int64) * stride_m + offs_n[None, :]
    return offs


@triton.jit
def _tile_mask(offs_m, offs_n, M, N, SWAP_AB: tl.constexpr):
    if SWAP_AB:
        mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    else:
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    return mask


@triton.jit
def _dot_acc(acc, a, b, DOT_F32: tl.constexpr):
    """acc + a @ b; DOT_F32 computes in true float32 (float32 inputs must not round through tf32, and the
    interpreter's bfloat16 dot is unreliable)."""
    if DOT_F32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _prefetch_w_then_wait(w_ptr, rows_w, k_lo, k_hi, BLOCK_K: tl.constexpr, LINES: tl.constexpr,
                          LINE_ELEMS: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr):
    """Under PDL: prefetch into L2 the first PREFETCH K blocks of this program's W rows (one address per 128-byte
    line, clamped to the split), then wait for the previous kernel to finish and its writes to be visible."""
    if USE_PDL:
        lines = tl.arange(0, LINES) * LINE_ELEMS
        for p in tl.static_range(PREFETCH):
            cols = tl.minimum(k_lo + p * BLOCK_K + lines, k_hi - 1)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l",
                                      [w_ptr + rows_w[:, None] + cols[None, :]], dtype=tl.int32, is_pure=False, pack=1)
        gdc_wait()


@triton.jit
def _launch_dependents(USE_PDL: tl.constexpr):
    """Under PDL: let the next kernel in the stream start (it waits for this one before reading its output)."""
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def _finish_tile(acc, y_ptr, part_ptr, count_ptr, M, N, stride_ym, split_size, pid_n, ks, pid_m,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, SWAP_AB: tl.constexpr):
    """Store the tile's y, or with split K its partial, and let the last split to arrive sum them all and reset
    the tile's counter."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y_offs = _tile_offsets(offs_m, offs_n, stride_ym, SWAP_AB)
    y_mask = _tile_mask(offs_m, offs_n, M, N, SWAP_AB)
    if SPLIT_K == 1:
        tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        part_offs = _tile_offsets(offs_m, offs_n, N, SWAP_AB)
        tl.store(part_ptr + ks.to(tl.int64) * split_size + part_offs, acc, mask=y_mask)
        tl.debug_barrier()  # every thread's partial is written before the counter's release
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(count_ptr + tile, 1)
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()
            for s in tl.static_range(SPLIT_K):
                if s != ks:
                    acc += tl.load(part_ptr + tl.full((), s, tl.int64) * split_size + part_offs, mask=y_mask, other=0.0,
                                   cache_modifier=".cg")
            tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
            tl.store(count_ptr + tile, 0)


@triton.jit(do_not_specialize=["M"])  # one compile for any batch size in a tile height
def _linear_kernel(
    x_ptr, w_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym, k_per_split, split_size,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr, DOT_F32: tl.constexpr,
    LINES: tl.constexpr, LINE_ELEMS: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    ks = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past M or N read the last valid row instead of masking: their results are never stored.
    rows_x = tl.minimum(offs_m, M - 1).to(tl.int64) * stride_xm
    rows_w = tl.minimum(offs_n, N - 1).to(tl.int64) * stride_wn
    k_lo = ks * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    _prefetch_w_then_wait(w_ptr, rows_w, k_lo, k_hi, BLOCK_K, LINES, LINE_ELEMS, PREFETCH, USE_PDL)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    if SWAP_AB:
        x_ptrs = x_ptr + rows_x[None, :] + offs_k[:, None]  # x^T tile [BLOCK_K, BLOCK_M]
        w_ptrs = w_ptr + rows_w[:, None] + offs_k[None, :]  # W tile [BLOCK_N, BLOCK_K]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        x_ptrs = x_ptr + rows_x[:, None] + offs_k[None, :]  # x tile [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + rows_w[None, :] + offs_k[:, None]  # W^T tile [BLOCK_K, BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            xv = tl.load(x_ptrs)
            wv = tl.load(w_ptrs)
        else:
            in_k = k0 + tl.arange(0, BLOCK_K) < K
            if SWAP_AB:
                xv = tl.load(x_ptrs, mask=in_k[:, None], other=0.0)
                wv = tl.load(w_ptrs, mask=in_k[None, :], other=0.0)
            else:
                xv = tl.load(x_ptrs, mask=in_k[None, :], other=0.0)
                wv = tl.load(w_ptrs, mask=in_k[:, None], other=0.0)
        if SWAP_AB:
            acc = _dot_acc(acc, wv, xv, DOT_F32)
        else:
            acc = _dot_acc(acc, xv, wv, DOT_F32)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _launch_dependents(USE_PDL)
    _finish_tile(acc, y_ptr, part_ptr, count_ptr, M, N, stride_ym, split_size, pid_n, ks, pid_m,
                 BLOCK_M, BLOCK_N, SPLIT_K, SWAP_AB)


@triton.jit(do_not_specialize=["M"])
def _linear_tma_kernel(
    x_desc, w_desc, w_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, stride_wn, stride_ym, k_per_split, split_size,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr, DOT_F32: tl.constexpr,
    LINES: tl.constexpr, LINE_ELEMS: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr,
):
    """As `_linear_kernel`, with x and W tiles copied by TMA (tensor descriptors), which zero-fills past M, N
    and K: no masks, no address arithmetic per element. `w_ptr` serves only the prefetch before the wait."""
    pid_n = tl.program_id(0)
    ks = tl.program_id(1)
    pid_m = tl.program_id(2)
    k_lo = ks * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if USE_PDL:
        rows_w = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64) * stride_wn
        _prefetch_w_then_wait(w_ptr, rows_w, k_lo, k_hi, BLOCK_K, LINES, LINE_ELEMS, PREFETCH, USE_PDL)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        xv = x_desc.load([pid_m * BLOCK_M, k0])
        wv = w_desc.load([pid_n * BLOCK_N, k0])
        if SWAP_AB:
            acc = _dot_acc(acc, wv, xv.T, DOT_F32)
        else:
            acc = _dot_acc(acc, xv, wv.T, DOT_F32)
    _launch_dependents(USE_PDL)
    _finish_tile(acc, y_ptr, part_ptr, count_ptr, M, N, stride_ym, split_size, pid_n, ks, pid_m,
                 BLOCK_M, BLOCK_N, SPLIT_K, SWAP_AB)


# Under TRITON_INTERPRET=1 (at import) the kernel is interpreted: dots of bfloat16 then go through float32.
_INTERPRETED = not isinstance(_linear_kernel, triton.runtime.JITFunction)


@dataclass(frozen=True)
class LinearWorkspace:
    """Split-K scratch for calls up to `max_m` x `max_n` with up to `max_split_k` splits: float32 partials (always
    written before they are read) and one int32 arrival counter per output tile, made zeroed. Make it once,
    outside any CUDA-graph capture; the kernel leaves the counters at zero after every call."""

    partials: torch.Tensor
    counters: torch.Tensor
    max_m: int
    max_n: int
    max_split_k: int

    @classmethod
    def create(cls, max_m: int, max_n: int, max_split_k: int, device: torch.device | str) -> LinearWorkspace:
        partials = torch.empty(max_split_k * max_m * max_n, dtype=torch.float32, device=device)
        counters = torch.zeros(_num_tiles(max_m, max_n, MIN_BLOCK), dtype=torch.int32, device=device)
        return cls(partials, counters, max_m, max_n, max_split_k)

    def fits(self, m: int, n: int, split_k: int) -> bool:
        return m <= self.max_m and n <= self.max_n and split_k <= self.max_split_k


def block_m_for(m: int) -> int:
    """Rows per tile: M padded to a power of two, at least tl.dot's 16, at most MAX_BLOCK_M."""
    return min(MAX_BLOCK_M, max(MIN_BLOCK, triton.next_power_of_2(m)))


def _num_tiles(m: int, n: int, block_n: int) -> int:
    return triton.cdiv(m, block_m_for(m)) * triton.cdiv(n, block_n)


def _tma_ready(t: torch.Tensor) -> bool:
    """TMA copies need a 16-byte aligned base and row stride."""
    return t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0


def _check(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"expected x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or w.dtype != x.dtype:
        raise ValueError(f"x and w must share one of float32/float16/bfloat16, got {x.dtype} and {w.dtype}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w must have unit stride along K (any row stride)")
    if out is not None and (out.shape != (x.shape[0], w.shape[0]) or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(f"out must be [{x.shape[0]}, {w.shape[0]}] {x.dtype} with unit column stride")


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    workspace: LinearWorkspace | None = None,
    config: LinearConfig | None = None,
    use_pdl: bool = False,
) -> torch.Tensor:
    """y = x @ weight^T, [M, N] in x's dtype, accumulated in float32.

    `config` defaults to `linear_tuning.choose_config` for the shape and the device's SM count. With split_k > 1
    and no workspace, a zeroed one is made for this call (eager use only: pass one made ahead when capturing a
    graph). `use_pdl` launches with programmatic dependent launch (compute capability 9.0 or more; see the
    module docstring); the interpreter ignores it.
    """
    _check(x, weight, out)
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = config or linear_tuning.choose_config(m, n, k, multiprocessor_count(x.device))
    block_m = block_m_for(m)
    block_k = max(MIN_BLOCK, min(cfg.block_k, triton.next_power_of_2(k)))
    block_n = max(MIN_BLOCK, cfg.block_n)
    k_blocks = triton.cdiv(k, block_k)
    blocks_per_split = triton.cdiv(k_blocks, cfg.split_k)
    split_k = triton.cdiv(k_blocks, blocks_per_split)  # no empty split
    k_per_split = blocks_per_split * block_k
    if split_k > 1:
        if workspace is None:
            workspace = LinearWorkspace.create(m, n, split_k, x.device)
        elif not workspace.fits(m, n, split_k):
            raise ValueError(f"workspace for {workspace.max_m}x{workspace.max_n} split {workspace.max_split_k} "
                             f"is too small for {m}x{n} split {split_k}")
        partials, counters = workspace.partials, workspace.counters
    else:
        partials, counters = out, out  # not read without splits
    pdl = use_pdl and not _INTERPRETED
    line_elems = min(block_k, L2_LINE_BYTES // weight.element_size())
    grid = (triton.cdiv(n, block_n), split_k, triton.cdiv(m, block_m))
    meta = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k, "SWAP_AB": cfg.swap_ab,
            "DOT_F32": x.dtype == torch.float32 or (_INTERPRETED and x.dtype == torch.bfloat16),
            "LINES": block_k // line_elems, "LINE_ELEMS": line_elems,
            "PREFETCH": min(cfg.prefetch, blocks_per_split) if pdl else 0, "USE_PDL": pdl,
            "num_warps": cfg.num_warps, "num_stages": cfg.num_stages} | ({"launch_pdl": True} if pdl else {})
    if cfg.tma and _tma_ready(x) and _tma_ready(weight):
        x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
        w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
        _linear_tma_kernel[grid](
            x_desc, w_desc, weight, out, partials, counters, m, n, k, weight.stride(0), out.stride(0), k_per_split,
            m * n, **meta,
        )
    else:
        _linear_kernel[grid](
            x, weight, out, partials, counters, m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split,
            m * n, EVEN_K=k % block_k == 0, **meta,
        )
    return out
