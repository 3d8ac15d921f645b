"""Switches read from the environment: which implementation a kernel family runs (`triton` or `torch`), and
other two-valued choices (`lora_tuning.fold_expand`)."""
from __future__ import annotations

import os


def env_switch(env: str, on: str, off: str, default: bool) -> bool:
    """True for `on`, False for `off`, `default` when the variable is unset or empty; other values are refused."""
    choice = os.environ.get(env, "")
    if choice not in ("", on, off):
        raise ValueError(f"{env} must be {on!r} or {off!r}, got {choice!r}")
    return choice == on if choice else default


def use_triton(env: str, default: bool) -> bool:
    return env_switch(env, "triton", "torch", default)
