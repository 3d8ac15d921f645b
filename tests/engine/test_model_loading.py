"""Where models come from: local directories, the Hub (offline here), GGUF, the embedded default."""
from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.model_loader import resolve_model_dir


def test_a_missing_local_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nowhere"))


def test_a_directory_without_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_dir(str(tmp_path))


def test_an_uncached_hub_id_offline_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        resolve_model_dir("some-org/some-model")


def test_unsupported_architecture_is_refused(tmp_path):
    import transformers

    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="Unsupported model type 'gpt2'"):
        LLMEngine(EngineConfig(model=str(tmp_path), device="cpu"))


@pytest.fixture(scope="module")
def default_llm():
    return LLM(device="cpu", max_model_len=512)


def test_the_embedded_default_knows_the_capital_of_france(default_llm):
    (output,) = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                                 SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert "Paris" in output.outputs[0].text
    assert output.outputs[0].finish_reason == "stop"


def test_the_converted_gguf_is_cached_for_the_next_start(default_llm):
    import time

    from engine.model_loader import convert_gguf, embedded_default_gguf

    start = time.perf_counter()
    cached = convert_gguf(embedded_default_gguf())
    assert time.perf_counter() - start < 1.0
    assert (cached / "config.json").is_file() and list(cached.glob("*.safetensors"))
