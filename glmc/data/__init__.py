"""Datasets and client splits: Fashion-MNIST, Shakespeare, hub vision sets, non-IID partitions.

Names are re-exported lazily (PEP 562): importing ``glmc.data.paths`` stays cheap, and
``datasets``/``flwr_datasets`` (seconds to import) load only when a loader or split is used.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "data_root": "paths",
    "ArrayDataset": "vision",
    "VisionSplits": "vision",
    "load_fashion_mnist": "fashion_mnist",
    "load_hub_vision": "hub",
    "load_hub_copy": "hub",
    "CharVocab": "shakespeare",
    "TextWindows": "shakespeare",
    "TextCorpus": "shakespeare",
    "TextPartition": "shakespeare",
    "load_shakespeare": "shakespeare",
    "BpeVocab": "bpe",
    "load_shakespeare_bpe": "bpe",
    "shakespeare_partitions": "shakespeare",
    "SplitConfig": "partition",
    "partition_indices": "partition",
    "label_counts": "partition",
    "plot_label_heatmap": "partition",
    "fetch_shakespeare": "fetch",
    "fetch_fashion_mnist": "fetch",
    "fetch_hub": "fetch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
