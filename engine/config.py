"""Engine settings, validated once at construction (vLLM's names where vLLM has one)."""
from __future__ import annotations

from dataclasses import dataclass

from .scheduler import check_admission_order

CUDAGRAPH_MODES = ("full_and_piecewise", "full_decode_only")


@dataclass
class EngineConfig:
    model: str | None = None  # HF dir, Hub id, or .gguf file; None = embedded default
    revision: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto
    device: str = "auto"  # cpu | cuda | auto
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit KV pool size; else sized from memory
    kv_cache_memory_bytes: int | None = None  # KV memory budget (CPU default: 1 GiB)
    gpu_memory_utilization: float = 0.85
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    allow_pickle_adapters: bool = False
    # where adapter weights are read in the background: "threads", or "process" (child processes filling
    # shared host memory, so reads never contend for the engine thread's GIL; not with tensor parallelism);
    # "auto": processes on CUDA without tensor parallelism, threads otherwise
    adapter_reader: str = "auto"
    enforce_eager: bool = False  # CUDA only: False replays CUDA graphs (which ones: cudagraph_mode)
    # CUDA graphs (vLLM's names): "full_and_piecewise" captures whole decode steps and the pieces of mixed
    # steps between attentions (engine/piecewise_graphs.py); "full_decode_only" runs mixed steps eagerly
    cudagraph_mode: str = "full_and_piecewise"
    # launch each step before reading the previous one's tokens back (they are drawn on the device, whatever the
    # sampling parameters), so the host's scheduling and bookkeeping overlap the GPU (with CUDA graphs, one
    # process; otherwise steps are synchronous)
    async_scheduling: bool = True
    async_scheduling_eager: bool = False  # overlap without CUDA graphs too (CPU tests: the same code, no gain)
    tensor_parallel_size: int = 1  # ranks (one process and one GPU each) the model is sharded over
    load_format: str = "auto"  # "dummy": random weights at the checkpoint's shapes (benchmarks)
    seed: int = 0
    # the order waiting requests are admitted in: "fcfs", or "balanced" (adapter by adapter, giving each free
    # adapter slot to the adapter that fills the batch best; see engine/scheduler.py)
    admission_order: str = "fcfs"
    # balanced only: an adapter with this many fewer steps left than a waiting one yields its slot to it, keeping
    # its KV blocks (None: never; see Scheduler._suspension). On the H200's workload (d), +0.4% to +2.2% on three
    # Zipf seeds since admission runs over the step in flight (BENCHMARKS.md, twenty-second session)
    suspend_margin: int | None = 32

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu, cuda or auto; got {self.device!r}")
        for name in ("max_num_seqs", "block_size", "max_loras", "max_lora_rank", "tensor_parallel_size",
                     "max_model_len", "max_num_batched_tokens", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and value < 1:  # None: derived from the model or the memory
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        if self.adapter_reader not in ("auto", "threads", "process"):
            raise ValueError(f"adapter_reader must be 'auto', 'threads' or 'process', got {self.adapter_reader!r}")
        if self.adapter_reader == "process" and self.tensor_parallel_size > 1:
            raise ValueError("adapter_reader='process' does not work with tensor parallelism; use 'threads'")
        check_admission_order(self.admission_order)
        if self.suspend_margin is not None and self.suspend_margin < 1:
            raise ValueError(f"suspend_margin must be at least 1 or None, got {self.suspend_margin}")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}; got {self.cudagraph_mode!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
