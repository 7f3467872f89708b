"""A run config checked whole before round 1, each error one line naming the key and its choices: the keys
themselves (a misspelled one gets its nearest names), what RunSettings checks of every value, then what the data and
the model can take: a dataset that can be split among clients, a partitioner that splits it, width tiers whose models
nest in the full one. The ServerApp and every ClientApp read their config through :func:`check_run_config`, and so does
``flwr run`` itself before it submits a run (``server/submission.py``)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from federation.settings import INITS, LABEL_SPLITS, NATURAL_SPLITS, RunSettings
from glmc.archs import get_arch
from glmc.core.config import ModelConfig, preset
from glmc.data.hub import HUB_DATASETS
from glmc.errors import ConfigError
from glmc.merging.widths import require_width_tier

TEXT_SPLITS = {"shakespeare": NATURAL_SPLITS}  # text datasets and their natural clients (LEAF)
FEDERATED_DATASETS = (*HUB_DATASETS, *TEXT_SPLITS)  # labelled images take the label splits
KEYS_PAGE = "docs/run-config.md"  # where every key is listed


def check_run_config(config: Mapping[str, Any]) -> RunSettings:
    """The settings of a run config (the app's defaults and the run's overrides), refused before any work, in one
    line naming the key and its choices. A model that an ``init`` checkpoint gives is checked where it is read
    (:func:`check_fit`, from ``server.app``)."""
    check_keys(config)
    settings = RunSettings.from_run_config(config)
    if settings.init in INITS:
        check_fit(settings, preset(settings.model))
    return settings


def check_keys(config: Mapping[str, Any]) -> None:
    """ConfigError naming the first key that RunSettings does not read, and the keys nearest to it."""
    known = list(RunSettings.key_kinds())
    for key in config:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=3)
            hint = f"did you mean {' or '.join(map(repr, near))}?" if near else f"the keys are in {KEYS_PAGE}"
            raise ConfigError(f"unknown run-config key {key!r}: {hint}")


def check_fit(settings: RunSettings, cfg: ModelConfig) -> None:
    """ConfigError unless the dataset can be split by ``settings.partitioner`` for a model of ``cfg`` and its family
    can merge the width tiers."""
    check_partitioner(settings.partitioner, settings.dataset, cfg.family)
    tiers = ",".join(f"{t:g}" for t in settings.width_tiers)
    for tier in settings.trained_tiers:  # relative to the global model (smallest-width's is the smallest tier's)
        if tier != 1:
            require_width_tier(cfg, tier, f"width-tiers '{tiers}'", "use width-tiers whose models nest (1, 0.5, ...)")


def fitting_partitioners(dataset: str, family: str) -> tuple[str, ...]:
    """The partitioners that split ``dataset`` among clients training a ``family`` model: the label splits of
    labelled images, a text's natural clients for a next-token model; none for any other."""
    if dataset in HUB_DATASETS:
        return LABEL_SPLITS
    return TEXT_SPLITS.get(dataset, ()) if get_arch(family).objective == "causal" else ()


def check_partitioner(partitioner: str, dataset: str, family: str) -> None:
    """ConfigError naming the partitioners that fit, unless ``partitioner`` splits ``dataset`` for ``family``."""
    fits = fitting_partitioners(dataset, family)
    if dataset not in FEDERATED_DATASETS:
        raise ConfigError(f"dataset {dataset!r} cannot be split among clients; dataset must be one of "
                          f"{', '.join(FEDERATED_DATASETS)}")
    if not fits:
        raise ConfigError(f"dataset {dataset!r} holds next-token windows, and a {family} model learns masked tokens, "
                          "which the federated clients do not yet draw; model must be a causal one (gpt2-tiny, "
                          "llama-tiny, ...)")
    if partitioner not in fits:
        raise ConfigError(f"partitioner {partitioner!r} does not split {dataset}; partitioner must be one of "
                          f"{', '.join(fits)} (or auto)")
