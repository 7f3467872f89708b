"""Where datasets are cached on disk: one root, overridable with ``$GLMC_DATA``."""

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

import glmc
from glmc.errors import DataNotFoundError

DISTRIBUTION = "glmc-fl"  # the project's name in pyproject.toml, as pip records its install


def data_root() -> Path:
    """``$GLMC_DATA`` if set; else the git-ignored ``.data`` of the checkout this package is imported from, or, where
    that has none, of the checkout the project is installed from in editable mode (``make setup``'s install). Flower
    runs the apps from a copy of their code under ``$FLWR_HOME/apps/``, beside no data: the second finds it there
    with nothing exported. Where neither exists, the first: where ``python -m glmc.data.fetch`` puts a new copy."""
    env = os.environ.get("GLMC_DATA")
    if env:
        return Path(env).expanduser()
    own = Path(glmc.__file__).resolve().parent.parent / ".data"
    installed = editable_source()
    if not own.is_dir() and installed is not None and (installed / ".data").is_dir():
        return installed / ".data"
    return own


def editable_source() -> Path | None:
    """The folder the project is installed from in editable mode (pip's ``direct_url.json``), or None. Every copy of
    the distribution's metadata is read: run from the checkout itself, the build's own ``glmc_fl.egg-info`` there
    comes first and records no origin."""
    records = (d.read_text("direct_url.json") for d in metadata.distributions(name=DISTRIBUTION))
    try:
        origin = json.loads(next((r for r in records if r), "{}"))
    except ValueError:
        return None
    url = urlparse(str(origin.get("url", "")))
    editable = bool(origin.get("dir_info", {}).get("editable"))
    return Path(unquote(url.path)) if editable and url.scheme == "file" else None


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
