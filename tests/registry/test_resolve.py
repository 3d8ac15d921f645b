"""Resolving an adapter path: a local directory, or a Hub repo through huggingface_hub's cache."""
import shutil

import huggingface_hub.constants
import pytest

from adapters_registry import AdapterError, AdapterNotFoundError, resolve_adapter_path


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE=1 with an empty cache of our own (the constants are read at import, so patch them)."""
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_local_directory_resolves_to_itself(good_adapter):
    assert resolve_adapter_path(str(good_adapter)) == good_adapter.resolve()


def test_home_relative_directory_is_expanded(good_adapter, monkeypatch):
    monkeypatch.setenv("HOME", str(good_adapter.parent))
    assert resolve_adapter_path(f"~/{good_adapter.name}") == good_adapter.resolve()


@pytest.mark.parametrize("path", ["/no/such/adapter", "./no-such", "../no-such", "~/no-such", "a/b/c"])
def test_missing_local_path_is_not_found(path):
    with pytest.raises(AdapterNotFoundError, match="does not exist"):
        resolve_adapter_path(path)


def test_file_instead_of_directory_is_refused(good_adapter):
    with pytest.raises(AdapterError, match="is not a directory"):
        resolve_adapter_path(str(good_adapter / "adapter_config.json"))


def test_invalid_repo_id_is_not_found():
    with pytest.raises(AdapterNotFoundError, match="neither a local directory nor a valid Hugging Face Hub repo id"):
        resolve_adapter_path("bad repo id!")


def test_hub_repo_offline_and_not_cached_is_not_found_with_clear_message(offline_hub):
    with pytest.raises(AdapterNotFoundError) as exc:
        resolve_adapter_path("someone/some-adapter", revision="v1")
    assert "someone/some-adapter@v1" in str(exc.value)
    assert "is not in the local Hugging Face cache, and the Hub cannot be reached" in str(exc.value)


def test_hub_repo_in_offline_cache_resolves_to_the_snapshot(offline_hub, good_adapter):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = offline_hub / "models--someone--some-adapter"
    shutil.copytree(good_adapter, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert resolve_adapter_path("someone/some-adapter") == repo / "snapshots" / commit
