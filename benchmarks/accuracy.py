"""How far a kernel's result is from its reference, as every benchmark here reports it."""
from __future__ import annotations

import torch


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, computed in float64 whatever the two tensors' dtypes."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()
