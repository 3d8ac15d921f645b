"""Adapter validation: what loads, and each adapter the engine cannot serve correctly refused with a clear message."""
import dataclasses
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapters_registry import AdapterError, check_adapter, load_adapter
from tests.tiny_models import make_tiny_model

WEIGHTS = "adapter_model.safetensors"
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


def rewrite_weights(adapter, edit):
    tensors = load_file(str(adapter / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(adapter / WEIGHTS))


def refusal(adapter, model_info, **kwargs) -> str:
    """load_adapter's message; check_adapter, reading only the header, must refuse with the same one."""
    messages = []
    for read in (load_adapter, check_adapter):
        with pytest.raises(AdapterError) as exc:
            read(adapter, model_info, **kwargs)
        messages.append(str(exc.value))
    assert messages[0] == messages[1]
    return messages[0]


def test_good_adapter_loads(good_adapter, model_info):
    assert load_adapter(good_adapter, model_info).rank == 8


def test_good_adapter_passes_the_header_check(good_adapter, model_info):
    assert check_adapter(good_adapter, model_info) is None


def test_missing_config_is_refused(adapter_copy, model_info):
    adapter = adapter_copy()
    (adapter / "adapter_config.json").unlink()
    assert "No adapter_config.json in" in refusal(adapter, model_info)


def test_invalid_json_config_is_refused(adapter_copy, model_info):
    adapter = adapter_copy()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA",')
    assert "adapter_config.json is not valid JSON" in refusal(adapter, model_info)


def test_config_that_is_not_an_object_is_refused(adapter_copy, model_info):
    adapter = adapter_copy()
    (adapter / "adapter_config.json").write_text("[1, 2]")
    assert "must hold a JSON object" in refusal(adapter, model_info)


def test_non_lora_peft_type_is_refused(adapter_copy, model_info):
    message = refusal(adapter_copy(peft_type="PREFIX_TUNING"), model_info)
    assert message == "Only LoRA adapters are supported: adapter_config.json has peft_type 'PREFIX_TUNING', not 'LORA'."


def test_rank_above_max_lora_rank_is_refused_with_vllm_message(good_adapter, model_info):
    small = dataclasses.replace(model_info, max_lora_rank=4)
    assert refusal(good_adapter, small) == "LoRA rank 8 is greater than max_lora_rank 4."


def test_rank_pattern_above_max_lora_rank_is_refused(adapter_copy, model_info):
    adapter = adapter_copy(rank_pattern={"q_proj": 32})
    assert refusal(adapter, model_info) == "LoRA rank 32 is greater than max_lora_rank 16."


def test_rank_pattern_matching_no_module_does_not_count_against_max_rank(adapter_copy, model_info):
    adapter = adapter_copy(rank_pattern={"lm_head": 64})
    assert load_adapter(adapter, model_info).rank == 8


def test_dora_is_refused(adapter_copy, model_info):
    assert refusal(adapter_copy(use_dora=True), model_info) == "DoRA adapters (use_dora: true) are not supported."


def test_modules_to_save_is_refused(adapter_copy, model_info):
    message = refusal(adapter_copy(modules_to_save=["lm_head"]), model_info)
    assert message.startswith("Adapters with modules_to_save ['lm_head'] are not supported")


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_trained_bias_is_refused(adapter_copy, model_info, bias):
    message = refusal(adapter_copy(bias=bias), model_info)
    assert message == f"Adapters with trained biases (bias: '{bias}') are not supported; bias must be 'none'."


def test_lora_bias_is_refused(adapter_copy, model_info):
    message = refusal(adapter_copy(lora_bias=True), model_info)
    assert message == "Adapters with a LoRA bias (lora_bias: true) are not supported."


def test_layer_replication_is_refused(adapter_copy, model_info):
    message = refusal(adapter_copy(layer_replication=[[0, 2], [1, 2]]), model_info)
    assert message == "Adapters using layer replication (layer_replication) are not supported."


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "loftq"])
def test_an_unconverted_adapter_whose_init_rewrites_the_base_weights_is_refused(adapter_copy, model_info, init):
    message = refusal(adapter_copy(init_lora_weights=init), model_info)
    assert message.startswith(f"Adapters initialised with init_lora_weights {init!r} change the base model's weights")
    assert "Convert the adapter to a plain LoRA first" in message


