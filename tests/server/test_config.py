"""`loraserve serve` settings: flags > environment > config file > defaults, and paths relative to the file."""
from __future__ import annotations

from pathlib import Path

import pytest

from adapters_registry import AdapterSpec
from openai_server.cli import main
from openai_server.config import OPTIONS, ConfigError, ServeConfig, serve_config_from_args


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "adapters" / "pirate").mkdir(parents=True)
    (tmp_path / "config.yaml").write_text(
        "port: 9000\nmax_loras: 3\nhost: 0.0.0.0\n"
        "lora_modules:\n  - pirate=adapters/pirate\n"
        "lora_allowed_dirs: [adapters]\n"
    )
    return tmp_path


def test_defaults_without_any_layer(tmp_path):
    config = serve_config_from_args([], environ={}, cwd=tmp_path)
    assert config == ServeConfig()


def test_config_file_in_cwd_is_read_when_no_model_is_named(workdir):
    config = serve_config_from_args([], environ={}, cwd=workdir)
    assert (config.port, config.max_loras, config.host) == (9000, 3, "0.0.0.0")
    assert config.config_file == str(workdir / "config.yaml")


def test_config_file_paths_are_relative_to_the_file(workdir, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    config = serve_config_from_args(["--config", str(workdir / "config.yaml")], environ={}, cwd=elsewhere)
    assert config.lora_modules == [AdapterSpec("pirate", str(workdir / "adapters" / "pirate"))]
    assert config.lora_allowed_dirs == [str(workdir / "adapters")]


def test_environment_overrides_file_and_flags_override_environment(workdir):
    environ = {"LORASERVE_PORT": "9100", "LORASERVE_MAX_LORAS": "4"}
    config = serve_config_from_args(["--port", "9200"], environ=environ, cwd=workdir)
    assert config.port == 9200  # flag
    assert config.max_loras == 4  # environment
    assert config.host == "0.0.0.0"  # file


def test_naming_a_model_skips_the_cwd_config_file(workdir):
    config = serve_config_from_args(["some/model"], environ={}, cwd=workdir)
    assert config.model == "some/model" and config.port == 8000 and config.lora_modules == []


def test_explicit_config_is_combined_with_a_named_model(workdir):
    config = serve_config_from_args(["some/model", "--config", "config.yaml"], environ={}, cwd=workdir)
    assert config.model == "some/model" and config.port == 9000


def test_tgi_lora_adapters_from_environment(tmp_path):
    config = serve_config_from_args([], environ={"LORA_ADAPTERS": "a=/x/a,org/b@v2"}, cwd=tmp_path)
    assert config.adapter_specs() == [AdapterSpec("a", "/x/a"), AdapterSpec("org/b", "org/b", revision="v2")]


def test_lora_adapters_flag_overrides_environment(tmp_path):
    config = serve_config_from_args(["--lora-adapters", "c=/x/c"], environ={"LORA_ADAPTERS": "a=/x/a"}, cwd=tmp_path)
    assert config.lora_adapters == [AdapterSpec("c", "/x/c")]


def test_vllm_lora_modules_flag_takes_pairs_and_json(tmp_path):
    config = serve_config_from_args(
        ["--lora-modules", "a=/x/a", '{"name": "b", "path": "/x/b", "base_model_name": "m"}'], environ={}, cwd=tmp_path
    )
    assert config.lora_modules == [AdapterSpec("a", "/x/a"), AdapterSpec("b", "/x/b", base_model_name="m")]


def test_one_json_adapter_in_the_environment_is_not_split_at_its_commas(tmp_path):
    environ = {"LORASERVE_LORA_MODULES": '{"name": "b", "path": "/x/b", "base_model_name": "m"}'}
    config = serve_config_from_args([], environ=environ, cwd=tmp_path)
    assert config.lora_modules == [AdapterSpec("b", "/x/b", base_model_name="m")]


def test_a_malformed_json_adapter_in_the_environment_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="LORASERVE_LORA_MODULES: not a valid JSON object"):
        serve_config_from_args([], environ={"LORASERVE_LORA_MODULES": '{"name": "b", "path"}'}, cwd=tmp_path)


