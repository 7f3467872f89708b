"""Where datasets are cached on disk: one root, overridable with ``$GLMC_DATA``."""

import os
from pathlib import Path

import glmc


def data_root() -> Path:
    """``$GLMC_DATA`` if set, else the git-ignored ``<repo root>/.data`` next to the package."""
    env = os.environ.get("GLMC_DATA")
    if env:
        return Path(env).expanduser()
    return Path(glmc.__file__).resolve().parent.parent / ".data"
