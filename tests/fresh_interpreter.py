"""Running a test file again in a new Python process with the Triton interpreter on.

Triton picks the interpreter when it is first imported, so a process that imported it without
`TRITON_INTERPRET=1` (a CPU run of the whole suite) cannot run the Triton kernels itself: the tests that
need them run once more in a child process that can.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def triton_interpreted_here() -> bool:
    """Whether this process can run the Triton kernels: on CUDA, or with the interpreter chosen at start."""
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def run_pytest_interpreted(target: Path, select: str | None = None) -> str:
    """pytest on `target` (the tests `select` picks with -k) in a child process with the Triton interpreter
    on; its output, after asserting that it passed."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(target)]
    if select is not None:
        command += ["-k", select]
    run = subprocess.run(command, cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    return run.stdout
