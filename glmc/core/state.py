"""State dicts as every package passes them: the type, casts, a half-precision view for searches, and weighted
sums of states (the points of a linear path, Eq. 1)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

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


def search_view(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> Mapping[str, torch.Tensor]:
    """``state`` as a search in ``dtype`` reads it: widened tensor by tensor where it is stored in half precision,
    else :func:`cast` (a copy, as exact searches in float64 need)."""
    if state and all(v.dtype in HALF for v in state.values() if v.is_floating_point()):
        return Widened(state, dtype)
    return cast(state, dtype)


def mix(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> State:
    """Σ_i w_i θ_i key by key (λ θ_A + (1−λ) θ_B for two models)."""
    return {k: sum(w * s[k] for w, s in zip(weights, states, strict=True)) for k in states[0]}  # type: ignore[misc]


def interpolate(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], lam: float) -> State:
    """λ θ_A + (1−λ) θ_B, key by key."""
    return mix((a, b), (lam, 1.0 - lam))
