"""What the engine says as it starts: how long each phase took and what it holds, as vLLM logs it."""
from __future__ import annotations

import logging
import re

from tests.engine.conftest import make_engine


def test_the_engine_logs_its_weights_kv_cache_and_start_up_time(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="loraserve.engine"):
        engine = make_engine(tiny_llama, num_kv_blocks=12, block_size=16)
    text = caplog.text
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert re.search(rf"loaded in \d+\.\d s: {weights / 2**30:.2f} GiB of weights in float32 on cpu", text)
    assert "KV cache: 12 blocks of 16 tokens (192 tokens," in text
    assert re.search(r"engine ready in \d+\.\d s", text)
