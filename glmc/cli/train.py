"""``glmc train``: a preset trained on a dataset, evaluated on its test split and saved as a checkpoint."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmc.cli.data_options import DATA_HELP, positive
from glmc.errors import ConfigError

if TYPE_CHECKING:
    from glmc.train import TrainConfig

PRECISIONS = ["fp32", "bf16"]  # glmc.device.PRECISIONS, without importing torch


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``glmc train``."""
    parser.add_argument("--model", required=True, help="preset name, e.g. vit-bench or gpt2-bench")
    parser.add_argument("--dataset", required=True,
                        help="fashion-mnist, shakespeare, shakespeare-bpe (byte-level BPE, the official GLMC "
                             "benchmark), or a fetched cifar10, cifar100 or tiny-imagenet")
    parser.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the order of the data")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the training split")
    parser.add_argument("--width-mult", type=float, default=1.0,
                        help="scale width, MLP and heads, head size fixed (0.25, 0.5, 1, 2): whole KV groups; "
                             "a post-LayerNorm model by whole factors, and only with ReLU")
    parser.add_argument("--dropout", type=float, help="dropout while training, in [0, 1) (embeddings, attention, "
                        "residual writes); default: the preset's (0.1 for gpt2-paper, else 0)")
    parser.add_argument("--batch-size", type=int, help="default: the dataset's")
    parser.add_argument("--lr", type=positive, help="peak learning rate (> 0); default: the dataset's")
    parser.add_argument("--weight-decay", type=float, help="AdamW's, on matrices; default: the dataset's, else 0.05")
    parser.add_argument("--patience", type=int, help="stop after this many validations without a lower validation "
                        "loss and keep the best weights (0: never); default: the dataset's, 0 unless it has a "
                        "validation split")
    parser.add_argument("--eval-every", type=int, help="steps between validations (default: the dataset's, else 100)")
    parser.add_argument("--warmup", type=float, default=0.05, help="fraction of steps spent warming up")
    parser.add_argument("--train-fraction", type=float, default=1.0,
                        help="train on the first fraction of the training split, in (0, 1] (a data-size control)")
    parser.add_argument("--max-steps", type=int, help="stop after this many optimizer steps (default: --epochs "
                                                      "decides)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default 0: every core)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="fp32, or bf16 autocast of the forward passes (on a GPU; training and evaluation)")
    parser.add_argument("--data", help=DATA_HELP)
    parser.add_argument("--out", required=True, type=Path, help="checkpoint path, *.safetensors")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or info logs")


def run_train(args: argparse.Namespace) -> int:
    """Train a preset on a dataset, evaluate on its test split, print the metrics, save a checkpoint."""
    # Imported here so that `glmc --help` and usage errors answer without loading torch.
    from glmc.archs import build_model, get_arch
    from glmc.core.config import preset, scale_width
    from glmc.data.tasks import load_task, train_on_fraction
    from glmc.io.checkpoint import CheckpointMeta, check_out, save_checkpoint
    from glmc.merging.widths import require_width_tier
    from glmc.train import evaluate, seed_everything, train

    check_out(args.out, args.force)
    if args.width_mult != 1:  # a narrower (or wider) model is trained to be merged with others of its family
        require_width_tier(preset(args.model), args.width_mult, f"--width-mult {args.width_mult:g}",
                           "train it at --width-mult 1 or one whose model nests in it (0.5, 2, ...)")
    shape = scale_width(preset(args.model), args.width_mult)
    if args.dropout is not None:
        shape = shape.replace(dropout=args.dropout)
    task = train_on_fraction(load_task(args.dataset, shape, args.data, args.seed), args.train_fraction)
    cfg = _train_config(args, task.defaults)
    arch = get_arch(task.config.family)
    seed_everything(args.seed)  # the initial weights come from the seed too
    model = build_model(task.config)
    if cfg.patience and task.val is None:
        raise ConfigError(f"--patience needs a validation split, and {task.dataset} has none")
    fit = train(model, arch, task.train, cfg, progress=not args.quiet, validation=task.val)
    test = evaluate(model, arch, task.test, batch_size=2 * cfg.batch_size, precision=cfg.precision)
    metrics = {"test_loss": test["loss"], "test_accuracy": test["accuracy"], "train_loss": fit["train_loss"]}
    meta = CheckpointMeta(
        preset=args.model,
        config=task.config,
        width_mult=args.width_mult,
        seed=args.seed,
        dataset=task.dataset,
        split=task.split,
        metrics=metrics | {k: fit[k] for k in ("steps", "val_loss", "best_step") if k in fit},
        train=cfg.to_dict(),
        vocab=task.vocab.to_json() if task.vocab else None,
    )
    save_checkpoint(args.out, model, meta, overwrite=args.force)
    print(f"test loss {test['loss']:.4f}  test accuracy {test['accuracy']:.4f}  ({fit['seconds']:.0f} s)")
    summary = {"out": str(args.out), "model": args.model, "dataset": task.dataset, "seed": args.seed}
    print(json.dumps(summary | meta.metrics | {"train_seconds": round(fit["seconds"], 1)}))
    return 0


def _train_config(args: argparse.Namespace, defaults: dict[str, Any]) -> TrainConfig:
    """The TrainConfig from the flags; those not given fall back to the dataset's defaults, then TrainConfig's."""
    from glmc.train import TrainConfig

    flags = ("batch_size", "lr", "weight_decay", "patience", "eval_every")
    given = {k: getattr(args, k) for k in flags if getattr(args, k) is not None}
    return TrainConfig(
        epochs=args.epochs,
        warmup=args.warmup,
        seed=args.seed,
        max_steps=args.max_steps,
        threads=args.threads,
        device=args.device,
        precision=args.precision,
        **(defaults | given),
    )
