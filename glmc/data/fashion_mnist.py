"""Fashion-MNIST from its original IDX files (Debian's ``dataset-fashion-mnist``), hub as a fallback.

60,000 train and 10,000 test 28×28 grayscale images in 10 classes. The loader looks in an
explicit path, then ``data_root()/fashion-mnist``, then the Debian path, and only touches the
network when the caller passes ``allow_hub=True``.
"""

import gzip
import logging
from pathlib import Path

import numpy as np

from glmc.data.hub import HUB_DATASETS, download_hub_splits
from glmc.data.paths import data_root
from glmc.data.vision import VisionSplits, make_splits
from glmc.errors import DataNotFoundError

log = logging.getLogger(__name__)

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
HOW_TO_GET = (
    "install it with `apt-get install dataset-fashion-mnist`, or put the four IDX .gz files "
    "in $GLMC_DATA/fashion-mnist"
)
_NEEDED = [name for pair in FILES.values() for name in pair]
# IDX type codes (third magic byte) → numpy dtypes; multi-byte values are big-endian.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """Parse one gzipped IDX file: magic ``00 00 type ndim``, ndim big-endian uint32 dims, data."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataNotFoundError(f"{path} is not an IDX file (bad magic {raw[:4].hex()})")
    ndim = raw[3]
    dims = np.frombuffer(raw, dtype=">u4", count=ndim, offset=4)
    data = np.frombuffer(raw, dtype=_IDX_DTYPES[raw[2]], offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise DataNotFoundError(f"{path} is truncated: {data.size} values for shape {tuple(dims)}")
    return data.reshape(tuple(int(d) for d in dims)).astype(data.dtype.newbyteorder("="))


def find_fashion_mnist(path: str | Path | None = None) -> Path | None:
    """The first directory holding all four IDX files: ``path`` alone when given (a copy the caller named is never
    silently replaced by another), else the data root, then Debian's."""
    candidates = [Path(path)] if path is not None else [data_root() / "fashion-mnist", DEBIAN_DIR]
    for directory in candidates:
        if all((directory / name).is_file() for name in _NEEDED):
            return directory
    return None


def load_fashion_mnist(path: str | Path | None = None, allow_hub: bool = False) -> VisionSplits:
    """Fashion-MNIST as normalised (N, 1, 28, 28) tensors; hub download only if ``allow_hub``."""
    directory = find_fashion_mnist(path)
    if directory is None:
        if path is not None:
            raise DataNotFoundError(f"Fashion-MNIST not found in {path} (needs {', '.join(sorted(_NEEDED))}); "
                                    f"{HOW_TO_GET}")
        if not allow_hub:
            raise DataNotFoundError(f"Fashion-MNIST not found locally; {HOW_TO_GET}")
        return download_hub_splits(HUB_DATASETS["fashion-mnist"], HOW_TO_GET)
    log.info("loading Fashion-MNIST from %s", directory)
    arrays = {
        split: (read_idx(directory / images), read_idx(directory / labels))
        for split, (images, labels) in FILES.items()
    }
    for split, (x, y) in arrays.items():
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise DataNotFoundError(
                f"Fashion-MNIST {split} files in {directory} disagree: {x.shape}, {y.shape}"
            )
    return make_splits(arrays["train"], arrays["test"], num_classes=10, name="fashion-mnist")
