"""Adapter spec parsing in TGI's LORA_ADAPTERS and vLLM's --lora-modules dialects."""
import pytest

from adapters_registry import AdapterSpec, parse_lora_adapters, parse_lora_modules


def test_tgi_bare_id_is_its_own_name_and_path():
    assert parse_lora_adapters("org/pirate") == [AdapterSpec("org/pirate", "org/pirate")]


def test_tgi_id_with_revision():
    assert parse_lora_adapters("org/pirate@v2") == [AdapterSpec("org/pirate", "org/pirate", "v2")]


def test_tgi_name_and_local_path():
    assert parse_lora_adapters("pirate=/data/pirate") == [AdapterSpec("pirate", "/data/pirate")]


def test_tgi_name_path_and_revision():
    assert parse_lora_adapters("pirate=org/pirate@main") == [AdapterSpec("pirate", "org/pirate", "main")]


def test_tgi_comma_separated_entries_with_spaces():
    specs = parse_lora_adapters("a=/x, org/b@r1 ,c")
    assert specs == [AdapterSpec("a", "/x"), AdapterSpec("org/b", "org/b", "r1"), AdapterSpec("c", "c")]


def test_tgi_empty_text_is_no_adapters():
    assert parse_lora_adapters("  ") == []


@pytest.mark.parametrize("entry", ["a=b=c", "a@b@c", "a=/x@r@s", "=path", "name=", "id@", ""])
def test_tgi_malformed_entry_is_refused_naming_it(entry):
    with pytest.raises(ValueError) as exc:
        parse_lora_adapters(f"ok,{entry}")
    assert str(exc.value) == f"Invalid LoRA adapter format: {entry}"


def test_vllm_name_equals_path():
    assert parse_lora_modules(["sql=/data/sql"]) == [AdapterSpec("sql", "/data/sql")]


def test_vllm_json_form_with_base_model_name():
    item = '{"name": "sql", "path": "/data/sql", "base_model_name": "smollm2"}'
    assert parse_lora_modules([item]) == [AdapterSpec("sql", "/data/sql", base_model_name="smollm2")]


def test_vllm_json_form_without_base_model_name():
    assert parse_lora_modules(['{"name": "sql", "path": "org/sql"}']) == [AdapterSpec("sql", "org/sql")]


@pytest.mark.parametrize(
    "item",
    [
        "no-equals",
        "a=b=c",
        "=path",
        "name=",
        '{"name": "x"}',
        '{"name": "x", "path": ""}',
        '{"name": "x", "path": "p", "rank": 8}',
        '{"name": "x", "path": "p", "base_model_name": 3}',
        '{"name": "x", "path": ',
    ],
)
def test_vllm_malformed_item_is_refused_naming_it(item):
    with pytest.raises(ValueError) as exc:
        parse_lora_modules(["good=/p", item])
    assert repr(item) in str(exc.value)
