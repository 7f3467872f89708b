"""State dicts as every package passes them: the type, casts, a half-precision view for searches, and weighted
sums of states (the points of a linear path, Eq. 1), whole or one tensor at a time."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch

State = dict[str, torch.Tensor]


def cast(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> State:
    """Every tensor of ``state`` in ``dtype``, detached: float64 to search exactly, float32 to evaluate or save."""
    return {k: v.detach().to(dtype) for k, v in state.items()}


HALF = (torch.bfloat16, torch.float16)


class Widened(Mapping[str, torch.Tensor]):
    """A half-precision ``state`` read in ``dtype`` one tensor at a time, so a search over it holds no wider copy
    of the whole model."""

    def __init__(self, state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.state, self.dtype = state, dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.state[name].detach().to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


class Paged(Mapping[str, torch.Tensor]):
    """A stored ``state`` that calls ``release`` each time ``every`` bytes have been read from it: where its tensors
    are pages of a mapped file (:func:`glmc.device.release_mapped`), a search passing over the model again and again
    holds the pages of its last ``every`` bytes, not the whole model."""

    def __init__(self, state: Mapping[str, torch.Tensor], release: Callable[[], None], every: int = 1 << 28) -> None:
        self.state, self.release, self.every = state, release, every
        self._read, self._lock = 0, threading.Lock()  # layers are read side by side, on several threads

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self.state[name]
        with self._lock:
            self._read += value.nbytes
            due = self._read >= self.every
            if due:
                self._read = 0
        if due:
            self.release()
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


class Lazy(Mapping[str, torch.Tensor]):
    """A state whose tensors are made on each read by ``make(name)`` and held by no one but the reader: a canonical
    form folded, or a model moved, one tensor at a time from the stored state it reads (a billion-parameter model
    is not held twice). ``search(name, dtype)``, where given, is the tensor as a search in ``dtype`` reads it (the
    stored tensor itself where that equals the made one rounded to ``dtype``)."""

    def __init__(self, names: Iterable[str], make: Callable[[str], torch.Tensor],
                 search: Callable[[str, torch.dtype], torch.Tensor] | None = None) -> None:
        self.names, self.make = list(names), make
        self.search = search or (lambda name, dtype: make(name).to(dtype))
        self._known = frozenset(self.names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        return self.make(name)

    def __contains__(self, name: object) -> bool:
        return name in self._known

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def only(self, names: Iterable[str]) -> Lazy:
        """The same state restricted to ``names`` (in this state's order), still made on each read."""
        keep = frozenset(names)
        return Lazy([n for n in self.names if n in keep], self.make, self.search)

    def searched(self, dtype: torch.dtype) -> Lazy:
        """This state as a search in ``dtype`` reads it, tensor by tensor."""
        return Lazy(self.names, lambda name: self.search(name, dtype))


def restrict(state: Mapping[str, torch.Tensor], names: Iterable[str]) -> Mapping[str, torch.Tensor]:
    """``state``'s tensors of ``names`` (those it has), made on each read where ``state`` is :class:`Lazy`."""
    if isinstance(state, Lazy):
        return state.only(n for n in names if n in state)
    return {n: state[n] for n in names if n in state}


def search_view(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> Mapping[str, torch.Tensor]:
    """``state`` as a search in ``dtype`` reads it: made tensor by tensor where it is :class:`Lazy`, widened tensor by
    tensor where it is stored in half precision, else :func:`cast` (a copy, as exact searches in float64 need)."""
    if isinstance(state, Lazy):
        return state.searched(dtype)
    if state and all(v.dtype in HALF for v in state.values() if v.is_floating_point()):
        return Widened(state, dtype)
    return cast(state, dtype)


def _weighted(tensors: Iterable[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Σ_i w_i x_i, summed in order."""
    return sum(w * x for w, x in zip(weights, tensors, strict=True))  # type: ignore[return-value]


def mix(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> State:
    """Σ_i w_i θ_i key by key (λ θ_A + (1−λ) θ_B for two models)."""
    return {k: _weighted((s[k] for s in states), weights) for k in states[0]}


def mixture(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float],
            dtype: torch.dtype | None = None) -> Lazy:
    """:func:`mix` of the states :func:`cast` to ``dtype`` (None: as they are), bit for bit, made one tensor at a
    time on each read: a point of a path between :class:`Lazy` models is held by its reader alone, as they are."""
    def make(name: str) -> torch.Tensor:
        return _weighted((s[name] if dtype is None else s[name].detach().to(dtype) for s in states), weights)

    return Lazy(states[0], make)


def interpolate(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], lam: float) -> State:
    """λ θ_A + (1−λ) θ_B, key by key."""
    return mix((a, b), (lam, 1.0 - lam))
