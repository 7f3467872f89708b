"""Checkpoints: a model's own state dict (timm or HF key names) in safetensors, plus JSON metadata.

The header's string metadata holds one key, ``glmc``, a JSON blob with the preset, the full
``ModelConfig``, width multiplier, seed, data and split, metrics, the char vocabulary for text,
and a SHA-256 of the tensors, so a flipped byte is caught rather than silently loaded.
Files are written to a temporary sibling and renamed: never half-written.
Nothing here unpickles: safetensors holds raw tensors only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import nn

from glmc.archs import build_model
from glmc.core.config import ModelConfig
from glmc.errors import CheckpointError, ConfigError, GlmcError, first_line

META_KEY = "glmc"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint is: the model it fits, how it was trained, and how well it does."""

    preset: str
    config: ModelConfig
    width_mult: float = 1.0
    seed: int | None = None
    dataset: str = ""
    split: str = ""  # human-readable description of the data split (train/test or client partition)
    metrics: dict[str, float] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)  # the TrainConfig used, as a dict
    vocab: str | None = None  # CharVocab.to_json() for text models
    # where a model read from another format came from: {"format": "hf", "config": config.json, "path": folder} or
    # {"format": "timm", "kwargs": create_model kwargs, "path": file}; written back into that format (glmc.io.formats)
    origin: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict; ``config`` becomes ``ModelConfig.to_dict()``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)} | {"config": self.config.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CheckpointMeta:
        """Inverse of :meth:`to_dict`; unknown fields or a bad config raise CheckpointError."""
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise CheckpointError(f"unknown checkpoint metadata fields: {sorted(unknown)}")
        try:
            return cls(**{**data, "config": ModelConfig.from_dict(dict(data["config"]))})
        except (GlmcError, KeyError, TypeError) as err:
            raise CheckpointError(f"invalid checkpoint metadata: {first_line(err)}") from err


def check_out(out: Path, force: bool) -> None:
    """Fail before any work if ``--out`` is not a .safetensors path or would be overwritten."""
    if out.suffix != ".safetensors":
        raise ConfigError(f"--out must end in .safetensors, got {out}")
    if out.exists() and not force:
        raise CheckpointError(f"{out} already exists; pass --force to overwrite it")


def save_checkpoint(
    path: str | Path,
    model_or_state: nn.Module | Mapping[str, torch.Tensor],
    meta: CheckpointMeta,
    overwrite: bool = True,
) -> Path:
    """Write the native state dict and ``meta`` to ``path`` atomically; returns the path.

    With ``overwrite=False`` an existing file is a CheckpointError and stays untouched.
    """
    path = Path(path)
    if not overwrite and path.exists():
        raise CheckpointError(f"{path} already exists; refusing to overwrite it")
    state = _cpu_state(model_or_state)
    blob = json.dumps({**meta.to_dict(), "format": FORMAT_VERSION, "sha256": state_digest(state)}, sort_keys=True)
    with written_whole(path) as f:  # by us rather than save_file, which creates 0600 files: the umask's mode
        f.write(save(state, metadata={META_KEY: blob}))
    return path


@contextlib.contextmanager
def written_whole(path: Path) -> Iterator[BinaryIO]:
    """A file written beside ``path`` and moved onto it once complete and synced, so that a crash leaves the old
    file or none, never half of one; the temporary file is removed whatever happens."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}
_ENTRY_ROOM = 64 + 8 * 21 + 2 * 21  # a header entry's dtype, shape (up to 8 axes) and offsets, at most


def stream_safetensors(path: str | Path, state: Mapping[str, torch.Tensor],
                       metadata: Callable[[str], dict[str, str]], room: int = 0) -> Path:
    """Write ``state`` as a safetensors file one tensor at a time, reading each tensor once (a
    :class:`glmc.core.state.Lazy` state is made tensor by tensor and never held whole), in sorted key order;
    ``metadata(digest)`` is the header's string metadata given the tensors' :func:`state_digest`, its length
    known beforehand up to ``room`` characters. The header is written last into room reserved before the data (a
    safetensors header may end in spaces); atomically, as :func:`save_checkpoint`."""
    path = Path(path)
    names = sorted(state)
    reserved = len(json.dumps({"__metadata__": metadata("0" * 64)})) + room + sum(
        len(json.dumps(name)) + _ENTRY_ROOM for name in names)
    reserved += -reserved % 8
    h, header, offset = hashlib.sha256(), {}, 0
    with written_whole(path) as f:
        f.seek(8 + reserved)
        for name in names:
            tensor = state[name].detach().to("cpu").contiguous()
            data = tensor.reshape(-1).view(torch.uint8).numpy()
            h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            h.update(data.data)
            f.write(data.data)
            header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                            "data_offsets": [offset, offset + data.nbytes]}
            offset += data.nbytes
            del tensor, data
        text = json.dumps({"__metadata__": metadata(h.hexdigest()), **header}).encode()
        if len(text) > reserved:
            raise CheckpointError(f"{path}: the safetensors header outgrew the room reserved for it")
        f.seek(0)
        f.write(len(text + b" " * (reserved - len(text))).to_bytes(8, "little") + text
                + b" " * (reserved - len(text)))
    return path


def save_streamed(path: str | Path, state: Mapping[str, torch.Tensor], meta: CheckpointMeta) -> Path:
    """:func:`save_checkpoint` of a state read one tensor at a time (:func:`stream_safetensors`): the same file, the
    same checksum, without a copy of the model in memory."""
    def metadata(digest: str) -> dict[str, str]:
        return {META_KEY: json.dumps({**meta.to_dict(), "format": FORMAT_VERSION, "sha256": digest}, sort_keys=True)}

    return stream_safetensors(path, state, metadata)


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], CheckpointMeta]:
    """The tensors and metadata of a glmc checkpoint, verified against the stored SHA-256."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint file at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            state = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except Exception as err:  # safetensors raises several types for a bad header or truncated data
        raise CheckpointError(f"{path} is not a readable safetensors file: {first_line(err)}") from err
    if META_KEY not in header:
        raise CheckpointError(f"{path} has no {META_KEY!r} metadata; it was not written by glmc")
    blob = _parse_blob(path, header[META_KEY])
    if blob.pop("sha256", None) != state_digest(state):
        raise CheckpointError(f"{path} is corrupt: its tensors do not match the stored checksum")
    return state, CheckpointMeta.from_dict(blob)


def load_model(path: str | Path, expect: ModelConfig | None = None) -> tuple[nn.Module, CheckpointMeta]:
    """Build the checkpoint's model and load its weights (eval mode); ``expect`` must match its config."""
    state, meta = load_checkpoint(path)
    if expect is not None and expect != meta.config:
        raise CheckpointError(f"{path} does not match the requested model: {_config_diff(expect, meta.config)}")
    model = build_model(meta.config)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"{path} tensors do not fit its {meta.config.family} config: {first_line(err)}") from err
    return model.eval(), meta


def _parse_blob(path: Path, text: str) -> dict[str, Any]:
    """The metadata JSON as a dict, checked for a known format version."""
    try:
        blob = json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} has unreadable {META_KEY!r} metadata: {err}") from err
    if not isinstance(blob, dict) or blob.pop("format", None) != FORMAT_VERSION:
        raise CheckpointError(f"{path} metadata is not glmc checkpoint format {FORMAT_VERSION}")
    return blob


def _cpu_state(model_or_state: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU copies (safetensors refuses shared or strided storage)."""
    state = model_or_state.state_dict() if isinstance(model_or_state, nn.Module) else model_or_state
    return {key: value.detach().to("cpu").contiguous().clone() for key, value in state.items()}


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over names, dtypes, shapes and raw bytes, in sorted key order."""
    h = hashlib.sha256()
    for key in sorted(state):
        tensor = state[key].detach().to("cpu").contiguous()
        h.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        h.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _config_diff(expected: ModelConfig, found: ModelConfig) -> str:
    """The fields that differ, as ``name: found X, expected Y``."""
    a, b = expected.to_dict(), found.to_dict()
    return "; ".join(f"{k}: checkpoint has {b[k]!r}, expected {a[k]!r}" for k in a if a[k] != b[k])
