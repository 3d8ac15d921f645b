"""Our forward pass against transformers in float32: prefill and every decode step."""
from __future__ import annotations

import pytest
import torch
import transformers

from engine import SamplingParams
from tests.engine.conftest import make_engine
from tests.tiny_models import make_tiny_model

VARIANTS = {
    "llama": dict(arch="llama"),
    "qwen2-bias": dict(arch="qwen2"),
    "mistral": dict(arch="mistral"),
    "llama-tied": dict(arch="llama", tie_word_embeddings=True),
    "llama3-rope-scaling": dict(arch="llama", max_position_embeddings=512, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)),
    "mha-3-layers": dict(arch="llama", num_heads=4, num_kv_heads=4, num_layers=3),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant_dir(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


def _captured_logits(engine, prompt_ids: list[int], max_tokens: int):
    captured = []
    original = engine.model.compute_logits

    def capture(hidden):
        logits = original(hidden)
        captured.append(logits)
        return logits

    engine.model.compute_logits = capture
    try:
        engine.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        finished = []
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
    finally:
        engine.model.compute_logits = original
    return torch.cat(captured), finished[0].outputs[0].token_ids


def test_prefill_and_decode_logits_match_transformers(variant_dir):
    engine = make_engine(variant_dir, block_size=4)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(variant_dir), dtype=torch.float32).eval()
    prompt = engine.tokenize("The capital of France is Paris. Hello world!")
    ours, generated = _captured_logits(engine, prompt, max_tokens=10)
    full = torch.tensor([prompt + generated])
    with torch.no_grad():
        ref = reference(full).logits[0, len(prompt) - 1:-1]
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-4


def test_sharded_checkpoint_loads_the_same_weights(tiny_llama, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    model.save_pretrained(str(tmp_path), max_shard_size="100KB")
    transformers.AutoTokenizer.from_pretrained(str(tiny_llama)).save_pretrained(str(tmp_path))
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    sharded, single = make_engine(tmp_path), make_engine(tiny_llama)
    for (name, a), (_, b) in zip(sharded.model.state_dict().items(), single.model.state_dict().items()):
        assert torch.equal(a, b), name
