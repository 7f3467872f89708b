"""The user's own data for models glmc did not train: token ids in a ``.npy`` (next-token targets), or images and
labels in a ``.npz``. Read with ``allow_pickle=False``: an array file never runs code.

- ``.npy``: integer token ids, either (N, L) rows (inputs ``[:, :-1]``, targets ``[:, 1:]``, L − 1 ≤ the context)
  or one 1-D stream, cut into windows of the model's context plus one;
- ``.npz``: ``images`` (N, C, H, W), float, normalised as the model takes them, and ``labels`` (N,) integers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from glmc.archs import get_arch
from glmc.core.config import ModelConfig
from glmc.errors import ConfigError

IMAGE_KEYS = ("images", "labels")


def _array_file(path: Path) -> np.ndarray | dict[str, np.ndarray]:
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path} is not a readable .npy/.npz array file: {str(err).splitlines()[0]}") from err
    if isinstance(loaded, np.ndarray):
        return loaded
    with loaded:
        return {key: loaded[key] for key in loaded.files}


def _token_windows(ids: np.ndarray, context: int, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    if not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError(f"{path}: token ids must be integers, got {ids.dtype}")
    if ids.ndim == 1:
        usable = (len(ids) - 1) // context * context
        if usable < context:
            raise ConfigError(f"{path}: a stream of {len(ids)} token ids is shorter than one window of {context + 1}")
        rows = np.lib.stride_tricks.sliding_window_view(ids[: usable + 1], context + 1)[::context]
    elif ids.ndim == 2 and ids.shape[1] >= 2:
        rows = ids
    else:
        raise ConfigError(f"{path}: token ids must be (N, L ≥ 2) rows or one 1-D stream, got shape {ids.shape}")
    rows_t = torch.from_numpy(np.ascontiguousarray(rows)).long()
    return rows_t[:, :-1], rows_t[:, 1:]


def _images(arrays: dict[str, np.ndarray], path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    missing = [k for k in IMAGE_KEYS if k not in arrays]
    if missing:
        raise ConfigError(f"{path}: a .npz of images needs arrays {IMAGE_KEYS}; it lacks {missing[0]!r}")
    images, labels = arrays["images"], arrays["labels"]
    if labels.ndim != 1 or len(labels) != len(images) or not np.issubdtype(labels.dtype, np.integer):
        raise ConfigError(f"{path}: labels must be (N,) integers, one per image; got {labels.shape} {labels.dtype}")
    return torch.from_numpy(images.astype(np.float32)), torch.from_numpy(labels.astype(np.int64))


def load_data_file(path: str | Path, cfg: ModelConfig, limit: int | None = None) -> Dataset:
    """(input, target) pairs from the file, checked to fit ``cfg``'s model; the first ``limit`` only if given. Token
    windows for a masked language model come masked (:func:`glmc.data.masking.for_objective`)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no data file at {path}")
    loaded = _array_file(path)
    x, y = _images(loaded, path) if isinstance(loaded, dict) else _token_windows(loaded, cfg.context, path)
    if limit is not None:
        x, y = x[:limit], y[:limit]
    try:
        get_arch(cfg.family).check_inputs(cfg, x)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from err
    outputs = cfg.vocab_size or cfg.num_classes  # a text model's vocabulary, else its classes
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= outputs):
        raise ConfigError(f"{path}: targets run from {int(y.min())} to {int(y.max())}, outside the model's "
                          f"{outputs} outputs")
    from glmc.data.masking import for_objective

    return for_objective(TensorDataset(x, y), cfg) if not isinstance(loaded, dict) else TensorDataset(x, y)