@pytest.mark.parametrize("init", [True, False, "gaussian", "orthogonal"])
def test_an_init_that_leaves_the_base_weights_alone_loads(adapter_copy, model_info, init):
    assert load_adapter(adapter_copy(init_lora_weights=init), model_info).rank == 8


@pytest.mark.parametrize("target", ["embed_tokens", "lm_head"])
def test_listed_target_without_lora_path_is_refused(adapter_copy, model_info, target):
    message = refusal(adapter_copy(target_modules=["q_proj", target]), model_info)
    assert message.startswith(f"target module '{target}' has no LoRA path in this model (supported: q_proj, k_proj")


def test_a_listed_target_the_model_does_not_have_is_passed_over_as_peft_does(adapter_copy, good_adapter,
                                                                            model_info):
    targets = json.loads((good_adapter / "adapter_config.json").read_text())["target_modules"]
    adapter = load_adapter(adapter_copy(target_modules=[*targets, "c_attn"]), model_info)
    assert adapter.modules.keys() == load_adapter(good_adapter, model_info).modules.keys()


def test_all_linear_in_capitals_targets_every_projection(adapter_copy, good_adapter, model_info):
    adapter = load_adapter(adapter_copy(target_modules="ALL-LINEAR"), model_info)
    assert adapter.modules.keys() == load_adapter(good_adapter, model_info).modules.keys()


def test_regex_target_matching_lm_head_is_refused(adapter_copy, model_info):
    message = refusal(adapter_copy(target_modules=r".*(q_proj|lm_head)"), model_info)
    assert message.startswith(r"target_modules '.*(q_proj|lm_head)' matches lm_head, which has no LoRA path")


def test_regex_target_matching_nothing_is_refused(adapter_copy, model_info):
    message = refusal(adapter_copy(target_modules=r".*\.attn\.c_proj"), model_info)
    assert "matches no LoRA-capable module of this model" in message


def test_all_linear_targets_every_projection(adapter_copy, model_info):
    loaded = load_adapter(adapter_copy(target_modules="all-linear"), model_info)
    assert sorted(loaded.modules) == sorted(model_info.module_shapes)


def test_missing_target_modules_is_refused(adapter_copy, model_info):
    message = refusal(adapter_copy(target_modules=None), model_info)
    assert message.startswith("adapter_config.json: target_modules must be a non-empty list")


def test_non_integer_rank_is_refused(adapter_copy, model_info):
    assert refusal(adapter_copy(r="8"), model_info) == "adapter_config.json: r must be a positive integer, got '8'."


def test_different_architecture_in_auto_mapping_is_refused(adapter_copy, model_info):
    adapter = adapter_copy(auto_mapping={"base_model_class": "GPT2LMHeadModel", "parent_library": "x"})
    message = refusal(adapter, model_info)
    assert message == f"Adapter {adapter} was trained for GPT2LMHeadModel, but the served model is LlamaForCausalLM."


def test_different_model_type_of_local_base_is_refused(adapter_copy, model_info, tmp_path):
    qwen = make_tiny_model(tmp_path / "qwen", arch="qwen2")
    adapter = adapter_copy(base_model_name_or_path=str(qwen), auto_mapping=None)
    message = refusal(adapter, model_info)
    assert message == (
        f"Adapter {adapter} was trained for a 'qwen2' model ({qwen}), "
        "but the served model is 'llama' (LlamaForCausalLM)."
    )


def test_same_architecture_other_checkpoint_warns_and_loads(adapter_copy, model_info, caplog):
    adapter = adapter_copy(base_model_name_or_path="someone/other-llama")
    with caplog.at_level(logging.WARNING, logger="loraserve.adapters"):
        loaded = load_adapter(adapter, model_info)
    assert loaded.rank == 8
    assert "was trained on someone/other-llama but the served model is" in caplog.text


def test_same_checkpoint_does_not_warn(good_adapter, model_info, caplog):
    with caplog.at_level(logging.WARNING, logger="loraserve.adapters"):
        load_adapter(good_adapter, model_info)
    assert caplog.text == ""


def test_missing_weights_file_is_refused(adapter_copy, model_info):
    adapter = adapter_copy()
    (adapter / WEIGHTS).unlink()
    assert "No adapter_model.safetensors (or adapter_model.bin) in" in refusal(adapter, model_info)


