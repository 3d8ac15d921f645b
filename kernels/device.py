"""What the device offers that static launch shapes depend on (looked up once, not per launch)."""
from __future__ import annotations

from functools import cache

import torch


@cache
def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs one program at a time)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
