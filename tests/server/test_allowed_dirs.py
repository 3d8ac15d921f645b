"""Runtime-loaded adapter paths must resolve inside an allowed directory."""
from __future__ import annotations

import pytest

from openai_server.allowed_dirs import check_allowed


@pytest.fixture
def tree(tmp_path):
    allowed = tmp_path / "allowed"
    (allowed / "good").mkdir(parents=True)
    (allowed / "good" / "adapter_config.json").write_text("{}")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "adapter_model.safetensors").write_text("secret")
    return allowed, outside


def test_directory_inside_is_allowed(tree):
    allowed, _ = tree
    assert check_allowed(str(allowed / "good"), [allowed]) == (allowed / "good").resolve()


def test_dotdot_escape_is_refused(tree):
    allowed, _ = tree
    with pytest.raises(PermissionError, match="outside the allowed directories"):
        check_allowed(str(allowed / "good" / ".." / ".." / "outside"), [allowed])


def test_symlinked_directory_pointing_outside_is_refused(tree):
    allowed, outside = tree
    (allowed / "link").symlink_to(outside, target_is_directory=True)
    with pytest.raises(PermissionError):
        check_allowed(str(allowed / "link"), [allowed])


def test_symlinked_weights_file_pointing_outside_is_refused(tree):
    allowed, outside = tree
    (allowed / "good" / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    with pytest.raises(PermissionError, match="links outside"):
        check_allowed(str(allowed / "good"), [allowed])


def test_sibling_with_common_prefix_is_not_inside(tmp_path):
    (tmp_path / "allowed").mkdir()
    (tmp_path / "allowed-not").mkdir()
    with pytest.raises(PermissionError):
        check_allowed(str(tmp_path / "allowed-not"), [tmp_path / "allowed"])
