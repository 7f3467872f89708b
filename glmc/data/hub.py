"""Vision datasets hosted on the Hugging Face hub (CIFAR-10/100, Tiny ImageNet), via flwr-datasets.

The download path runs only when the caller passes ``allow_hub=True``; tests and offline runs
pass a local ``datasets`` object in the same schema, which goes through the same conversion.
"""

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from glmc.data.vision import VisionSplits, make_splits
from glmc.errors import ConfigError, DataNotFoundError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HubSpec:
    """Where a hub dataset lives and how its columns and splits are named."""

    name: str
    repo: str
    image: str
    label: str
    train: str
    test: str
    num_classes: int
    mode: str  # PIL mode every image is converted to, so odd grayscale files stack with RGB


HUB_DATASETS = {
    "cifar10": HubSpec("cifar10", "uoft-cs/cifar10", "img", "label", "train", "test", 10, "RGB"),
    "cifar100": HubSpec("cifar100", "uoft-cs/cifar100", "img", "fine_label", "train", "test", 100, "RGB"),
    # Tiny ImageNet has a few grayscale JPEGs among its 64×64 RGB images; its test split is "valid".
    "tiny-imagenet": HubSpec(
        "tiny-imagenet", "zh-plus/tiny-imagenet", "image", "label", "train", "valid", 200, "RGB"
    ),
    "fashion-mnist": HubSpec(
        "fashion-mnist", "zalando-datasets/fashion_mnist", "image", "label", "train", "test", 10, "L"
    ),
}


def load_hub_vision(
    name: Literal["cifar10", "cifar100", "tiny-imagenet"],
    dataset: Mapping[str, Any] | None = None,
    allow_hub: bool = False,
) -> VisionSplits:
    """Load a hub vision dataset as normalised (N, C, H, W) tensors.

    ``dataset`` is a ``datasets.DatasetDict`` (or dict of split → ``datasets.Dataset``) in the
    hub schema; without it the data is downloaded, which needs ``allow_hub=True``.
    """
    if name not in HUB_DATASETS:
        raise ConfigError(f"unknown hub dataset {name!r}; choose one of {sorted(HUB_DATASETS)}")
    spec = HUB_DATASETS[name]
    how_to = f"pass allow_hub=True on a machine with internet to download {spec.repo}"
    if dataset is not None:
        return splits_from_dataset(spec, dataset)
    if not allow_hub:
        raise DataNotFoundError(f"{name} is hub-only and allow_hub is False; {how_to}")
    return download_hub_splits(spec, how_to)


def download_hub_splits(spec: HubSpec, how_to: str) -> VisionSplits:
    """Download ``spec.repo`` through ``flwr_datasets.FederatedDataset``; any failure → DataNotFoundError."""
    from flwr_datasets import FederatedDataset  # imported here: heavy, and only needed online

    log.info("downloading %s from the hub", spec.repo)
    try:
        fds = FederatedDataset(dataset=spec.repo, partitioners={spec.train: 1})
        splits = {split: fds.load_split(split) for split in (spec.train, spec.test)}
    except Exception as err:  # network, hub or cache errors all mean "data not available"
        raise DataNotFoundError(f"could not download {spec.repo} ({type(err).__name__}); {how_to}") from err
    return splits_from_dataset(spec, splits)


def splits_from_dataset(spec: HubSpec, dataset: Mapping[str, Any]) -> VisionSplits:
    """Convert the train/test splits of a hub-schema dataset into normalised ``VisionSplits``."""
    missing = [split for split in (spec.train, spec.test) if split not in dataset]
    if missing:
        raise ConfigError(f"{spec.name} dataset lacks split(s) {missing}; it has {list(dataset)}")
    train = _to_arrays(spec, dataset[spec.train])
    test = _to_arrays(spec, dataset[spec.test])
    return make_splits(train, test, num_classes=spec.num_classes, name=spec.name)


def _to_arrays(spec: HubSpec, split: Any) -> tuple[np.ndarray, np.ndarray]:
    """One split → uint8 images (N, H, W[, C]) and int64 labels (N,)."""
    for column in (spec.image, spec.label):
        if column not in split.column_names:
            raise ConfigError(f"{spec.name} split lacks column {column!r}; it has {split.column_names}")
    # datasets 4.x columns are lazy: materialise labels as one numpy array.
    labels = np.asarray(
        split.select_columns([spec.label]).with_format("numpy")[:][spec.label], dtype=np.int64
    )
    images = np.stack([np.asarray(image.convert(spec.mode), dtype=np.uint8) for image in split[spec.image]])
    return images, labels
