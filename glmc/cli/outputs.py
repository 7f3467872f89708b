"""Output paths checked before any work: a command that would fail to write its results after minutes of merging or
training fails at once instead, in one line, having written nothing. No output lands on an input (a checkpoint, its
timm kwargs, a data file or folder), on another output of the same command, or, without ``--force``, on a file that
glmc did not write for that purpose: a report is marked as glmc's, a plot carries matplotlib's signature, and an
existing checkpoint always needs ``--force`` (:func:`glmc.io.formats.check_output`)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from glmc.errors import ConfigError
from glmc.io.files import kwargs_path, side_files

OUTPUT_FLAGS = ("out", "json", "plot", "hf", "timm", "glmc")  # every subcommand's file outputs, by argparse dest
FORMAT_FLAGS = ("hf", "timm", "glmc")  # export's outputs, each named for the format it writes
# Every subcommand's inputs, by argparse dest, and how an error names them.
INPUT_FLAGS = {"checkpoint": "input", "checkpoints": "input", "a": "input A", "b": "input B", "simplex": "--simplex",
               "width_of": "--width-of", "data": "--data", "data_file": "--data-file", "train_file": "--train-file"}
# What matplotlib's Agg canvas writes (FigureCanvasAgg.get_supported_filetypes()), without importing matplotlib.
PLOT_FORMATS = ("avif", "eps", "gif", "jpeg", "jpg", "pdf", "pgf", "png", "ps", "raw", "rgba", "svg", "svgz", "tif",
                "tiff", "webp")
REPORT_MARK = "written_by"  # the key that marks a JSON report as glmc's: a later run writes over it without --force
SIGNATURE_BYTES = 65536  # how much of each end of an image is searched for matplotlib's signature


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


def check_outputs(args: argparse.Namespace, fmt: str | None = None) -> None:
    """Every output a command was given (``--out``, ``--json``, ``--plot``; export's ``--hf``, ``--timm``,
    ``--glmc``), checked before it runs. ``fmt``: the checkpoint format of ``--out`` once it is known (a timm state
    dict also writes its kwargs JSON beside it); ``--format``'s until then."""
    outputs = _outputs(args, fmt or getattr(args, "format", None))
    for flag, path in outputs:
        if flag.removeprefix("--") in OUTPUT_FLAGS:  # the files written beside an output share its folder
            # An output without a suffix is a model folder (glmc.io.formats.check_output says what may be there)
            check_writable(path, flag, folder=flag in ("--out", "--hf", "--timm") and not path.suffix)
    if getattr(args, "plot", None) is not None:
        check_plot_format(Path(args.plot))
    _check_apart(outputs, _inputs(args))
    for flag, path in outputs:
        if flag in ("--json", "--plot"):
            _check_overwrite(flag, path, getattr(args, "force", False))


def _outputs(args: argparse.Namespace, fmt: str | None) -> list[tuple[str, Path]]:
    """(flag, path) of every file or folder the command will write, a timm state dict's kwargs JSON included."""
    found = []
    for dest in OUTPUT_FLAGS:
        if getattr(args, dest, None) is None:
            continue
        path, flag = Path(getattr(args, dest)), f"--{dest}"
        found.append((flag, path))
        if (dest if dest in FORMAT_FLAGS else fmt) == "timm" and path.suffix == ".safetensors":
            found.append((f"{flag}'s timm kwargs", kwargs_path(path)))
    return found


def _inputs(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(name, path) of every file or folder the command reads, a timm state dict's kwargs JSON included."""
    found = []
    for dest, name in INPUT_FLAGS.items():
        value = getattr(args, dest, None)
        for path in map(Path, value if isinstance(value, list) else [] if value is None else [value]):
            found += [(name, path), *((f"{name}'s timm kwargs", side) for side in side_files(path))]
    return found


def _check_apart(outputs: list[tuple[str, Path]], inputs: list[tuple[str, Path]]) -> None:
    """ConfigError if two outputs overlap (one file, or one inside the other's folder), if an output is an input or
    a folder holding one (a model folder is replaced whole), or if it names an existing file inside an input
    folder. A new file inside an input folder is allowed: it changes nothing that is read."""
    for i, (flag, path) in enumerate(outputs):
        for other, there in outputs[i + 1:]:
            if _within(path, there) or _within(there, path):
                raise ConfigError(f"{flag} {path} and {other} {there} overlap; give each output its own path")
        for name, source in inputs:
            if _within(source, path) or (path.exists() and _within(path, source)):
                raise ConfigError(f"{flag} {path} would write over {name} {source}; glmc never writes over its "
                                  "inputs, even with --force: name another path")


def _within(inner: Path, outer: Path) -> bool:
    """Whether ``inner`` is ``outer`` or lies inside it, symbolic and hard links followed."""
    a, b = inner.resolve(), outer.resolve()
    if a == b or b in a.parents:
        return True
    return a.exists() and b.exists() and os.path.samefile(a, b)


def _check_overwrite(flag: str, path: Path, force: bool) -> None:
    """ConfigError if ``path`` exists and is not a report (``--json``) or plot (``--plot``) that glmc wrote, unless
    ``force``."""
    if force or not path.is_file():
        return
    kind, ours = ("report", is_report(path)) if flag == "--json" else ("plot", _is_plot(path))
    if not ours:
        raise ConfigError(f"{flag} {path} already exists and is not a {kind} glmc wrote; pass --force to overwrite it")


def is_report(path: Path) -> bool:
    """Whether ``path`` is a JSON report that :func:`write_report` wrote."""
    try:
        report = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(report, dict) and str(report.get(REPORT_MARK, "")).startswith("glmc ")


def _is_plot(path: Path) -> bool:
    """Whether ``path`` is an image matplotlib wrote: its name in the file's metadata (PNG, SVG, PDF, PostScript)."""
    with open(path, "rb") as f:
        head = f.read(SIGNATURE_BYTES)
        f.seek(max(0, path.stat().st_size - SIGNATURE_BYTES))
        tail = f.read()
    return b"matplotlib" in (head + tail).lower()


def write_report(path: Path, report: Mapping[str, Any], command: str) -> None:
    """``report`` as JSON at ``path`` (its folder created), marked as ``glmc COMMAND``'s."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({REPORT_MARK: f"glmc {command}", **report}, indent=1))
