"""Where runtime-loaded adapters may come from: under an allowed directory after resolving `..` and symlinks."""
from __future__ import annotations

from pathlib import Path


def check_allowed(path: str, allowed_dirs: list[Path]) -> Path:
    """Return the resolved adapter directory, or raise PermissionError naming the allowed directories.

    The directory and every file directly in it must resolve inside one allowed directory, so neither
    `..`, a symlinked directory nor a symlinked weights file can reach outside.
    """
    resolved = Path(path).expanduser().resolve()
    roots = [Path(d).expanduser().resolve() for d in allowed_dirs]
    allowed = ", ".join(str(r) for r in roots)
    root = next((r for r in roots if resolved.is_relative_to(r)), None)
    if root is None:
        raise PermissionError(f"Adapter path {path} is outside the allowed directories ({allowed}).")
    if resolved.is_dir():
        for child in resolved.iterdir():
            if not child.resolve().is_relative_to(root):
                raise PermissionError(
                    f"Adapter file {child} links outside the allowed directories ({allowed})."
                )
    return resolved
