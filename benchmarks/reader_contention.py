"""How much adapter reads on background threads slow the engine thread down (CPU only, no GPU needed).

    python benchmarks/reader_contention.py --readers 1 4

The engine thread is stood in for by a loop of small torch calls with a little Python between them
(what a Triton launch or an eager op looks like to the interpreter). While reader threads load
Llama-3-8B-shaped rank-16 adapters (84 MB each) and lay them out in a slot row, as `LoRAManager`
does, the loop's progress is compared with its speed alone. A fraction well under 1 with one reader
(no CPU contention on two cores) means the readers hold up the loop through the GIL.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters_registry import LoadedAdapter, ModelInfo, load_adapter  # noqa: E402
from benchmarks.serving import make_adapters, module_shapes  # noqa: E402


def engine_like_call(x: torch.Tensor) -> None:
    arguments = {i: i * 2 for i in range(20)}  # the launcher's Python: binding arguments
    x.add_(1e-6 * len(arguments))


def lay_out(adapter: LoadedAdapter, row: torch.Tensor) -> None:
    """The slot-row copies of `SlotLayout.write`, one per A and B, into one bf16 row."""
    tensors = [t for weights in adapter.modules.values() for t in (weights.lora_a, weights.lora_b)]
    for view, tensor in zip(row.split([t.numel() for t in tensors]), tensors):
        view.copy_(tensor.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--readers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--adapters", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="reader-contention-"))
    paths = make_adapters(root / "adapters", root / "model", "llama3-8b", total=args.adapters, unique=2)
    model = ModelInfo(architecture="LlamaForCausalLM", model_type="llama", name_or_path=str(root / "model"),
                      module_shapes=module_shapes("llama3-8b"), max_lora_rank=16)
    numel = sum(16 * (out_f + in_f) for out_f, in_f in model.module_shapes.values())
    x = torch.zeros(64, 64)
    calls = 20000
    start = time.perf_counter()
    for _ in range(calls):
        engine_like_call(x)
    alone = (time.perf_counter() - start) / calls
    print(f"engine-like call alone: {1e6 * alone:.1f} us")

    def read(path: Path) -> None:
        lay_out(load_adapter(path, model), torch.empty(numel, dtype=torch.bfloat16))

    for readers in args.readers:
        with ThreadPoolExecutor(readers) as pool:
            futures = [pool.submit(read, path) for path in paths]
            done, start = 0, time.perf_counter()
            while not all(future.done() for future in futures):
                engine_like_call(x)
                done += 1
            wall = time.perf_counter() - start
        print(f"{readers} reader thread(s): {len(paths)} adapters read in {1e3 * wall:.0f} ms; the engine-like "
              f"loop ran at {done * alone / wall:.2f} of its speed alone")


if __name__ == "__main__":
    main()
