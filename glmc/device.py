"""Where glmc computes: device names (``auto`` means CUDA when there is one), mixed precision, GPU memory.

The library follows its tensors: a state on a device is matched, merged and evaluated there, and the models
built along the way are put beside it. Only the entry points (the CLI, the Python API, the Flower apps) choose a
device, with :func:`resolve`; on a machine without a GPU the default stays the CPU, bit-reproducible as before.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Literal

import torch

from glmc.errors import ConfigError

Precision = Literal["fp32", "bf16"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16")
DEVICE_HELP = "auto (CUDA when there is one), cpu, cuda or cuda:N"  # glmc.cli words its own, without torch


def check_name(device: str | torch.device | None) -> str:
    """The device name, lower-cased, if it is one glmc knows (auto, cpu, cuda, cuda:N), whatever this machine has:
    a run config is read on machines with and without GPUs alike. ConfigError (one line) otherwise."""
    name = str(device) if isinstance(device, torch.device) else (device or "auto").strip().lower()
    if name == "auto":
        return name
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(f"unknown device {name!r}; use {DEVICE_HELP}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"unsupported device {name!r}; use {DEVICE_HELP}")
    return name


def resolve(device: str | torch.device | None = "auto") -> torch.device:
    """The torch device a name means; ConfigError (one line) for an unknown name or a GPU this machine lacks."""
    name = check_name(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cpu":
        return dev
    if not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for, but torch sees no CUDA GPU on this machine (use cpu or auto)")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"device {name!r} asked for, but this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return dev


def device_of(state: Mapping[str, torch.Tensor]) -> torch.device:
    """The device a state lives on (its first tensor's): where the work on it happens."""
    return next(iter(state.values())).device


def to_device(state: Mapping[str, torch.Tensor], device: str | torch.device | None) -> dict[str, torch.Tensor]:
    """The state on ``device`` (None: left where it is); tensors already there are not copied."""
    if device is None:
        return dict(state)
    dev = resolve(device)
    return {k: v.to(dev) for k, v in state.items()}


def check_precision(precision: str) -> Precision:
    """The precision name, or ConfigError naming the allowed ones."""
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")
    return precision  # type: ignore[return-value]


def autocast(device: torch.device, precision: str = "fp32") -> contextlib.AbstractContextManager[object]:
    """bf16 autocast on ``device`` for ``precision='bf16'``; a no-op context for fp32 (the default, exact)."""
    if check_precision(precision) == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def reset_peak_memory(device: torch.device) -> None:
    """Start counting peak GPU memory afresh (nothing on a CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated by torch on ``device`` since the last reset, in MiB (0 on a CPU)."""
    if device.type != "cuda":
        return 0.0
    return torch.cuda.max_memory_allocated(device) / 2**20


@contextlib.contextmanager
def released(device: torch.device) -> Iterator[None]:
    """Give cached GPU blocks back to the driver on leaving, so an idle process holds no memory it does not use."""
    try:
        yield
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def release_heap() -> None:
    """Hand the heap that freed tensors left back to the system (glibc's ``malloc_trim``; elsewhere nothing): a
    matching's many per-layer temporaries leave holes that the next phase, writing a model tensor by tensor, cannot
    reuse, and the process would otherwise grow by them."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


MADV_DONTNEED = 4  # Linux's madvise advice: drop these pages from the process (a file's are read again on use)


def file_pages(state: Mapping[str, torch.Tensor]) -> Callable[[], None]:
    """A call that drops from this process the pages of the files ``state``'s tensors are mapped from (safetensors
    maps a checkpoint, and its tensors are read in place), so that passes over a model do not leave all of it
    resident: the kernel keeps the pages in its page cache and a later read faults them back unchanged. Only files
    mapped without a written page count (dropping a copied-on-write page would undo the write), and ``state`` keeps
    their mappings alive; glmc writes no stored input. Linux only: elsewhere, and for tensors in memory, it does
    nothing."""
    import ctypes

    starts = sorted(t.untyped_storage().data_ptr() for t in state.values() if t.device.type == "cpu")
    try:
        libc, mapped = ctypes.CDLL("libc.so.6"), _clean_file_mappings()
    except OSError:
        return lambda: None
    ranges = [(start, end) for start, end in mapped
              if (i := bisect.bisect_left(starts, start)) < len(starts) and starts[i] < end]

    def release() -> None:
        for start, end in ranges:
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)

    return release


def _clean_file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of files without a written page (/proc/self/smaps: no anonymous,
    copied-on-write, memory in them)."""
    clean, current = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line: start-end perms offset dev inode [path]
                start, end = (int(x, 16) for x in head[0].split("-"))
                current = (start, end) if len(head) > 5 and head[5].startswith("/") else None
            elif current is not None and head[0] == "Anonymous:":
                if int(head[1]) == 0:
                    clean.append(current)
                current = None
    return clean


def available_memory() -> int | None:
    """Bytes of memory the system can give now without swapping (Linux's MemAvailable); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
