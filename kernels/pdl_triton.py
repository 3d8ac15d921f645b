"""Programmatic dependent launch (PDL) for the Triton kernels of a step.

Launched with PDL (Hopper and later), a kernel may start while its predecessor in the stream is still
running, so its launch and the work that reads only data no kernel of the step writes (weights, pointer
math) overlap the predecessor's tail. Each kernel takes `USE_PDL` and calls `wait_for_predecessor` before it
reads anything a kernel of the step may have written (activations, device metadata) and before it writes
anything; every program calls it, before any early exit, so a kernel never completes before its predecessor.
Only then does it let its own successor start, so a chain never runs two kernels ahead.
`USE_PDL` is False off CUDA and under the interpreter, which has no grid dependency control.
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


# True under TRITON_INTERPRET=1 (read at import): every kernel is interpreted, even with CUDA tensors. The
# interpreter has no grid dependency control (and its bfloat16 dots go through float32: `lora_triton`).
INTERPRETED = not isinstance(wait_for_predecessor, triton.runtime.JITFunction)


def pdl_launch(device: torch.device, wanted: bool = True) -> dict[str, bool]:
    """The keyword arguments of a launch on `device`: the kernel's USE_PDL and Triton's `launch_pdl` option,
    both `use_pdl(device)` unless the kernels are interpreted or the caller does not want PDL for this launch."""
    flag = wanted and use_pdl(device) and not INTERPRETED
    return {"USE_PDL": flag, "launch_pdl": flag}
