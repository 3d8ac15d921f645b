"""Tensor parallelism: Megatron-style model and LoRA sharding over one process per rank."""
from .driver import DriverModel, launch_tensor_parallel
from .sharding import check_tensor_parallel_size

__all__ = ["DriverModel", "check_tensor_parallel_size", "launch_tensor_parallel"]
