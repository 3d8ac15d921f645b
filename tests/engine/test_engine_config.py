"""EngineConfig refuses sizes that cannot work, before anything is loaded, rather than failing every request later."""
from __future__ import annotations

import pytest

from engine import EngineConfig


@pytest.mark.parametrize("name", ["max_model_len", "max_num_batched_tokens", "num_kv_blocks", "max_num_seqs",
                                  "block_size"])
@pytest.mark.parametrize("value", [0, -5])
def test_a_size_below_one_is_refused_naming_it(name, value):
    with pytest.raises(ValueError, match=f"{name} must be at least 1, got {value}"):
        EngineConfig(model="unused", **{name: value})


def test_sizes_left_unset_are_derived_later():
    config = EngineConfig(model="unused")
    assert config.max_model_len is None and config.max_num_batched_tokens is None and config.num_kv_blocks is None
