"""Programmatic dependent launch (PDL) for the Triton kernels of a step.

Launched with PDL (Hopper and later), a kernel may start while its predecessor in the stream is still
running, so its launch and the work that reads only data no kernel of the step writes (weights, pointer
math) overlap the predecessor's tail. Each kernel takes `USE_PDL` and calls `wait_for_predecessor` before it
reads anything a kernel of the step may have written (activations, device metadata) and before it writes
anything; every program calls it, before any early exit, so a kernel never completes before its predecessor.
Only then does it let its own successor start, so a chain never runs two kernels ahead.
`USE_PDL` is False off CUDA and under the interpreter, which has no grid dependency control.

Adapter weights (never written during a step) sit behind a slot index that is device data, so a kernel could
only start its weight stream after the wait. Under PDL the per-token LoRA kernels therefore read their slot
early as a hint (`slot_hint`) and ask L2 for the weight lines it names (`prefetch_l2`, `prefetch_l2_span`)
before they wait: a prefetch changes no result, so a stale hint (an earlier step's slot) costs only bandwidth.
The real slot is read again after the wait, and only it chooses what the kernel loads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels.device import use_pdl


@triton.jit
def wait_for_predecessor(USE_PDL: tl.constexpr):
    """Under PDL: block until the previous kernel has finished and its writes are visible, then let the next
    kernel launch. Nothing without it."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def slot_hint(ptr):
    """A read, before the wait, of a slot a predecessor may be writing: it races with that write, so its value
    (this step's slot or an earlier step's; slot buffers start zeroed and hold only slots) serves nothing but
    prefetch addresses. `.cg` keeps the line out of L1, where the read after the wait could find it stale."""
    return tl.load(ptr, cache_modifier=".cg")


@triton.jit
def prefetch_l2(ptrs, USE_PDL: tl.constexpr):
    """Under PDL: ask L2 for the 128-byte line of each address in `ptrs` (a prefetch, not a load: nothing is
    held in registers across the wait). Nothing without it; the interpreter has no inline asm."""
    if USE_PDL:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def prefetch_l2_span(ptr, lo, hi, LINES: tl.constexpr, USE_PDL: tl.constexpr):
    """Under PDL: prefetch the elements [lo, hi) of `ptr` into L2, one address per 128-byte line, LINES lines a
    step."""
    if USE_PDL:
        line: tl.constexpr = 1024 // ptr.dtype.element_ty.primitive_bitwidth
        for start in range(lo, hi, LINES * line):
            prefetch_l2(ptr + tl.minimum(start + tl.arange(0, LINES) * line, hi - 1), USE_PDL)


# Under TRITON_INTERPRET=1 (at import) the kernels are interpreted, even with CUDA tensors, and the interpreter
# has no grid dependency control.
_INTERPRETED = not isinstance(wait_for_predecessor, triton.runtime.JITFunction)


def pdl_launch(device: torch.device, wanted: bool = True) -> dict[str, bool]:
    """The keyword arguments of a launch on `device`: the kernel's USE_PDL and Triton's `launch_pdl` option,
    both `use_pdl(device)` unless the kernels are interpreted or the caller does not want PDL for this launch."""
    flag = wanted and use_pdl(device) and not _INTERPRETED
    return {"USE_PDL": flag, "launch_pdl": flag}
