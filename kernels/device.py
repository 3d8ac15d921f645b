"""What the device offers that static launch shapes depend on (looked up once, not per launch)."""
from __future__ import annotations

from functools import cache

import torch

from kernels.backend import env_switch

# `LORASERVE_PDL=1|0`: launch the Triton kernels with programmatic dependent launch or not (unset: where supported).
PDL_ENV = "LORASERVE_PDL"


@cache
def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs one program at a time)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@cache
def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch (each may start while its
    predecessor finishes, `kernels.pdl_triton`): on NVIDIA devices of compute capability 9.0 or more, unless
    LORASERVE_PDL=0. The variable is read once per device and process (a bad value raises ValueError)."""
    wanted = env_switch(PDL_ENV, "1", "0", default=True)
    return (wanted and device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device) >= (9, 0))