@pytest.mark.parametrize("name", ["LORASERVE_API_KEY", "VLLM_API_KEY"])
def test_api_key_from_environment(tmp_path, name):
    assert serve_config_from_args([], environ={name: "k"}, cwd=tmp_path).api_key == "k"


def test_vllm_runtime_updating_variable_turns_it_on(tmp_path):
    config = serve_config_from_args([], environ={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}, cwd=tmp_path)
    assert config.allow_runtime_lora_updating is True


def test_boolean_flag_has_a_negative_form(workdir):
    (workdir / "config.yaml").write_text("enable_lora: true\n")
    assert serve_config_from_args(["--no-enable-lora"], environ={}, cwd=workdir).enable_lora is False


def test_a_choice_may_be_written_in_capitals(tmp_path):
    assert serve_config_from_args([], environ={"LORASERVE_LOG_LEVEL": "INFO"}, cwd=tmp_path).log_level == "info"
    assert serve_config_from_args(["--log-level", "DEBUG"], environ={}, cwd=tmp_path).log_level == "debug"


def test_tgi_adapters_may_be_a_yaml_list(workdir, tmp_path):
    (workdir / "config.yaml").write_text(f"lora_adapters:\n  - a={tmp_path}\n  - b={tmp_path}\n")
    config = serve_config_from_args([], environ={}, cwd=workdir)
    assert [spec.name for spec in config.lora_adapters] == ["a", "b"]


@pytest.mark.parametrize(
    "argv, environ, content, message",
    [
        ([], {}, "bogus: 1\n", "unknown setting 'bogus'"),
        ([], {}, "port: eighty\n", "expected int"),
        ([], {"LORASERVE_ENABLE_LORA": "maybe"}, "", "expected true or false"),
        ([], {"LORA_ADAPTERS": "a=b=c"}, "", "Invalid LoRA adapter format"),
        (["--config", "missing.yaml"], {}, "", "does not exist"),
        ([], {}, "port: 8000.7\n", "expected int, got 8000.7"),
        ([], {}, "port: true\n", "expected int, got True"),
        ([], {}, "host: [a, b]\n", "setting 'host': expected str, got"),
        (["--port", "-5"], {}, "", "port must be from 0 to 65535, got -5"),
        ([], {"LORASERVE_PORT": "70000"}, "", "port must be from 0 to 65535, got 70000"),
        (["--max-logprobs", "-1"], {}, "", "max_logprobs must be at least 0, got -1"),
    ],
    ids=["unknown_key", "bad_type", "bad_bool", "bad_adapter_spec", "missing_file", "float_for_int", "bool_for_int",
         "list_for_text", "negative_port", "port_too_high", "negative_max_logprobs"],
)
def test_bad_settings_name_the_problem(tmp_path, argv, environ, content, message):
    (tmp_path / "config.yaml").write_text(content)
    with pytest.raises(ConfigError, match=message):
        serve_config_from_args(argv, environ=environ, cwd=tmp_path)


def _help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit):
        main(argv)
    return capsys.readouterr().out


def test_both_help_texts_document_every_flag(capsys):
    top, serve = _help(capsys, ["--help"]), _help(capsys, ["serve", "--help"])
    for option in OPTIONS:
        assert option.flag in top and option.flag in serve
    assert "--config" in serve and "MODEL" in serve


def test_repo_config_serves_the_demo_adapters():
    repo = Path(__file__).resolve().parents[2]
    config = serve_config_from_args([], environ={}, cwd=repo)
    assert config.model is None and config.enable_lora
    assert [spec.name for spec in config.adapter_specs()] == ["pirate", "sql"]
    assert all(Path(spec.path).is_dir() for spec in config.adapter_specs())
    assert config.lora_allowed_dirs == [str(repo / "examples" / "demo_adapters")]


def test_enforce_eager_reaches_the_engine_config(tmp_path):
    from openai_server.launch import engine_config

    assert engine_config(serve_config_from_args(["m", "--enforce-eager"], environ={}, cwd=tmp_path)).enforce_eager
    assert not engine_config(serve_config_from_args(["m"], environ={}, cwd=tmp_path)).enforce_eager


