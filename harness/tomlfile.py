"""Reading the experiment grids', benches' and analyses' TOML configs, so a missing file or bad TOML is one line, not a
traceback."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any

from glmc.errors import ConfigError


def read_toml(path: Path) -> dict[str, Any]:
    """The TOML table at ``path``; a file that cannot be read or is not TOML is a one-line ConfigError."""
    try:
        return tomllib.loads(path.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror}") from err
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} is not valid TOML: {err}") from err


def config_or_exit(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """A bench's config; on a ConfigError it exits 2 with one line, as argparse does for a bad flag."""
    try:
        return read_toml(Path(path))
    except ConfigError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