def test_truncated_weights_file_is_refused(adapter_copy, model_info):
    adapter = adapter_copy()
    data = (adapter / WEIGHTS).read_bytes()
    (adapter / WEIGHTS).write_bytes(data[: len(data) // 2])
    assert "adapter_model.safetensors is corrupt or truncated" in refusal(adapter, model_info)


def test_garbage_weights_file_is_refused(adapter_copy, model_info):
    adapter = adapter_copy()
    (adapter / WEIGHTS).write_bytes(b"not a safetensors file at all")
    assert "adapter_model.safetensors is corrupt or truncated" in refusal(adapter, model_info)


def pickle_adapter(adapter):
    torch.save(load_file(str(adapter / WEIGHTS)), str(adapter / "adapter_model.bin"))
    (adapter / WEIGHTS).unlink()
    return adapter


def test_pickle_weights_are_refused_by_default(adapter_copy, model_info):
    message = refusal(pickle_adapter(adapter_copy()), model_info)
    assert "adapter_model.bin is a pickle file, which can run arbitrary code; refusing to load it" in message


def test_pickle_weights_load_when_allowed(adapter_copy, good_adapter, model_info):
    loaded = load_adapter(pickle_adapter(adapter_copy()), model_info, allow_pickle=True)
    expected = load_adapter(good_adapter, model_info)
    q0 = "model.layers.0.self_attn.q_proj"
    assert torch.equal(loaded.modules[q0].lora_b, expected.modules[q0].lora_b)


def test_corrupt_pickle_is_refused_even_when_allowed(adapter_copy, model_info):
    adapter = pickle_adapter(adapter_copy())
    (adapter / "adapter_model.bin").write_bytes(b"\x80\x04garbage")
    message = refusal(adapter, model_info, allow_pickle=True)
    assert "adapter_model.bin is corrupt or not a weights-only state dict" in message


def test_wrong_tensor_shape_is_refused_naming_module_expected_and_got(adapter_copy, model_info):
    adapter = adapter_copy()
    rewrite_weights(adapter, lambda t: t.update({f"{Q0}.lora_A.weight": torch.zeros(8, 32)}))
    message = refusal(adapter, model_info)
    assert message == "Adapter weight lora_A for model.layers.0.self_attn.q_proj has shape [8, 32]; expected [8, 64]."


def test_missing_lora_b_is_refused(adapter_copy, model_info):
    adapter = adapter_copy()
    rewrite_weights(adapter, lambda t: t.pop(f"{Q0}.lora_B.weight"))
    assert refusal(adapter, model_info) == "Adapter weights for model.layers.0.self_attn.q_proj are missing lora_B."


def test_targeted_module_without_weights_is_refused(adapter_copy, model_info):
    adapter = adapter_copy()
    rewrite_weights(adapter, lambda t: [t.pop(f"{Q0}.lora_{side}.weight") for side in "AB"])
    message = refusal(adapter, model_info)
    assert message == "Adapter weights for model.layers.0.self_attn.q_proj are missing lora_A and lora_B."


def test_weights_for_untargeted_module_are_refused(adapter_copy, model_info):
    adapter = adapter_copy(target_modules=["k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    message = refusal(adapter, model_info)
    assert message == (
        "Adapter weights include model.layers.0.self_attn.q_proj, which is not targeted by adapter_config.json."
    )


def test_lora_weights_for_module_without_lora_path_are_refused(adapter_copy, model_info):
    adapter = adapter_copy()
    extra = {"lm_head.lora_A.weight": torch.zeros(8, 64), "lm_head.lora_B.weight": torch.zeros(384, 8)}
    rewrite_weights(adapter, lambda t: t.update({f"base_model.model.{k}": v for k, v in extra.items()}))
    assert refusal(adapter, model_info) == "Adapter weights include lm_head, which has no LoRA path in this model."


def test_full_embedding_weights_in_file_are_refused(adapter_copy, model_info):
    adapter = adapter_copy()
    rewrite_weights(adapter, lambda t: t.update({"base_model.model.model.embed_tokens.weight": torch.zeros(4, 64)}))
    message = refusal(adapter, model_info)
    assert message == (
        "weight file has non-LoRA tensor base_model.model.model.embed_tokens.weight "
        "(trained base weights are not supported)."
    )


def test_dora_magnitude_in_weights_is_refused(adapter_copy, model_info):
    adapter = adapter_copy()
    rewrite_weights(adapter, lambda t: t.update({f"{Q0}.lora_magnitude_vector": torch.ones(64)}))
    assert "DoRA adapters are not supported" in refusal(adapter, model_info)


def test_adapter_name_key_form_is_accepted(adapter_copy, good_adapter, model_info):
    adapter = adapter_copy()

    def add_adapter_name(tensors):
        for key in list(tensors):
            tensors[key.replace(".weight", ".default.weight")] = tensors.pop(key)

    rewrite_weights(adapter, add_adapter_name)
    loaded = load_adapter(adapter, model_info)
    assert set(loaded.modules) == set(load_adapter(good_adapter, model_info).modules)


def test_invalid_regex_in_rank_pattern_is_refused(adapter_copy, model_info):
    message = refusal(adapter_copy(rank_pattern={"q_proj(": 4}), model_info)
    assert message.startswith("adapter_config.json has an invalid regex pattern")
    assert "q_proj(" in message


def test_invalid_regex_target_modules_is_refused(adapter_copy, model_info):
    assert "invalid regex pattern '[q'" in refusal(adapter_copy(target_modules="[q"), model_info)


def test_malformed_layers_to_transform_is_refused(adapter_copy, model_info):
    message = refusal(adapter_copy(layers_to_transform="1"), model_info)
    assert message == "adapter_config.json: layers_to_transform must be an integer or a list, got '1'."


def test_integer_lora_weights_are_refused(adapter_copy, model_info):
    adapter = adapter_copy()
    rewrite_weights(adapter, lambda t: t.update({f"{Q0}.lora_A.weight": torch.zeros(8, 64, dtype=torch.int32)}))
    message = refusal(adapter, model_info)
    assert message == f"{Q0}.lora_A.weight has dtype torch.int32; LoRA weights must be floating point."


def test_two_lora_a_weights_for_one_module_are_refused(adapter_copy, model_info):
    adapter = adapter_copy()
    rewrite_weights(adapter, lambda t: t.update({f"{Q0}.lora_A.default.weight": t[f"{Q0}.lora_A.weight"].clone()}))
    message = refusal(adapter, model_info)
    assert message == "weight file has more than one lora_A for model.layers.0.self_attn.q_proj."


def test_bf16_adapter_passes_the_header_check(adapter_copy, model_info):
    adapter = adapter_copy()
    rewrite_weights(adapter, lambda t: t.update({k: v.bfloat16() for k, v in t.items()}))
    assert check_adapter(adapter, model_info) is None


def test_adapter_name_key_form_passes_the_header_check(adapter_copy, model_info):
    adapter = adapter_copy()
    rewrite_weights(adapter, lambda t: t.update({k.replace(".weight", ".default.weight"): t.pop(k) for k in list(t)}))
    assert check_adapter(adapter, model_info) is None


def test_a_check_against_one_model_does_not_carry_over_to_a_model_with_fewer_layers(good_adapter, model_info):
    check_adapter(good_adapter, model_info)
    layer_0 = {name: shape for name, shape in model_info.module_shapes.items() if name.startswith("model.layers.0.")}
    message = refusal(good_adapter, dataclasses.replace(model_info, module_shapes=layer_0))
    assert message.startswith("Adapter weights include model.layers.1.")
    assert message.endswith(", which has no LoRA path in this model.")


def test_a_check_against_one_model_does_not_carry_over_to_a_model_with_other_shapes(good_adapter, model_info):
    check_adapter(good_adapter, model_info)
    wider = dict(model_info.module_shapes, **{"model.layers.0.self_attn.q_proj": (64, 128)})
    message = refusal(good_adapter, dataclasses.replace(model_info, module_shapes=wider))
    assert message == "Adapter weight lora_A for model.layers.0.self_attn.q_proj has shape [8, 64]; expected [8, 128]."


def test_layers_to_transform_narrows_the_targets_of_an_adapter_checked_before(adapter_copy, good_adapter, model_info):
    check_adapter(good_adapter, model_info)
    message = refusal(adapter_copy(layers_to_transform=[0]), model_info)
    assert message.startswith("Adapter weights include model.layers.1.")
    assert message.endswith(", which is not targeted by adapter_config.json.")
