"""Tasks: a dataset name plus a preset give the data and the config with its data-dependent fields set.

Vision fills ``num_classes``, ``in_chans``, ``img_size`` and the ``patch`` that divides the images
(the dataset's ``HubSpec``: 7 for Fashion-MNIST, 4 for CIFAR, 8 for Tiny ImageNet); text fills
``vocab_size`` (the context comes from the preset and sets the window length). Each task also carries training defaults
that were measured to work on this 2-core CPU (see the README's "Measured" section).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset, Subset

from glmc.core.config import ModelConfig
from glmc.data.hub import HUB_DATASETS, HUB_ONLY, load_hub_copy
from glmc.errors import ConfigError

if TYPE_CHECKING:
    from glmc.data import BpeVocab, CharVocab, VisionSplits

VISION_DEFAULTS: dict[str, Any] = {"lr": 1e-3, "batch_size": 128}


@dataclass(frozen=True)
class Task:
    """The train/test data of one dataset and the model config that fits it."""

    dataset: str
    config: ModelConfig
    train: Dataset
    test: Dataset
    split: str  # description of how train and test were cut, stored with every checkpoint
    vocab: CharVocab | BpeVocab | None = None  # text tasks only
    defaults: dict[str, Any] = field(default_factory=dict)  # TrainConfig overrides that suit this data
    val: Dataset | None = None  # a validation split for early stopping, where the dataset defines one


def _require_modality(dataset: str, cfg: ModelConfig, modality: str) -> None:
    """ConfigError unless the config's family reads what the dataset holds (images, or token ids)."""
    from glmc.archs import get_arch

    if get_arch(cfg.family).modality != modality:
        kind = "an image model" if modality == "image" else "a language model"
        raise ConfigError(f"dataset {dataset!r} needs {kind} preset, got a {cfg.family} config")


def _vision_task(cfg: ModelConfig, data: VisionSplits) -> Task:
    """The task of loaded vision splits: the config takes their classes, channels, size and patch."""
    config = cfg.replace(num_classes=data.num_classes, in_chans=data.in_chans, img_size=data.img_size,
                         patch=HUB_DATASETS[data.name].patch)
    if data.img_size % config.patch:
        raise ConfigError(f"patch {config.patch} does not divide the {data.img_size}-pixel {data.name} images")
    split = f"{data.name} official split: {len(data.train)} train / {len(data.test)} test images"
    return Task(data.name, config, data.train, data.test, split, defaults=dict(VISION_DEFAULTS))


def fashion_mnist_task(cfg: ModelConfig, path: str | Path | None = None, seed: int = 0) -> Task:
    """Fashion-MNIST's official 60k/10k split for a ViT; ``seed`` is unused (the split is fixed)."""
    from glmc.data import load_fashion_mnist

    _require_modality("fashion-mnist", cfg, "image")
    return _vision_task(cfg, load_fashion_mnist(path))


def hub_task(dataset: str, cfg: ModelConfig, path: str | Path | None = None, seed: int = 0) -> Task:
    """A fetched hub set (CIFAR-10/100, Tiny ImageNet) and its official split; ``seed`` is unused."""
    _require_modality(dataset, cfg, "image")
    return _vision_task(cfg, load_hub_copy(dataset, path))


def _objective(cfg: ModelConfig, vocab: int, train: Dataset, test: Dataset, seed: int,
               ) -> tuple[ModelConfig, Dataset, Dataset, str]:
    """The config and splits for the family's objective: next-token windows as they are, or, for a masked model,
    one id more (the mask token) and the windows masked (:mod:`glmc.data.masking`), the test split's masks fixed by
    their index whatever ``seed`` (every evaluation sees the same)."""
    from glmc.archs import get_arch
    from glmc.data.masking import MaskedWindows

    if get_arch(cfg.family).objective == "causal":
        return cfg.replace(vocab_size=vocab), train, test, ""
    size = vocab + 1
    return (cfg.replace(vocab_size=size), MaskedWindows(train, size, seed), MaskedWindows(test, size, fixed=True),
            f"; masked LM (mask id {size - 1}, 15% selected: 80/10/10, test masks fixed)")


