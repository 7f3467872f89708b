"""What each party of a federated run sees of the data, loaded once per process and cached.

- **Server-held data** (for activation / learned alignment): ``server-data`` training samples that
  no client ever holds. Vision: a seeded random subset of the training images, removed before the
  clients' split. Text: whole natural clients (roles or plays) reserved for the server.
- **Clients**: the rest of the training data split by a seeded flwr-datasets partitioner (vision),
  or one natural client each (text). Each client keeps its last 10% as a local validation set.
- **Central test set**: vision, the official test split; text, the held-out tail of every client's
  text (never trained on, since each client trains on the head of its own text only).

Nothing here depends on how many clients a run has except the client shares themselves, so the
ServerApp can build its test and server sets without knowing the number of SuperNodes.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import ConcatDataset, Dataset, Subset

from federation.preflight import check_partitioner
from federation.settings import NATURAL_SPLITS, RunSettings
from glmc.core.config import ModelConfig, preset, scale_width
from glmc.data.tasks import Task, load_task
from glmc.data.vision import ArrayDataset
from glmc.errors import ConfigError

log = logging.getLogger(__name__)

VAL_FRACTION = 0.1


@dataclass(frozen=True)
class Pool:
    """Everything of one dataset that does not depend on the number of clients."""

    task: Task
    test: Dataset  # central test set (full; ``eval_subset`` applies eval-limit)
    server: Dataset | None  # server-held alignment data, disjoint from every client
    units: tuple[Any, ...]  # vision: (client-pool row indices,); text: the natural clients (TextPartition)


@dataclass(frozen=True)
class ClientShare:
    """One client's local data and where it came from."""

    train: Dataset
    val: Dataset
    description: dict[str, Any]


PoolKey = tuple[str, str, str, int, int, int, tuple[Path, ...], float, float]


def pool_key(settings: RunSettings) -> PoolKey:
    """What shapes a pool: the one cache key of :func:`pool` and of the label splits drawn from it (one load per
    process)."""
    return (settings.dataset, settings.model, settings.partitioner, settings.seed, settings.held_back,
            settings.train_limit, tuple(settings.init_checkpoints), settings.dropout, settings.global_width)


def pool(settings: RunSettings) -> Pool:
    """The cached pool of ``settings``' dataset."""
    return _pool(*pool_key(settings))


def server_reads(settings: RunSettings) -> Dataset | None:
    """What the server reads of the samples held back for it: all of them, or a seeded subset of server-reads."""
    held = pool(settings).server
    if held is None or not settings.server_reads:
        return held
    rows = np.sort(np.random.default_rng(settings.seed).permutation(len(held))[:settings.server_reads])  # type: ignore[arg-type]
    return held.subset(rows) if isinstance(held, ArrayDataset) else Subset(held, rows.tolist())


def base_config(dataset: str, model: str, checkpoints: tuple[Path, ...], dropout: float = -1.0,
                width: float = 1.0) -> ModelConfig:
    """The global model's config: the model preset, or the config of the first ``init`` checkpoint, whose
    data-dependent sizes must be the dataset's (a run cannot retrain a 1000-class head on 10 classes without saying
    so), at ``width`` (RunSettings.global_width); ``dropout`` ≥ 0 replaces its training dropout."""
    cfg = scale_width(_start_config(dataset, model, checkpoints), width)
    return cfg if dropout < 0 else cfg.replace(dropout=dropout)


def _start_config(dataset: str, model: str, checkpoints: tuple[Path, ...]) -> ModelConfig:
    """The model preset, or the first ``init`` checkpoint's config checked against the dataset."""
    if not checkpoints:
        return preset(model)
    from glmc.io.formats import read

    cfg = read(checkpoints[0])[1].config
    fitted = load_task(dataset, cfg).config
    if fitted != cfg:
        diff = "; ".join(f"{k} {v} (the data needs {fitted.to_dict()[k]})" for k, v in cfg.to_dict().items()
                         if fitted.to_dict()[k] != v)
        raise ConfigError(f"init checkpoint {checkpoints[0]} does not fit {dataset}: {diff}")
    return cfg


@functools.lru_cache(maxsize=4)
def _pool(dataset: str, model: str, partitioner: str, seed: int, server_data: int, train_limit: int,
          checkpoints: tuple[Path, ...], dropout: float, width: float) -> Pool:
    task = load_task(dataset, base_config(dataset, model, checkpoints, dropout, width), seed=seed)
    check_partitioner(partitioner, dataset, task.config.family)
    if partitioner in NATURAL_SPLITS:
        return _text_pool(task, partitioner, seed, server_data)
    train = task.train
    assert isinstance(train, ArrayDataset), "check_partitioner gives label splits only to labelled images"
    rows = np.random.default_rng(seed).permutation(len(train))
    server = train.subset(np.sort(rows[:server_data])) if server_data else None
    clients = rows[server_data:server_data + train_limit] if train_limit else rows[server_data:]
    return Pool(task, task.test, server, (np.sort(clients),))


