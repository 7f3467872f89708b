"""Shared fixtures: tiny model configs and tiny synthetic data that a few steps can learn."""

import os

# One OpenBLAS thread for numpy and scipy, set before they load: two test workers share two cores (make test), and
# a BLAS thread spinning for a core the other worker holds slows both, as an OpenMP one does (below).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from glmc.core.config import ModelConfig, preset
from glmc.data.hub import HUB_DATASETS, save_hub_copy

# Tests never touch the network, whatever the caller's environment says.
os.environ["HF_HUB_OFFLINE"] = "1"
# Tiny models gain nothing from a second thread, and on a busy 2-core machine a spinning OpenMP
# thread that gets descheduled can make a step ten times slower; one thread keeps timings steady.
torch.set_num_threads(1)


@pytest.fixture
def tiny_vit() -> ModelConfig:
    """A 2-block ViT on 8×8 single-channel images with 4 patches and 3 classes."""
    return preset("vit-tiny").replace(img_size=8, patch=4, in_chans=1, num_classes=3)


@pytest.fixture
def tiny_gpt2() -> ModelConfig:
    """A 2-block GPT-2 over a 7-symbol vocabulary with a context of 12."""
    return preset("gpt2-tiny").replace(vocab_size=7, context=12)


def synthetic_images(n: int = 96, seed: int = 0) -> TensorDataset:
    """8×8 noise images whose class (0, 1, 2) is which third of the rows is bright."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    x = 0.3 * torch.randn(n, 1, 8, 8, generator=g)
    rows = torch.arange(8)
    x += (rows[None, :] // 3 == y[:, None]).float()[:, None, :, None]  # (n, 1, 8, 1) broadcast over columns
    return TensorDataset(x, y)


def synthetic_text(n: int = 64, context: int = 12, vocab: int = 7, seed: int = 0) -> TensorDataset:
    """Windows of the cycle 0, 1, …, vocab-1 from random starts: the next token is always learnable."""
    starts = torch.randint(0, vocab, (n, 1), generator=torch.Generator().manual_seed(seed))
    seq = (starts + torch.arange(context + 1)) % vocab  # (n, context + 1)
    return TensorDataset(seq[:, :-1], seq[:, 1:])


@pytest.fixture
def images() -> TensorDataset:
    return synthetic_images()


@pytest.fixture
def text() -> TensorDataset:
    return synthetic_text()


def hub_split(rng: np.random.Generator, n: int, image: str, label: str, modes: list[str], size: int = 8,
              num_classes: int = 10) -> Any:
    """``n`` random size×size PIL images (modes cycling through ``modes``) with labels, in a hub schema."""
    import datasets
    import PIL.Image

    images = [
        PIL.Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).convert(modes[i % len(modes)])
        for i in range(n)
    ]
    features = datasets.Features({image: datasets.Image(), label: datasets.Value("int64")})
    return datasets.Dataset.from_dict({image: images, label: rng.integers(0, num_classes, n).tolist()}, features)


# The real image side of every hub set, so a tiny fake copy has the real shapes.
HUB_SIZES = {"cifar10": 32, "cifar100": 32, "tiny-imagenet": 64}


def fake_hub_dataset(name: str, train: int = 40, test: int = 10, seed: int = 0) -> dict[str, Any]:
    """A tiny dataset in ``name``'s hub schema (its columns, split names and image size); a few are grayscale."""
    spec, rng = HUB_DATASETS[name], np.random.default_rng(seed)
    return {split: hub_split(rng, n, spec.image, spec.label, ["RGB", "RGB", "L"], HUB_SIZES[name], spec.num_classes)
            for split, n in ((spec.train, train), (spec.test, test))}


def fake_hub_copy(name: str, dest: Path, train: int = 40, test: int = 10) -> Path:
    """``fake_hub_dataset`` converted and stored in ``dest`` by the fetch's own save step."""
    return save_hub_copy(HUB_DATASETS[name], fake_hub_dataset(name, train, test), dest)
