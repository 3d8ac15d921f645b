"""Which board a benchmark ran on. The device calls land on different H200s, and the same code's latency-bound
kernels measure differently on them (decode graph replay at 128 rows on 64 adapters: 9.49-9.52 ms in the
twenty-ninth session, 9.71-9.74 in the thirty-second; BENCHMARKS.md). So each result records the GPU's identity and
limits, and figures from different boards can be told apart."""
from __future__ import annotations

import subprocess

FIELDS = ("name", "uuid", "pci.bus_id", "driver_version", "vbios_version", "clocks.max.sm", "clocks.max.memory",
          "power.limit", "ecc.mode.current", "temperature.gpu")


def parse(line: str) -> dict[str, str]:
    """One row of `nvidia-smi --query-gpu=<FIELDS> --format=csv,noheader,nounits` as field -> value."""
    values = [value.strip() for value in line.split(",")]
    if len(values) != len(FIELDS):
        raise ValueError(f"expected {len(FIELDS)} comma-separated values ({', '.join(FIELDS)}), got {line!r}")
    return dict(zip(FIELDS, values))


def gpu_identity(index: int = 0) -> dict[str, str]:
    """The identity of GPU `index` as nvidia-smi reports it; empty where there is no nvidia-smi (CPU runs), and the
    raw row where it does not parse (a benchmark's record must not end the benchmark)."""
    try:
        result = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
                                 "-i", str(index)], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return {}
    lines = result.stdout.strip().splitlines()
    line = lines[0] if lines else ""
    try:
        return parse(line)
    except ValueError:
        return {"nvidia-smi": line}
