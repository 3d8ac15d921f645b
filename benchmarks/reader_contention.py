"""How much adapter reads on background threads slow the engine thread down (CPU only, no GPU needed).

    python benchmarks/reader_contention.py --readers 1 4 --process 1 2

The engine thread is stood in for by a loop of small torch calls with a little Python between them
(what a Triton launch or an eager op looks like to the interpreter). While reader threads load
Llama-3-8B-shaped rank-16 adapters (84 MB each) and lay them out in a slot row, as `LoRAManager`
does, the loop's progress is compared with its speed alone. A fraction well under 1 with one reader
(no CPU contention on two cores) means the readers hold up the loop through the GIL. `--process N...`
also times the same reads by `ProcessReader`s of N children (`adapter_reader="process"`), which take no
GIL of ours. Adapters are loaded in the pool's dtype (bf16), as the engine loads them.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters_registry import ModelInfo, load_adapter  # noqa: E402
from benchmarks.serving import SHAPES, make_adapters, module_shapes  # noqa: E402
from engine.adapter_reader import ProcessReader  # noqa: E402
from engine.lora_layout import SlotLayout  # noqa: E402


def engine_like_call(x: torch.Tensor) -> None:
    arguments = {i: i * 2 for i in range(20)}  # the launcher's Python: binding arguments
    x.add_(1e-6 * len(arguments))


def llama3_8b_layout() -> SlotLayout:
    """The engine's slot layout for Llama-3-8B at rank 16, from the projection shapes alone."""
    shape = SHAPES["llama3-8b"]
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = hidden // shape["num_attention_heads"] * shape["num_key_value_heads"]
    linears = {  # the engine's fused projections: names, output sizes, input features
        "self_attn.qkv_proj": (["q_proj", "k_proj", "v_proj"], [hidden, kv, kv], hidden),
        "self_attn.o_proj": (["o_proj"], [hidden], hidden),
        "mlp.gate_up_proj": (["gate_proj", "up_proj"], [inter, inter], hidden),
        "mlp.down_proj": (["down_proj"], [hidden], inter),
    }
    layers = {f"model.layers.{i}.{prefix}": SimpleNamespace(names=names, out_sizes=sizes, in_features=in_features)
              for i in range(shape["num_hidden_layers"]) for prefix, (names, sizes, in_features) in linears.items()}
    return SlotLayout(layers, 16)


def engine_speed_during(reads: list[Future], x: torch.Tensor, alone: float) -> tuple[float, float]:
    """(seconds until every read finished, the engine-like loop's speed meanwhile, as a fraction of alone)."""
    done, start = 0, time.perf_counter()
    while not all(future.done() for future in reads):
        engine_like_call(x)
        done += 1
    wall = time.perf_counter() - start
    for future in reads:
        future.result()
    return wall, done * alone / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--readers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--process", type=int, nargs="*", default=[],
                        help="also time ProcessReaders with these numbers of child processes")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="reader-contention-"))
    paths = make_adapters(root / "adapters", root / "model", "llama3-8b", total=args.adapters, unique=2)
    model = ModelInfo(architecture="LlamaForCausalLM", model_type="llama", name_or_path=str(root / "model"),
                      module_shapes=module_shapes("llama3-8b"), max_lora_rank=16)
    layout = llama3_8b_layout()
    x = torch.zeros(64, 64)
    calls = 20000
    start = time.perf_counter()
    for _ in range(calls):
        engine_like_call(x)
    alone = (time.perf_counter() - start) / calls
    print(f"engine-like call alone: {1e6 * alone:.1f} us")
    pool = torch.empty(len(paths), layout.numel, dtype=torch.bfloat16)

    def read(row: int) -> None:
        layout.write(load_adapter(paths[row], model, dtype=pool.dtype), pool[row])

    for readers in args.readers:
        with ThreadPoolExecutor(readers) as threads:
            wall, speed = engine_speed_during([threads.submit(read, row) for row in range(len(paths))], x, alone)
        print(f"{readers} reader thread(s): {len(paths)} adapters read in {1e3 * wall:.0f} ms; the engine-like "
              f"loop ran at {speed:.2f} of its speed alone")
    if args.process:
        pool.share_memory_()
    for processes in args.process:
        reader = ProcessReader(pool, layout, model, allow_pickle=False, processes=processes)
        try:
            for warm in [reader.submit(paths[row], row) for row in range(processes)]:
                warm.result()  # each child's first read, before timing
            wall, speed = engine_speed_during([reader.submit(path, row) for row, path in enumerate(paths)], x, alone)
        finally:
            reader.close()
        print(f"{processes} reader process(es): {len(paths)} adapters read in {1e3 * wall:.0f} ms; the engine-like "
              f"loop ran at {speed:.2f} of its speed alone")


if __name__ == "__main__":
    main()
