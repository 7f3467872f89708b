"""Options of the data-driven methods, declared once for ``glmc align``, ``barrier`` and ``merge``: which training
samples they see, and how learned matching trains on them."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from glmc.checkpoint import CheckpointMeta
    from glmc.match.learned import LearnConfig

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


def add_learn_arguments(parser: argparse.ArgumentParser, batch_help: str, epochs: int | None = None) -> None:
    """--data, --batch (``batch_help``), --epochs (default ``epochs``, else LearnConfig's 2), --steps, --lr,
    --batch-size, --lam, --val-points, --patience, --within and --quiet."""
    parser.add_argument("--data", help=DATA_HELP)
    parser.add_argument("--batch", type=count, help=batch_help)
    parser.add_argument("--epochs", type=int, default=epochs,
                        help=f"learned methods: passes over the training samples (default {epochs or 2})")
    parser.add_argument("--steps", type=int, help="learned methods: this many steps instead of --epochs")
    parser.add_argument("--lr", type=positive, help="learned methods: AdamW learning rate on the latents (> 0)")
    parser.add_argument("--batch-size", type=int, help="learned methods: samples per step (default 128)")
    parser.add_argument("--lam", type=float, nargs=2, metavar=("LO", "HI"),
                        help="learned methods on a pair: train at λ ~ U(LO, HI), the weight of A (default 0.4 0.6, "
                             "the paper's; a wide-to-narrow pair peaks nearer the narrow end, so widen it there)")
    parser.add_argument("--val-points", type=count,
                        help="learned methods on a pair: validate at this many λ evenly spaced over --lam for early "
                             "stopping (default 1, the midpoint)")
    parser.add_argument("--patience", type=int, metavar="N",
                        help="learned methods: stop after N validations without improvement (default 5; 0 never "
                             "stops early)")
    parser.add_argument("--within", choices=["fixed", "orthogonal", "invertible"],  # glmc.match.learned.WITHIN
                        help="learned methods: the within-head maps, kept from weight matching, learned as "
                             "orthogonal maps (default) or learned as any invertible maps")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or info logs")


def learn_options(args: argparse.Namespace) -> LearnConfig:
    """Learned-matching options from the flags above (and --concentration where a command has it); flags left out
    keep LearnConfig's defaults."""
    from glmc.match.learned import LearnConfig

    flags = {"lr": args.lr, "epochs": args.epochs, "batch_size": args.batch_size,
             "concentration": getattr(args, "concentration", None), "lam": tuple(args.lam) if args.lam else None,
             "val_points": args.val_points, "within": args.within, "patience": args.patience}
    given = {k: v for k, v in flags.items() if v is not None}
    return LearnConfig(steps=args.steps, progress=not args.quiet, **given)


def train_subset(meta: CheckpointMeta, data: str | None, n: int | None) -> Dataset:
    """``n`` samples (all for None) of the checkpoint's training split, drawn with a fixed seed (never the held-out
    split)."""
    import torch
    from torch.utils.data import Subset

    from glmc.tasks import load_task

    train = load_task(meta.dataset, meta.config, data).train
    if n is None:
        return train
    idx = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))[:n]  # type: ignore[arg-type]
    return Subset(train, idx.tolist())
