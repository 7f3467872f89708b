"""Shared fixtures: tiny model configs and tiny synthetic data that a few steps can learn."""

import os

import pytest
import torch
from torch.utils.data import TensorDataset

from glmc.archs import ModelConfig, preset

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
