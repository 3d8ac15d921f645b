"""Session-wide tiny models, built once and shared by the engine and server tests."""
from __future__ import annotations

import pytest

from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")
