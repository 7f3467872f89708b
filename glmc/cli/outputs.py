"""Output paths checked before any work: a command that would fail to write its results after minutes of merging or
training fails at once instead, in one line, having written nothing."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from glmc.errors import ConfigError

OUTPUT_FLAGS = ("out", "json", "plot")  # every subcommand's file outputs, by argparse dest
# What matplotlib's Agg canvas writes (FigureCanvasAgg.get_supported_filetypes()), without importing matplotlib.
PLOT_FORMATS = ("avif", "eps", "gif", "jpeg", "jpg", "pdf", "pgf", "png", "ps", "raw", "rgba", "svg", "svgz", "tif",
                "tiff", "webp")


def check_writable(path: Path, flag: str, folder: bool = False) -> None:
    """ConfigError unless ``path`` can be written: not a directory (unless the output is a ``folder``, a Hugging Face
    model), and either writable or new in a folder that exists or can be created. Probed by writing, not by
    permission bits: root passes every ``os.access`` check, and a folder under ``/proc`` still cannot be made. Nothing
    is left behind; missing folders are created at the end."""
    if path.is_dir() and not folder:
        raise ConfigError(f"{flag} {path} is a directory, not a file")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise ConfigError(f"{flag} {path} is not writable")
        return
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{flag} {path} cannot be created: {ancestor} is a file, not a directory")
    try:  # the missing folders (or, when there are none, the file) would be created in ``ancestor``
        if ancestor == path.absolute().parent:
            tempfile.TemporaryFile(dir=ancestor).close()
        else:
            os.rmdir(tempfile.mkdtemp(dir=ancestor))
    except OSError as err:
        raise ConfigError(f"{flag} {path} cannot be created in {ancestor}: {err.strerror or err}") from None


def check_plot_format(path: Path) -> None:
    """ConfigError unless ``path`` ends in an image format matplotlib writes."""
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in PLOT_FORMATS:
        raise ConfigError(f"--plot {path}: unknown image format {suffix or '(none)'!r}; use one of "
                          f"{', '.join(PLOT_FORMATS)}")


def check_outputs(args: argparse.Namespace) -> None:
    """Every output flag a command was given (``--out``, ``--json``, ``--plot``), checked before it runs."""
    for dest in OUTPUT_FLAGS:
        path = getattr(args, dest, None)
        if path is None:
            continue
        flag = f"--{dest}"
        # An --out without a suffix is a Hugging Face folder (glmc.io.formats.check_output says what may be there)
        check_writable(Path(path), flag, folder=dest == "out" and not Path(path).suffix)
        if dest == "plot":
            check_plot_format(Path(path))
