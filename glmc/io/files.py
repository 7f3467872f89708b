"""The files a checkpoint path stands for beyond itself, torch-free: the command line checks them before it loads
anything (:mod:`glmc.cli.outputs`), and :mod:`glmc.io.formats` reads and writes them."""

from __future__ import annotations

from pathlib import Path


def kwargs_path(path: Path) -> Path:
    """The JSON of timm.create_model kwargs beside a timm state dict: same stem, .json."""
    return path.with_suffix(".json")


def side_files(path: Path) -> list[Path]:
    """The files a checkpoint input is read from besides ``path`` itself: a .safetensors state dict's kwargs JSON,
    where there is one (a folder's files lie inside it)."""
    beside = kwargs_path(path)
    return [beside] if path.suffix == ".safetensors" and beside.is_file() else []
