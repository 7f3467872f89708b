"""In-memory image datasets shared by every vision loader: normalised tensors plus labels."""

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from glmc.errors import ConfigError


class ArrayDataset(Dataset):
    """Images ``x`` (N, C, H, W) float32 and labels ``y`` (N,) int64, held in memory."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if x.ndim != 4 or y.ndim != 1 or len(x) != len(y):
            raise ConfigError(f"expected x (N,C,H,W) and y (N,), got {tuple(x.shape)} and {tuple(y.shape)}")
        self.x = x.float()
        self.y = y.long()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    @property
    def labels(self) -> np.ndarray:
        """Labels as an int64 numpy array, the form the partitioners take."""
        return self.y.numpy().astype(np.int64, copy=False)

    def subset(self, indices: np.ndarray | list[int]) -> "ArrayDataset":
        """A client's share: the rows at ``indices`` (e.g. one output of ``partition_indices``)."""
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        return ArrayDataset(self.x[idx], self.y[idx])


@dataclass(frozen=True)
class VisionSplits:
    """A vision dataset's train and test sets plus the numbers a ViT constructor needs."""

    train: ArrayDataset
    test: ArrayDataset
    num_classes: int
    in_chans: int
    img_size: int
    name: str


def make_splits(
    train: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
    num_classes: int,
    name: str,
) -> VisionSplits:
    """Build splits from uint8/float images (N, H, W[, C]) and labels, normalised per channel.

    Mean and std come from the training images only, so the test set leaks nothing.
    """
    x_train, x_test = _to_nchw(train[0]), _to_nchw(test[0])
    mean = x_train.mean(axis=(0, 2, 3), keepdims=True)
    std = x_train.std(axis=(0, 2, 3), keepdims=True) + 1e-8
    return VisionSplits(
        train=_normalised(x_train, train[1], mean, std),
        test=_normalised(x_test, test[1], mean, std),
        num_classes=num_classes,
        in_chans=x_train.shape[1],
        img_size=x_train.shape[2],
        name=name,
    )


def _normalised(x: np.ndarray, y: np.ndarray, mean: np.ndarray, std: np.ndarray) -> ArrayDataset:
    """Standardise ``x`` in place with the given per-channel statistics and wrap it with labels."""
    x -= mean
    x /= std
    return ArrayDataset(torch.from_numpy(x), torch.from_numpy(np.asarray(y, dtype=np.int64)))


def _to_nchw(images: np.ndarray) -> np.ndarray:
    """(N, H, W) or (N, H, W, C) images → float32 (N, C, H, W) scaled to [0, 1] if uint8."""
    x = np.asarray(images)
    scale = 255.0 if x.dtype == np.uint8 else 1.0
    x = x.astype(np.float32) / scale
    if x.ndim == 3:
        return x[:, None]
    if x.ndim == 4:
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    raise ConfigError(f"expected images (N,H,W) or (N,H,W,C), got shape {x.shape}")
