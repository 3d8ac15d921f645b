"""The folded B @ A of every module equals peft's own delta weight, for each way peft picks ranks and scalings."""
import pytest
import torch

from adapters_registry import load_adapter
from tests.tiny_models import make_peft_adapter

CASES = {
    "rank_and_alpha_patterns": dict(
        r=8,
        lora_alpha=16,
        rank_pattern={"q_proj": 4, r"layers\.1\.mlp\.down_proj": 12},
        alpha_pattern={"v_proj": 4, "model.layers.0.self_attn.o_proj": 32},
    ),
    "rslora_with_rank_pattern": dict(r=16, lora_alpha=8, use_rslora=True, rank_pattern={"gate_proj": 4}),
    "fan_in_fan_out": dict(r=4, lora_alpha=8, fan_in_fan_out=True),
    "regex_target_modules": dict(r=4, target_modules=r".*\.layers\.1\.self_attn\.(q|v)_proj"),
    "layers_to_transform": dict(
        r=4, target_modules=["q_proj", "down_proj"], layers_to_transform=[1], layers_pattern="layers"
    ),
    "full_name_ignores_layer_filter": dict(
        r=4, target_modules=["model.layers.0.self_attn.q_proj", "down_proj"], layers_to_transform=[1]
    ),
    "exclude_modules": dict(
        r=4, target_modules=["q_proj", "k_proj"], exclude_modules=["model.layers.0.self_attn.k_proj"]
    ),
}


def peft_deltas(base_dir, adapter_dir) -> dict[str, torch.Tensor]:
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(model, str(adapter_dir))
    prefix = "base_model.model."
    return {
        name.removeprefix(prefix): module.get_delta_weight("default")
        for name, module in peft_model.named_modules()
        if isinstance(module, peft.tuners.lora.LoraLayer)
    }


@pytest.mark.parametrize("case", list(CASES))
def test_folded_delta_matches_peft(base_dir, model_info, tmp_path, case):
    adapter_dir = make_peft_adapter(base_dir, tmp_path / case, **CASES[case])
    expected = peft_deltas(base_dir, adapter_dir)
    loaded = load_adapter(adapter_dir, model_info)
    assert sorted(loaded.modules) == sorted(expected)
    for module, weights in loaded.modules.items():
        torch.testing.assert_close(weights.lora_b @ weights.lora_a, expected[module], rtol=1e-5, atol=1e-6)


def test_rank_is_the_largest_module_rank(base_dir, model_info, tmp_path):
    adapter_dir = make_peft_adapter(base_dir, tmp_path / "a", r=4, rank_pattern={"up_proj": 12})
    loaded = load_adapter(adapter_dir, model_info)
    assert loaded.rank == 12
    assert loaded.modules["model.layers.0.mlp.up_proj"].rank == 12
    assert loaded.modules["model.layers.0.mlp.down_proj"].rank == 4


def test_rslora_scaling_is_alpha_over_sqrt_rank(base_dir, model_info, tmp_path):
    adapter_dir = make_peft_adapter(base_dir, tmp_path / "a", r=16, lora_alpha=8, use_rslora=True)
    weights = load_adapter(adapter_dir, model_info).modules["model.layers.0.self_attn.q_proj"]
    assert weights.scaling == 8 / 4


def test_loaded_tensors_are_float32_cpu_with_short_target_names_and_byte_count(good_adapter, model_info):
    loaded = load_adapter(good_adapter, model_info)
    tensors = [t for w in loaded.modules.values() for t in (w.lora_a, w.lora_b)]
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
    assert loaded.target_modules == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert loaded.nbytes == sum(t.nbytes for t in tensors)


@pytest.mark.parametrize("file_dtype", [torch.float32, torch.bfloat16])
def test_loading_in_bf16_gives_the_float32_load_rounded_to_bf16(base_dir, model_info, tmp_path, file_dtype):
    from safetensors.torch import load_file, save_file

    adapter_dir = make_peft_adapter(base_dir, tmp_path / "adapter", r=8, lora_alpha=13)  # scaling 1.625
    weights_file = adapter_dir / "adapter_model.safetensors"
    save_file({k: v.to(file_dtype) for k, v in load_file(weights_file).items()}, weights_file)
    reference = load_adapter(adapter_dir, model_info)
    loaded = load_adapter(adapter_dir, model_info, dtype=torch.bfloat16)
    assert loaded.modules.keys() == reference.modules.keys()
    for module, weights in loaded.modules.items():
        assert weights.lora_a.dtype == weights.lora_b.dtype == torch.bfloat16
        assert torch.equal(weights.lora_a, reference.modules[module].lora_a.to(torch.bfloat16))
        assert torch.equal(weights.lora_b, reference.modules[module].lora_b.to(torch.bfloat16))