def shakespeare_task(cfg: ModelConfig, path: str | Path | None = None, seed: int = 0) -> Task:
    """Char-level Shakespeare, the tail 10% of every play held out; ``seed`` sets the window phase (and a masked
    model's training masks)."""
    from glmc.data import load_shakespeare

    _require_modality("shakespeare", cfg, "text")
    corpus = load_shakespeare(path, context=cfg.context, seed=seed)
    config, train, test, objective = _objective(cfg, corpus.vocab.size, corpus.train, corpus.test, seed)
    split = (
        f"shakespeare: last 10% of each of {len(corpus.plays)} plays held out; context {corpus.context}; "
        f"{len(corpus.train)} train / {len(corpus.test)} test windows{objective}"
    )
    return Task(
        "shakespeare",
        config,
        train,
        test,
        split,
        vocab=corpus.vocab,
        defaults={"lr": 3e-3, "batch_size": 32},
    )


# The official GLMC code's GPT-2 recipe: AdamW at 3e-4 with weight decay 0.01 (cosine, 5% warm-up: glmc train's
# own) and early stopping on validation; its batch size is not stated, 32 blocks is this project's choice.
PAPER_RECIPE: dict[str, Any] = {"lr": 3e-4, "batch_size": 32, "weight_decay": 0.01, "patience": 5, "eval_every": 100}


def shakespeare_bpe_task(cfg: ModelConfig, path: str | Path | None = None, seed: int = 0) -> Task:
    """Shakespeare as byte-level BPE blocks of the preset's context, split 90/5/5 (``glmc.data.bpe``); fixed,
    whatever the seed."""
    from glmc.data import load_shakespeare_bpe
    from glmc.data.masking import MaskedWindows

    _require_modality("shakespeare-bpe", cfg, "text")
    corpus = load_shakespeare_bpe(path, context=cfg.context)
    config, train, test, objective = _objective(cfg, corpus.vocab.size, corpus.train, corpus.test, seed)
    val = corpus.val if not objective else MaskedWindows(corpus.val, config.vocab_size, fixed=True)
    split = (f"shakespeare-bpe: contiguous 90/5/5 split, byte-level BPE vocab {corpus.vocab.size}; blocks of "
             f"{corpus.context} tokens: {len(corpus.train)} train / {len(corpus.val)} validation / "
             f"{len(corpus.test)} test{objective}")
    return Task("shakespeare-bpe", config, train, test, split, vocab=corpus.vocab, defaults=dict(PAPER_RECIPE),
                val=val)


TASKS: dict[str, Callable[..., Task]] = {
    "fashion-mnist": fashion_mnist_task,
    "shakespeare": shakespeare_task,
    "shakespeare-bpe": shakespeare_bpe_task,
    **{name: functools.partial(hub_task, name) for name in HUB_ONLY},
}


def load_task(dataset: str, cfg: ModelConfig, path: str | Path | None = None, seed: int = 0) -> Task:
    """The named task for ``cfg``; unknown names raise ConfigError listing the known ones."""
    if dataset not in TASKS:
        raise ConfigError(f"unknown dataset {dataset!r}; known: {', '.join(TASKS)}")
    return TASKS[dataset](cfg, path, seed)


def train_on_fraction(task: Task, fraction: float) -> Task:
    """``task`` trained on the first ``fraction`` of its training split, the split string saying so: a data-size
    control. The first samples, not a random draw: a contiguous split stays contiguous text."""
    if not 0 < fraction <= 1:
        raise ConfigError(f"the training fraction must be in (0, 1], got {fraction:g}")
    if fraction == 1:
        return task
    total = len(task.train)  # type: ignore[arg-type]
    kept = max(1, round(fraction * total))
    return dataclasses.replace(task, train=Subset(task.train, range(kept)),  # type: ignore[arg-type]
                               split=f"{task.split}; trained on the first {kept} of the {total} training samples")


def held_out(dataset: str, cfg: ModelConfig, path: str | Path | None = None, limit: int | None = None) -> Dataset:
    """The test split, cut to its first ``limit`` samples: the fixed set every barrier and merge is measured on."""
    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be at least 1 held-out sample, got {limit}")
    test = load_task(dataset, cfg, path).test
    return test if limit is None else Subset(test, range(min(limit, len(test))))  # type: ignore[arg-type]


def inputs_of(data: Dataset, n: int) -> torch.Tensor:
    """The first ``n`` inputs of a dataset of (input, target) pairs, stacked into one batch."""
    count = min(n, len(data))  # type: ignore[arg-type]
    return torch.stack([data[i][0] for i in range(count)])
