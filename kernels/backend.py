"""Which implementation a kernel family runs: an environment variable forces `triton` or `torch`."""
from __future__ import annotations

import os


def use_triton(env: str, default: bool) -> bool:
    choice = os.environ.get(env, "")
    if choice not in ("", "triton", "torch"):
        raise ValueError(f"{env} must be 'triton' or 'torch', got {choice!r}")
    return choice == "triton" if choice else default
