"""Pairwise alignment front-end: bring checkpoint B next to A by a named method, in canonical form.

``none`` leaves both models as trained (the vanilla baseline); every other method folds LayerNorms
first and returns B transformed by an exact symmetry, so it computes the same function
(except ``soft``, whose doubly stochastic mixing only approximates B: paper App. D).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar, overload

import torch
from torch.utils.data import Dataset

from glmc.archs import get_arch
from glmc.core.config import ModelConfig
from glmc.core.spec import check_same_shapes
from glmc.core.state import Lazy, Paged, State, cast
from glmc.device import file_pages, release_heap, to_device
from glmc.errors import ConfigError
from glmc.match.balance import balance, balances, nearer
from glmc.match.common import MatchResult, sq_difference, sq_norm
from glmc.match.options import MatchOptions
from glmc.match.registry import get_method
from glmc.symmetry.canonical import CENTRED, canonical_view, canonicalize
from glmc.symmetry.transforms import Transform, apply, compose, invert, moved

S = TypeVar("S", State, State | Lazy)
# ‖A − T(B)‖² at or below this share of ‖A‖² (1e-4 of ‖A‖): B is A's transformed copy, found; no second search.
RECOVERED = 1e-8


def recovered_share(*natives: Mapping[str, torch.Tensor]) -> float:
    """The share of ‖A‖² under which B counts as A's transformed copy: :data:`RECOVERED`, or where the inputs are
    stored coarser, what rounding a copy to that precision leaves on average (u²/3 an entry, u its unit roundoff:
    5.1e-6 for bfloat16), since no search can land a rounded copy nearer than its own rounding."""
    eps = max(torch.finfo(t.dtype).eps for s in natives for t in s.values() if t.is_floating_point())
    return max(RECOVERED, (eps / 2) ** 2 / 3)


@dataclass
class Alignment(Generic[S]):
    """Canonical A, aligned canonical B (each made tensor by tensor on each read where aligned ``lazy``), and how B
    was moved."""

    a: S
    b: S
    method: str
    result: MatchResult


@overload
def align_pair(
    native_a: Mapping[str, torch.Tensor], native_b: Mapping[str, torch.Tensor], cfg: ModelConfig, method: str,
    options: MatchOptions | None = None, *, data: Dataset | None = None, dtype: torch.dtype | None = torch.float64,
    device: str | torch.device | None = None, lazy: Literal[False] = False,
) -> Alignment[State]: ...


@overload
def align_pair(
    native_a: Mapping[str, torch.Tensor], native_b: Mapping[str, torch.Tensor], cfg: ModelConfig, method: str,
    options: MatchOptions | None = None, *, data: Dataset | None = None, dtype: torch.dtype | None = torch.float64,
    device: str | torch.device | None = None, lazy: bool,
) -> Alignment[State | Lazy]: ...


def align_pair(
    native_a: Mapping[str, torch.Tensor], native_b: Mapping[str, torch.Tensor], cfg: ModelConfig, method: str,
    options: MatchOptions | None = None, *, data: Dataset | None = None, dtype: torch.dtype | None = torch.float64,
    device: str | torch.device | None = None, lazy: bool = False,
) -> Alignment[State] | Alignment[State | Lazy]:
    """Align native state dict B to A (same config) by ``method`` with ``options`` (:class:`MatchOptions`: the form,
    and the options of each method; the method reads the sections its registry entry names).

    Data-driven methods read ``data``, a dataset of (input, target) pairs from a split the barrier is not
    measured on; activation matching uses its first ``options.activation.batch`` inputs, the learned methods all of
    it (holding out a validation share). ``dual`` returns B moved by π_A⁻¹ ∘ π_B, A in place. In the circuit form the
    states stay standard (aligned as such) and the learned methods learn the circuit path.
    ``device`` is where the work happens and the aligned states stay (None: where the inputs are).
    ``dtype``: what the canonical states are held in; None keeps each input's own precision, so a bfloat16 pair is
    searched tensor by tensor in float32 and never held wider (data-free methods only: the others run the models).
    ``lazy`` (data-free methods): the canonical states and the moved B are :class:`glmc.core.state.Lazy`, each tensor
    made bit for bit as here on each read from the natives, so no canonical copy of either model is held whole (for
    a caller that reads each tensor once or twice, as ``glmc align`` writing B).
    """
    options = options or MatchOptions()
    entry, form = get_method(method), options.form
    if dtype is None and entry.reads_data:
        raise ConfigError(f"method {method!r} runs the models: align it in float32 or float64, not as stored")
    if entry.reads_data and data is None:
        raise ConfigError(f"method {method!r} needs data: pass a batch of inputs (--data)")
    arch = get_arch(cfg.family)
    check_same_shapes(native_a, native_b)
    native_a, native_b = to_device(native_a, device), to_device(native_b, device)
    a: State | Lazy
    b: State | Lazy
    if not entry.matches and form not in CENTRED:  # the models' own parameters: LayerNorm folding is bilinear
        a, b = (arch.to_canonical(s if dtype is None else cast(s, dtype), cfg) for s in (native_a, native_b))
        return Alignment(a, b, method, MatchResult(Transform(cfg.depth)))
    lazy = lazy and not entry.reads_data
    if lazy:  # the inputs' mapped pages handed back as the search passes over them: made again from the page cache
        native_a, native_b = (Paged(s, file_pages(s)) for s in (native_a, native_b))
    a, b = ((canonical_view if lazy else canonicalize)(arch, s, cfg, form, dtype) for s in (native_a, native_b))
    if not entry.matches:
        return Alignment(a, b, method, MatchResult(Transform(cfg.depth)))
    # a data-free matcher reads its states by name alone, as a Lazy state is read (tests/test_lazy.py)
    result = match_pair(method, typing.cast(State, a), typing.cast(State, b), cfg, data, options,
                        recovered=recovered_share(native_a, native_b))
    return Alignment(a, (moved if lazy else apply)(b, arch.spec, result.transform, cfg.heads), method, result)


def match_pair(method: str, a: State, b: State, cfg: ModelConfig, data: Dataset | None,
               options: MatchOptions, balanced_a: tuple[State, Transform] | None = None,
               recovered: float = RECOVERED) -> MatchResult:
    """The transform that brings canonical B next to A by ``method``: over the whole declared group where the method
    searches it (:func:`glmc.match.balance.balances`), else over what the method searches.

    Over the whole group, both models are balanced (:mod:`glmc.match.balance`), the balanced pair matched, and B's
    map is D_A⁻¹ ∘ T ∘ D_B. A data-driven method stops there, once. A data-free method then keeps each head's and
    unit's maps or replaces them by the orthogonal choice, whichever is nearer A (:func:`glmc.match.balance.nearer`),
    searches the models as given too, and keeps the nearer end: the descent is not convex, and seeds trained apart
    can sit nearer in their own frames (on the official GLMC pair, 0.9212 against 0.9231 of ‖A‖). A planted
    transform is found only from the balanced pair; where that lands B on A (within ``recovered`` of ‖A‖²:
    :func:`recovered_share`), the second search is skipped; where the search's own objective says so
    (:func:`_landed`), neither the orthogonal choice nor the distances are computed. States made on each read
    (:class:`glmc.core.state.Lazy`) stay so: nothing here holds a model whole.
    ``balanced_a`` is A's :func:`balance`, given where one A is matched to many models (universe matching)."""
    entry = get_method(method)
    if not balances(method, options):
        return entry.match()(a, b, cfg, data, options)
    (a_bal, d_a), (b_bal, d_b) = balanced_a or balance(a, cfg), balance(b, cfg)
    found = entry.match()(a_bal, b_bal, cfg, data, options)
    back = compose(compose(invert(d_a), found.transform), d_b)
    # data: its maps serve its own objective, not the distance
    if entry.reads_data or _landed(found, a_bal, options, recovered):
        return dataclasses.replace(found, transform=back)
    release_heap()  # the search's freed blocks, before the distances make each model's tensors in float64
    whole = dataclasses.replace(found, transform=nearer(a, b, back, cfg))
    left = _distance(a, b, whole.transform, cfg)
    if left <= recovered * sum(sq_norm(a[name]) for name in a):
        return whole  # B recovered to within its inputs' rounding: nothing can be nearer
    plain = entry.match()(a, b, cfg, data, options)
    return plain if _distance(a, b, plain.transform, cfg) < left else whole


def _landed(found: MatchResult, a: State, options: MatchOptions, recovered: float) -> bool:
    """Whether the search's last objective, ‖A − T(B)‖² between the states it searched, is within ``recovered``
    of ‖A‖² (A read as the search reads it: no float64 copy of a vocabulary), for a transform that the objective
    describes (the path's v/o maps replace the searched ones after it). Its float32 products resolve about 1e-7 of
    ‖A‖², so this certifies a float32 B within about 3e-4 of ‖A‖ from A's transformed copy, and costs one read of A
    where the distances of :func:`match_pair` move both models twice in float64."""
    if not found.objective or options.weight.ov_maps != "orthogonal":
        return False
    searched = a.searched(torch.float32) if isinstance(a, Lazy) else a
    return found.objective[-1] <= recovered * sum(sq_norm(searched[name]) for name in searched)


def _distance(a: State, b: State, t: Transform, cfg: ModelConfig) -> float:
    """‖A − T(B)‖², B moved one tensor at a time (:func:`sq_difference`: no difference as large as a vocabulary)."""
    view = moved(b, get_arch(cfg.family).spec, t, cfg.heads)
    return sum(sq_difference(a[name], view[name]) for name in a)
