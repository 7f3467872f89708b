"""Vision datasets hosted on the Hugging Face hub (CIFAR-10/100, Tiny ImageNet), via flwr-datasets.

Only ``python -m glmc.data.fetch NAME`` (or ``allow_hub=True``) downloads: it stores each split as
uint8 arrays in ``data_root()/NAME/{train,test}.npz``, which ``load_hub_copy`` reads offline. Tests
pass a local ``datasets`` object in the same schema, which goes through the same conversion.
"""

import logging
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from glmc.data.paths import data_root, staged_dir
from glmc.data.vision import VisionSplits, make_splits
from glmc.errors import ConfigError, DataNotFoundError

log = logging.getLogger(__name__)

Arrays = tuple[np.ndarray, np.ndarray]  # uint8 images (N, H, W[, C]) and int64 labels (N,)


@dataclass(frozen=True)
class HubSpec:
    """Where a hub dataset lives, how its columns and splits are named, and the ViT patch that fits it."""

    name: str
    repo: str
    image: str
    label: str
    train: str
    test: str
    num_classes: int
    mode: str  # PIL mode every image is converted to, so odd grayscale files stack with RGB
    patch: int  # ViT patch side that divides the images: 28 → 7, 32 → 4, 64 → 8 (an 8×8 grid)


HUB_DATASETS = {
    "cifar10": HubSpec("cifar10", "uoft-cs/cifar10", "img", "label", "train", "test", 10, "RGB", 4),
    "cifar100": HubSpec("cifar100", "uoft-cs/cifar100", "img", "fine_label", "train", "test", 100, "RGB", 4),
    # Tiny ImageNet has a few grayscale JPEGs among its 64×64 RGB images; its test split is "valid".
    "tiny-imagenet": HubSpec(
        "tiny-imagenet", "zh-plus/tiny-imagenet", "image", "label", "train", "valid", 200, "RGB", 8
    ),
    "fashion-mnist": HubSpec(
        "fashion-mnist", "zalando-datasets/fashion_mnist", "image", "label", "train", "test", 10, "L", 7
    ),
}
# The sets that exist here only as a fetched copy (Fashion-MNIST has its Debian package).
HUB_ONLY = ("cifar10", "cifar100", "tiny-imagenet")
COPY_FILES = ("train.npz", "test.npz")  # a fetched copy: the train split, then the test split


def hub_spec(name: str) -> HubSpec:
    """The spec of hub set ``name``, or a ConfigError listing the known ones."""
    if name not in HUB_DATASETS:
        raise ConfigError(f"unknown hub dataset {name!r}; choose one of {sorted(HUB_DATASETS)}")
    return HUB_DATASETS[name]


def fetch_hint(name: str) -> str:
    """How to get a missing copy of ``name``."""
    return f"on a connected machine run `python -m glmc.data.fetch {name}`"


def load_hub_vision(
    name: Literal["cifar10", "cifar100", "tiny-imagenet"],
    dataset: Mapping[str, Any] | None = None,
    allow_hub: bool = False,
) -> VisionSplits:
    """Load a hub vision dataset as normalised (N, C, H, W) tensors.

    ``dataset`` is a ``datasets.DatasetDict`` (or dict of split → ``datasets.Dataset``) in the
    hub schema; without it the data is downloaded, which needs ``allow_hub=True``.
    """
    spec = hub_spec(name)
    how_to = f"pass allow_hub=True on a machine with internet to download {spec.repo}"
    if dataset is not None:
        return splits_from_dataset(spec, dataset)
    if not allow_hub:
        raise DataNotFoundError(f"{name} is hub-only and allow_hub is False; {how_to}")
    return download_hub_splits(spec, how_to)


def download_hub_dataset(spec: HubSpec, how_to: str) -> dict[str, Any]:
    """Download the train and test splits of ``spec.repo`` through ``flwr_datasets.FederatedDataset``.

    This is the project's only network path to the hub; any failure → DataNotFoundError.
    """
    from flwr_datasets import FederatedDataset  # imported here: heavy, and only needed online

    log.info("downloading %s from the hub", spec.repo)
    try:
        fds = FederatedDataset(dataset=spec.repo, partitioners={spec.train: 1})
        return {split: fds.load_split(split) for split in (spec.train, spec.test)}
    except Exception as err:  # network, hub or cache errors all mean "data not available"
        raise DataNotFoundError(f"could not download {spec.repo} ({type(err).__name__}); {how_to}") from err


