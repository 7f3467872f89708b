"""Where datasets are cached on disk: one root, overridable with ``$GLMC_DATA``."""

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import glmc
from glmc.errors import DataNotFoundError


def data_root() -> Path:
    """``$GLMC_DATA`` if set, else the git-ignored ``<repo root>/.data`` next to the package."""
    env = os.environ.get("GLMC_DATA")
    if env:
        return Path(env).expanduser()
    return Path(glmc.__file__).resolve().parent.parent / ".data"


@contextmanager
def staged_dir(dest: Path) -> Iterator[Path]:
    """A fresh ``<dest>.partial`` to fill, renamed to ``dest`` only when the block succeeds.

    So an interrupted fetch never looks complete. An existing ``dest`` must be empty.
    """
    if dest.exists() and any(dest.iterdir()):
        raise DataNotFoundError(f"{dest} holds an incomplete copy; remove it and fetch again")
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)  # a killed earlier fetch's leftovers
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if dest.exists():
        dest.rmdir()  # empty, checked above
    staging.rename(dest)
