"""Writing deployment files: atomically, private keys readable by their owner only, under plain names."""

from __future__ import annotations

import os
from pathlib import Path

from glmc.errors import ConfigError


def write_file(path: Path, data: bytes, *, secret: bool = False) -> None:
    """Write ``data`` to ``path`` through a temporary file; ``secret`` files are created with mode 0600."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp.replace(path)


def require_plain_name(what: str, name: str) -> None:
    """ConfigError unless ``name`` is letters, digits, - and _: it becomes a file or folder name, never a path."""
    if not name.replace("-", "").replace("_", "").isalnum():
        raise ConfigError(f"{what} must be letters, digits, - and _, got {name!r}")