def test_load_format_reaches_the_engine_config(tmp_path):
    from openai_server.launch import engine_config

    assert engine_config(serve_config_from_args(["m", "--load-format", "dummy"], environ={},
                                                cwd=tmp_path)).load_format == "dummy"
    assert engine_config(serve_config_from_args(["m"], environ={}, cwd=tmp_path)).load_format == "auto"


def test_no_async_scheduling_reaches_the_engine_config(tmp_path):
    from openai_server.launch import engine_config

    assert not engine_config(serve_config_from_args(["m", "--no-async-scheduling"], environ={},
                                                    cwd=tmp_path)).async_scheduling
    assert engine_config(serve_config_from_args(["m"], environ={}, cwd=tmp_path)).async_scheduling


def test_adapter_reader_reaches_the_engine_config(tmp_path):
    from openai_server.launch import engine_config

    assert engine_config(serve_config_from_args(["m", "--adapter-reader", "threads"], environ={},
                                                cwd=tmp_path)).adapter_reader == "threads"
    assert engine_config(serve_config_from_args(["m"], environ={}, cwd=tmp_path)).adapter_reader == "auto"


def test_admission_order_reaches_the_engine_config(tmp_path):
    from openai_server.launch import engine_config

    assert engine_config(serve_config_from_args(["m", "--admission-order", "balanced"], environ={},
                                                cwd=tmp_path)).admission_order == "balanced"
    assert engine_config(serve_config_from_args(["m"], environ={}, cwd=tmp_path)).admission_order == "fcfs"


def test_cudagraph_mode_reaches_the_engine_config(tmp_path):
    from openai_server.launch import engine_config

    assert engine_config(serve_config_from_args(["m", "--cudagraph-mode", "full_decode_only"], environ={},
                                                cwd=tmp_path)).cudagraph_mode == "full_decode_only"
    assert engine_config(serve_config_from_args(["m"], environ={}, cwd=tmp_path)).cudagraph_mode == "full_and_piecewise"


def test_an_adapter_named_by_both_dialects_for_the_same_place_counts_once(workdir):
    same_place = f"pirate={workdir / 'adapters' / 'pirate'}"
    config = serve_config_from_args([], environ={"LORA_ADAPTERS": same_place}, cwd=workdir)
    assert [spec.name for spec in config.adapter_specs()] == ["pirate"]


def test_an_adapter_named_twice_for_different_places_is_refused(workdir):
    config = serve_config_from_args([], environ={"LORA_ADAPTERS": "pirate=/elsewhere/pirate"}, cwd=workdir)
    with pytest.raises(ConfigError, match="'pirate' is given twice"):
        config.adapter_specs()


def test_serve_freezes_the_start_up_heap_before_serving(model_dir, tmp_path, monkeypatch):
    """A collection of the oldest generation while serving then skips everything start-up made."""
    import gc

    from openai_server import launch

    frozen_when_serving = []
    monkeypatch.setattr(launch.uvicorn, "run", lambda app, **kwargs: frozen_when_serving.append(gc.get_freeze_count()))
    gc.unfreeze()
    try:
        launch.serve(serve_config_from_args([str(model_dir), "--dtype", "float32", "--device", "cpu"], environ={},
                                            cwd=tmp_path))
    finally:
        gc.unfreeze()  # the test process goes on collecting as usual
    assert len(frozen_when_serving) == 1 and frozen_when_serving[0] > 10_000


@pytest.mark.parametrize("argv, environ, expected", [
    (["--engine-core", "process"], {}, "EngineCoreClient"),
    ([], {"LORASERVE_ENGINE_CORE": "process"}, "EngineCoreClient"),
    (["--engine-core", "thread"], {}, "AsyncEngine"),
    ([], {}, "AsyncEngine"),  # auto, on the CPU
], ids=["flag", "environment", "thread", "auto_on_the_cpu"])
def test_engine_core_says_where_the_server_runs_its_engine(model_dir, tmp_path, argv, environ, expected):
    from openai_server.launch import build_server

    server = build_server(serve_config_from_args([str(model_dir), "--dtype", "float32", "--device", "cpu", *argv],
                                                 environ=environ, cwd=tmp_path))
    try:
        assert type(server.engine).__name__ == expected
        assert server.engine.alive and server.engine.stats().kv_blocks_total > 0
    finally:
        server.engine.shutdown()