def _text_pool(task: Task, by: str, seed: int, server_data: int) -> Pool:
    """Natural clients in a seeded order; the first few go to the server until it has ``server_data`` windows."""
    from glmc.data import shakespeare_partitions

    units = shakespeare_partitions(None, by=by, context=task.config.context)
    units = [units[i] for i in np.random.default_rng(seed).permutation(len(units))]
    held: list[Dataset] = []
    while server_data and _size(held) < server_data and units:
        held.append(units.pop(0).train)
    if server_data and _size(held) < server_data:
        raise ConfigError(f"server-data={server_data} exceeds the text of every natural client")
    server: Dataset | None = Subset(ConcatDataset(held), range(server_data)) if held else None
    log.info("%d natural clients by %s; %d reserved for the server", len(units), by, len(held))
    return Pool(task, ConcatDataset([u.test for u in units]), server, tuple(units))


def client_share(settings: RunSettings, partition_id: int, num_partitions: int) -> ClientShare:
    """Partition ``partition_id`` of ``num_partitions``: its training data and its local validation set."""
    if not 0 <= partition_id < num_partitions:
        raise ConfigError(f"partition-id {partition_id} is outside 0..{num_partitions - 1}")
    data = pool(settings)
    if settings.partitioner in NATURAL_SPLITS:
        if num_partitions > len(data.units):
            raise ConfigError(f"{num_partitions} partitions but only {len(data.units)} natural clients")
        unit = data.units[partition_id]
        return ClientShare(unit.train, unit.test, {"scheme": settings.partitioner, "id": unit.id})
    rows = _label_split(settings, num_partitions)[partition_id]
    order = np.random.default_rng([settings.seed, partition_id]).permutation(rows)
    cut = len(rows) - int(len(rows) * VAL_FRACTION)
    train = _images(data.task)
    return ClientShare(train.subset(np.sort(order[:cut])), train.subset(np.sort(order[cut:])),
                       {"scheme": settings.partitioner, "partition": partition_id, "rows": len(rows)})


def split_config(settings: RunSettings, num_partitions: int) -> Any:
    """The glmc SplitConfig of a label split (its ``describe()`` goes with every result)."""
    from glmc.data import SplitConfig

    return SplitConfig(scheme=settings.partitioner, num_partitions=num_partitions, alpha=settings.alpha,  # type: ignore[arg-type]
                       classes_per_client=settings.classes_per_client, seed=settings.seed)


def _label_split(settings: RunSettings, num_partitions: int) -> list[np.ndarray]:
    """Row indices of every client, cached per process (the partitioners take about a second)."""
    return _label_split_cached(split_config(settings, num_partitions), pool_key(settings))


@functools.lru_cache(maxsize=4)
def _label_split_cached(cfg: Any, key: PoolKey) -> list[np.ndarray]:
    from glmc.data import partition_indices

    data = _pool(*key)
    rows = data.units[0]
    return [rows[part] for part in partition_indices(_images(data.task).labels[rows], cfg)]


def label_counts(settings: RunSettings, num_partitions: int) -> list[list[int]] | None:
    """Clients × classes label histogram of a label split (None for natural text clients)."""
    if settings.partitioner in NATURAL_SPLITS:
        return None
    from glmc.data import label_counts as counts

    data = pool(settings)
    parts = _label_split(settings, num_partitions)
    return counts(_images(data.task).labels, parts, data.task.config.num_classes).tolist()


def _images(task: Task) -> ArrayDataset:
    """The labelled training images of a vision task (the label splits need them)."""
    assert isinstance(task.train, ArrayDataset), "label splits are checked to be vision tasks in _pool"
    return task.train


def _size(datasets: list[Dataset]) -> int:
    return sum(len(d) for d in datasets)  # type: ignore[arg-type, misc]


def eval_subset(dataset: Dataset, limit: int, seed: int) -> Dataset:
    """A seeded random ``limit`` of ``dataset`` (all of it when limit is 0 or larger)."""
    size = _size([dataset])
    if not limit or limit >= size:
        return dataset
    return Subset(dataset, np.sort(np.random.default_rng(seed).permutation(size)[:limit]).tolist())
