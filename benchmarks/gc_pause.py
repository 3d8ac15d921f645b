"""How long one collection of Python's oldest generation stalls a server process, before and after
`engine.gc_heap.freeze_startup_heap` (which `loraserve serve` calls once start-up is done).

    python benchmarks/gc_pause.py            # the embedded model on the CPU, with LoRA enabled

Any thread's allocation can trigger such a collection, and it walks every tracked object: the model's
modules, the imported libraries, the graphs. While it runs, the engine thread and the HTTP loop wait.
"""
from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM  # noqa: E402
from engine.gc_heap import freeze_startup_heap  # noqa: E402


def full_collection_ms(repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    llm = LLM(device="cpu", dtype="float32", max_model_len=1024, enable_lora=True, max_loras=2)
    print(f"tracked objects: {len(gc.get_objects())}")
    print(f"full collection: {full_collection_ms():.1f} ms")
    freeze_startup_heap()
    print(f"after freeze_startup_heap ({gc.get_freeze_count()} frozen): {full_collection_ms():.1f} ms")
    del llm


if __name__ == "__main__":
    main()
