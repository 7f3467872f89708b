"""What the data-driven methods read, declared once for ``glmc align``, ``barrier`` and ``merge``: which training
samples they see, and the held-out samples every barrier is measured on (the matchers' own options are
:mod:`glmc.cli.options`)."""

from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

from glmc.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from torch import Tensor
    from torch.utils.data import Dataset

    from glmc.core.config import ModelConfig
    from glmc.io.checkpoint import CheckpointMeta

log = logging.getLogger(__name__)

DATA_HELP = "dataset directory (default: the dataset's own copy, under $GLMC_DATA, .data/ or the system path)"


def count(text: str) -> int:
    """An argparse type for a count (samples, iterations, workers): an integer of at least 1 (0 would silently mean
    the default, or nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive(text: str) -> float:
    """An argparse type for a rate or scale that must be a finite number above 0 (a learning rate of 0 learns
    nothing, and a negative one climbs the loss)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def add_data_arguments(parser: argparse.ArgumentParser, batch_help: str) -> None:
    """--data, --data-file, --train-file, --generated and --batch (``batch_help``): what the data-driven methods
    read."""
    parser.add_argument("--data", help=DATA_HELP)
    add_data_file_arguments(parser)
    parser.add_argument("--generated", action="store_true",
                        help="data-driven methods: train on text the models sample themselves (GPT-2; --batch "
                             "windows, default 20000) instead of training data, so that alignment reads no dataset")
    parser.add_argument("--batch", type=count, help=batch_help)


def add_data_file_arguments(parser: argparse.ArgumentParser) -> None:
    """--data-file and --train-file: the user's own data, for models glmc did not train (glmc.io.userdata)."""
    parser.add_argument("--data-file", type=Path, metavar="FILE",
                        help="held-out data to measure on instead of the checkpoint's dataset: a .npy of token ids "
                             "(GPT-2) or a .npz of images and labels (ViT); default: the checkpoint's test split")
    parser.add_argument("--train-file", type=Path, metavar="FILE",
                        help="data for the data-driven methods (activation, learned, REPAIR, refit), same formats; "
                             "default: the checkpoint's training split, else --data-file")


def train_subset(meta: CheckpointMeta, data: str | None, n: int | None) -> Dataset:
    """``n`` samples (all for None) of the checkpoint's training split, drawn with a fixed seed (never the held-out
    split)."""
    import torch
    from torch.utils.data import Subset

    from glmc.data.tasks import load_task

    train = load_task(meta.dataset, meta.config, data).train
    if n is None:
        return train
    idx = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))[:n]  # type: ignore[arg-type]
    return Subset(train, idx.tolist())


def _needs_file(meta: CheckpointMeta, flag: str) -> None:
    if not meta.dataset:
        raise ConfigError(f"this model was not trained by glmc on a known dataset: pass {flag} (a .npy of token ids "
                          "or a .npz of images and labels)")


def training_data(meta: CheckpointMeta, args: argparse.Namespace, n: int | None,
                  writers: tuple[Sequence[Mapping[str, Tensor]], Sequence[ModelConfig]]) -> Dataset:
    """``n`` training samples (all for None): text the ``writers`` (native states, configs) sample themselves
    (--generated), else from --train-file, the checkpoint's training split, or --data-file."""
    from torch.utils.data import Subset

    from glmc.io.userdata import load_data_file

    given = getattr(args, "train_file", None)
    if getattr(args, "generated", False):
        if given is not None:
            raise ConfigError("--generated and --train-file both name the training data: pass one of them")
        from glmc.data.generated import generated_text

        return generated_text(*writers, n, device=getattr(args, "device", None))
    if given is None and not meta.dataset and getattr(args, "data_file", None) is not None:
        log.warning("no --train-file: the data-driven method fits on --data-file, the data it is measured on")
        given = args.data_file
    if given is None:
        _needs_file(meta, "--train-file, --generated or --data-file")
        return train_subset(meta, args.data, n)
    data = load_data_file(given, meta.config)
    return data if n is None else Subset(data, range(min(n, len(data))))  # type: ignore[arg-type]


def test_data(meta: CheckpointMeta, cfg: ModelConfig, args: argparse.Namespace) -> Dataset:
    """The held-out samples every barrier and merge is measured on: --data-file, else the dataset's test split."""
    from glmc.data.tasks import held_out
    from glmc.io.userdata import load_data_file

    if getattr(args, "data_file", None) is not None:
        if args.limit is not None and args.limit < 1:
            raise ConfigError(f"limit must be at least 1 held-out sample, got {args.limit}")
        return load_data_file(args.data_file, cfg, args.limit)
    _needs_file(meta, "--data-file")
    return held_out(meta.dataset, cfg, args.data, args.limit)