def download_hub_splits(spec: HubSpec, how_to: str) -> VisionSplits:
    """Download ``spec.repo`` and convert it to normalised ``VisionSplits``."""
    return splits_from_dataset(spec, download_hub_dataset(spec, how_to))


def splits_from_dataset(spec: HubSpec, dataset: Mapping[str, Any]) -> VisionSplits:
    """Convert the train/test splits of a hub-schema dataset into normalised ``VisionSplits``."""
    train, test = dataset_arrays(spec, dataset)
    return make_splits(train, test, num_classes=spec.num_classes, name=spec.name)


def dataset_arrays(spec: HubSpec, dataset: Mapping[str, Any]) -> tuple[Arrays, Arrays]:
    """The train and test splits of a hub-schema dataset as uint8 images and int64 labels."""
    missing = [split for split in (spec.train, spec.test) if split not in dataset]
    if missing:
        raise ConfigError(f"{spec.name} dataset lacks split(s) {missing}; it has {list(dataset)}")
    return _to_arrays(spec, dataset[spec.train]), _to_arrays(spec, dataset[spec.test])


def _to_arrays(spec: HubSpec, split: Any) -> Arrays:
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


def save_hub_copy(spec: HubSpec, dataset: Mapping[str, Any], dest: Path) -> Path:
    """Convert a hub-schema dataset once and store it in ``dest`` as ``train.npz`` and ``test.npz``.

    Decoding 50,000 PNGs takes minutes; a ClientApp starts a fresh process every round, so it reads
    these arrays instead. The files appear in ``dest`` only once both are written.
    """
    splits = dataset_arrays(spec, dataset)
    with staged_dir(dest) as staging:
        for filename, (images, labels) in zip(COPY_FILES, splits, strict=True):
            np.savez(staging / filename, images=images, labels=labels)
    log.info("stored %s (%d train / %d test images) in %s", spec.name, len(splits[0][1]), len(splits[1][1]), dest)
    return dest


def copy_dir(name: str, path: str | Path | None = None) -> Path:
    """Where the copy of ``name`` lives: ``path`` if given, else ``data_root()/name``."""
    return Path(path) if path is not None else data_root() / name


def has_copy(directory: Path) -> bool:
    """Whether ``directory`` holds a complete fetched copy."""
    return all((directory / filename).is_file() for filename in COPY_FILES)


def load_hub_copy(name: str, path: str | Path | None = None) -> VisionSplits:
    """The fetched copy of hub set ``name`` (see ``copy_dir``) as normalised tensors; never downloads."""
    spec = hub_spec(name)
    directory = copy_dir(name, path)
    if not has_copy(directory):
        raise DataNotFoundError(f"{name} not found in {directory} (needs {' and '.join(COPY_FILES)}); "
                                f"{fetch_hint(name)}")
    log.info("loading %s from %s", name, directory)
    train, test = (_read_arrays(directory / filename, name) for filename in COPY_FILES)
    return make_splits(train, test, num_classes=spec.num_classes, name=name)


def _read_arrays(path: Path, name: str) -> Arrays:
    """One stored split (no pickle: the files may come from elsewhere); a bad file → DataNotFoundError."""
    try:
        with np.load(path, allow_pickle=False) as stored:
            images, labels = stored["images"], stored["labels"]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
        raise DataNotFoundError(f"{path} is not a fetched copy ({err}); {fetch_hint(name)}") from err
    if images.dtype != np.uint8 or images.ndim not in (3, 4) or labels.ndim != 1 or len(images) != len(labels):
        raise DataNotFoundError(f"{path} holds images {images.dtype}{images.shape} and labels {labels.shape}, "
                                f"not uint8 (N,H,W[,C]) and (N,); {fetch_hint(name)}")
    return images, labels.astype(np.int64, copy=False)
