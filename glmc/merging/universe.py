"""Universe matching (paper §4.3, after C2M3): align many models into one basin and merge them.

U ← a chosen model (or the previous global model). Repeat: align every model to U by a pairwise method (the N
alignments of an iteration run in a process pool), then set U to the least-squares coverage-weighted mean of
the aligned models (:func:`glmc.merging.widths.lstsq_merge`, the weighted mean at equal widths). Stop when U, or the
mean distance to it, changes by less than ``tol`` (relative), or after ``max_iters``. The result approximately
minimises the multi-model barrier of Eq. 2. Models narrower than the universe are embedded exactly first
(:mod:`glmc.merging.widths`). Models given as :class:`glmc.core.state.Lazy` states (canonical forms made on each
read) stay lazy: each iteration moves them on each read, so only U is held whole.

A method that does not match (``none``) skips alignment: one least-squares merge, i.e. FedAvg at equal widths and
HeteroFL with coordinate placements, through the same code path. A method that refines (``learned``) runs its
merge pairwise method's iterations, then the multi-model learned refinement (mixing weights ~ Dirichlet(c·N·ŵ),
``glmc.match.dual.refine_universe``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch
from torch.utils.data import Dataset, TensorDataset

from glmc.archs import get_arch
from glmc.core.config import ModelConfig
from glmc.core.spec import SpecTable
from glmc.core.state import Lazy, State
from glmc.device import device_of, to_device
from glmc.errors import ConfigError, check_weights
from glmc.match.align import match_pair
from glmc.match.balance import balance, balances
from glmc.match.common import MatchResult, sq_distance
from glmc.match.dual import refine_universe
from glmc.match.learned import PLAIN, Scoring, View
from glmc.match.options import MatchOptions
from glmc.match.registry import get_method
from glmc.merging.options import MergeOptions
from glmc.merging.widths import Placement, embed, lstsq_merge, move, place, project, widen
from glmc.symmetry.transforms import Transform, apply, compose, maps_to, moved

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Member:
    """One model of a merge: its state (native for :func:`glmc.merging.merge.merge_models`, canonical and standard
    for :func:`universe_match`), its own config (the universe's, or narrower), its weight (an example count) and,
    when narrow, where it sits in the universe before matching (None: :func:`glmc.merging.widths.place`)."""

    state: State
    config: ModelConfig
    weight: float = 1.0
    placement: Placement | None = None


def members(states: Sequence[State], configs: Sequence[ModelConfig],
            weights: Sequence[float] | None = None) -> list[Member]:
    """Models of a merge from their states, configs and weights (None: equal), with no start placements."""
    weights = check_weights([1.0] * len(states) if weights is None else weights, len(states))
    return [Member(s, c, w) for s, c, w in zip(states, configs, weights, strict=True)]


@dataclass
class IterationRecord:
    """One universe iteration: how far the aligned models sit from the U they were aligned to, and the cost."""

    iteration: int
    mean_distance: float  # mean_i ‖T_i(θ_i) − U‖ / ‖U‖
    change: float  # ‖U_new − U‖ / ‖U‖
    align_seconds: float
    merge_seconds: float
    method: str = ""


@dataclass
class UniverseResult:
    """Every model moved into the universe, where each one sits, how it was moved, and the merged model U."""

    aligned: list[State]
    placements: list[Placement]
    transforms: list[Transform]
    merged: State
    history: list[IterationRecord] = field(default_factory=list)
    anchor: State | None = None  # what fills the coordinates no model covers (lstsq_merge)

    @property
    def seconds(self) -> float:
        return sum(r.align_seconds + r.merge_seconds for r in self.history)

    def history_dicts(self) -> list[dict[str, float]]:
        return [asdict(r) for r in self.history]


@dataclass(frozen=True)
class _Job:
    """What one pairwise alignment needs; picklable, so it can run in a worker process."""

    method: str
    cfg: ModelConfig
    data: Dataset | None
    options: MatchOptions  # the pairwise matcher's (standard form)


def _align_one(job: _Job, anchor: State, state: State, balanced: tuple[State, Transform] | None) -> MatchResult:
    """The transform that brings ``state`` next to ``anchor`` (both canonical, standard form, width of cfg), by the
    registry's pairwise function of ``job.method``; ``balanced`` is the anchor's balancing, made once per iteration."""
    return match_pair(job.method, anchor, state, job.cfg, job.data, job.options, balanced)


_SHARED: dict[str, Any] = {}  # a worker's copy of one iteration's job, anchor and states


def _share(job: _Job, anchor: State, states: list[State], balanced: tuple[State, Transform] | None) -> None:
    """Pool initializer: keep the iteration's inputs; one torch thread, the pool supplies the parallelism."""
    torch.set_num_threads(1)
    _SHARED.update(job=job, anchor=anchor, states=states, balanced=balanced)


def _align_shared(index: int) -> MatchResult:
    return _align_one(_SHARED["job"], _SHARED["anchor"], _SHARED["states"][index], _SHARED["balanced"])


# On a GPU, an iteration's weight matchings of models up to this many parameters run on the CPU, in the process
# pool when there is one: on the H200 a gpt2-bench pair (0.83M parameters) matched in 1.08 s against 1.21 s on one
# CPU thread, so the GPU bought nothing, and on it the matchings run one after another. Larger models stay on the
# GPU (a GPT-2-small pair: 3.2 s there). Not yet measured with this rule on a GPU.
HOST_MATCH_MAX_PARAMS = 1_000_000


def matching_device(method: str, anchor: State) -> torch.device:
    """Where an iteration's pairwise matchings run: where the anchor lives, or the CPU for a small model when the
    method matches small models there (:data:`HOST_MATCH_MAX_PARAMS`)."""
    device = device_of(anchor)
    small = sum(x.numel() for x in anchor.values()) <= HOST_MATCH_MAX_PARAMS
    on_host = device.type != "cpu" and get_method(method).host_when_small and small
    return torch.device("cpu") if on_host else device


def _align_all(job: _Job, anchor: State, states: Sequence[State], workers: int) -> list[MatchResult]:
    """Align every state to the anchor: N independent pairwise problems, in a process pool when workers > 1.

    The pool lives for one iteration, so its inputs reach each worker once rather than once per task: forked
    where the platform can (as torch's DataLoader does: nothing is copied or re-imported), spawned elsewhere.
    Small models on a GPU are matched on the CPU (:func:`matching_device`), their maps handed back on the GPU.
    """
    device, where = device_of(anchor), matching_device(job.method, anchor)
    if where != device:
        found = _align_all(job, to_device(anchor, where), [to_device(s, where) for s in states], workers)
        return [dataclasses.replace(m, transform=maps_to(m.transform, device)) for m in found]
    balanced = balance(anchor, job.cfg) if balances(job.method, job.options) else None
    if workers <= 1 or device_of(anchor).type != "cpu":  # a forked child cannot use its parent's CUDA context
        return [_align_one(job, anchor, s, balanced) for s in states]
    start_method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(min(workers, len(states)), mp_context=multiprocessing.get_context(start_method),
                             initializer=_share, initargs=(job, anchor, list(states), balanced)) as pool:
        return list(pool.map(_align_shared, range(len(states))))


def _relative(a: State, b: State) -> float:
    """‖a − b‖ / ‖b‖ over every parameter."""
    return (sq_distance(a, b) / max(_sq_norm(b), 1e-300)) ** 0.5


def _sq_norm(state: Mapping[str, torch.Tensor]) -> float:
    """‖θ‖² summed as :func:`glmc.match.common.sq_distance` sums ‖θ − 0‖², bit for bit, with no zero model made."""
    return float(sum((v ** 2).sum() for v in state.values()))


def _small_dataset(data: Dataset | None, n: int | None) -> Dataset | None:
    """The first ``n`` (input, target) pairs as one small TensorDataset, cheap to send to worker processes."""
    if data is None:
        return None
    count = len(data) if n is None else min(n, len(data))  # type: ignore[arg-type]
    pairs = [data[i] for i in range(count)]
    return TensorDataset(torch.stack([p[0] for p in pairs]), torch.stack([torch.as_tensor(p[1]) for p in pairs]))


def _into_universe(members: Sequence[Member], cfg: ModelConfig, fill: str) -> tuple[list[State], list[Placement]]:
    """Embed every member's state into the universe config (exact) at its start placement (default: :func:`place`),
    its heads and units widened to the universe's first when ``fill`` is ``copies``."""
    states, configs = [m.state for m in members], [m.config for m in members]
    starts = [m.placement for m in members]
    if fill == "copies":
        if any(p is not None for p in starts):
            raise ConfigError("start placements place a narrow model's own heads and units; with fill 'copies' "
                              "it has the universe's")
        widened = [widen(s, c, cfg) if c != cfg else (s, c) for s, c in zip(states, configs, strict=True)]
        states, configs = [s for s, _ in widened], [c for _, c in widened]
    for i, (c, p) in enumerate(zip(configs, starts, strict=True)):
        if p is not None and (p.narrow != c or p.wide != cfg):
            raise ConfigError(f"model {i}: its start placement is for a {p.narrow.width}-wide model in a "
                              f"{p.wide.width}-wide universe, not {c.width} in {cfg.width}")
    placements = [place(c, cfg) if p is None else p for c, p in zip(configs, starts, strict=True)]
    return [embed(s, p) if p.narrow != cfg else _held(s) for s, p in zip(states, placements, strict=True)], placements


def _held(state: State) -> State:
    """A state of the universe's width as the universe holds it: a :class:`Lazy` one stays made on each read (no
    model is held whole), a stored one is the universe's own shallow copy."""
    return state if isinstance(state, Lazy) else dict(state)


def _moved(state: State, spec: SpecTable, t: Transform, heads: int) -> State:
    """θ → T(θ), bit for bit either way: a :class:`Lazy` state moved on each read (:func:`moved`; read by name as a
    State is), a stored one whole (:func:`apply`), so a merge of lazy inputs holds none of its aligned models whole."""
    return cast(State, moved(state, spec, t, heads)) if isinstance(state, Lazy) else apply(state, spec, t, heads)


def universe_match(members: Sequence[Member], cfg: ModelConfig, options: MergeOptions | None = None, *,
                   anchor: State | None = None, reference: int = 0, data: Dataset | None = None,
                   pairwise: bool = False, refine: bool = True) -> UniverseResult:
    """Align N canonical standard-form models into one universe of config ``cfg`` and merge them (paper §4.3).

    ``options`` (:class:`glmc.merging.options.MergeOptions`): the method, whose merge pairwise matching each iteration
    runs, finished by the learned refinement where the method refines (``pairwise``: the method's own pairwise
    matching instead, and no refinement; ``refine`` False: the matching alone, for a caller that judges it before
    :func:`refine_merge`), the matchers' options, the iterations (it stops after ``max_iters`` or once
    U moves, or the mean distance to U falls, by less than ``tol``, relative), the workers (> 1: each iteration's
    alignments in a process pool) and how narrow models fill the universe. ``anchor`` is the first U (default: model
    ``reference``); ``data`` feeds the data-driven methods (activation: its first inputs; learned: all of it) and the
    refinement.
    """
    if len(members) == 0:
        raise ConfigError("universe matching needs at least one model")
    options = options or MergeOptions()
    entry = get_method(options.method)
    method = options.method if pairwise else entry.merge_pairwise
    assert method is not None  # MergeOptions admits merge methods only
    weights = check_weights([m.weight for m in members], len(members))
    aligned, placements = _into_universe(members, cfg, options.fill)
    transforms = [Transform.identity(cfg.depth) for _ in aligned]
    if not get_method(method).matches:
        start = time.perf_counter()
        merged = lstsq_merge(aligned, placements, weights, anchor)
        record = IterationRecord(0, _mean_distance(aligned, merged), 0.0, 0.0, time.perf_counter() - start, method)
        return UniverseResult(aligned, placements, transforms, merged, [record], anchor)
    match = dataclasses.replace(options.match, form="standard")
    universe = dict(anchor) if anchor is not None else aligned[reference]
    if options.workers > 1:  # workers get a small materialised copy, not a pickled view of the whole dataset
        data = _small_dataset(data, match.activation.batch if get_method(method).reads_sample else None)
    job = _Job(method, cfg, data, match)
    result = UniverseResult(aligned, placements, transforms, universe, anchor=anchor)
    for iteration in range(1, options.max_iters + 1):
        _iterate(result, job, options.workers, iteration, weights)
        if _converged(result.history, options.tol):
            break
    if refine and not pairwise and entry.refines:
        refine_merge(result, options, data, weights, reference)
    return result


def _converged(history: Sequence[IterationRecord], tol: float) -> bool:
    """U stopped moving, or the mean distance to U (the objective) stopped falling.

    The second test ignores a slow drift of U along the symmetry group itself, which changes no distance. It
    needs three iterations: the first U is a single model, so distances compare from the second mean on.
    """
    if history[-1].change < tol:
        return True
    if len(history) < 3:
        return False
    before, after = history[-2].mean_distance, history[-1].mean_distance
    return before - after <= tol * before


def _mean_distance(states: Sequence[State], universe: State) -> float:
    return sum(_relative(s, universe) for s in states) / len(states)


def _remerge(result: UniverseResult, weights: Sequence[float] | None) -> tuple[float, float]:
    """U ← the least-squares mean of the aligned models (:func:`lstsq_merge`), made tensor by tensor, each tensor of
    the old U dropped as its successor is made (one U held, not two; every aligned tensor made once); and, as
    :func:`_mean_distance` and :func:`_relative` sum them, the aligned models' mean distance to the old U and how far
    U moved, both relative to the old U."""
    old, aligned, new = result.merged, result.aligned, {}
    norm = max(_sq_norm(old), 1e-300)
    apart: list[Any] = [0] * len(aligned)  # ‖T_i(θ_i) − U‖², summed in U's order (sq_distance's, from 0)
    moved_by: Any = 0
    for name in aligned[0]:  # lstsq_merge's order, and the moved models' that sq_distance sums in
        tensors = [a[name] for a in aligned]
        fill = {name: result.anchor[name]} if result.anchor is not None else None
        new[name] = lstsq_merge([{name: t} for t in tensors], result.placements, weights, fill)[name]
        before = old.pop(name) if isinstance(old, dict) else old[name]  # a lazy first U holds nothing to drop
        apart = [d + ((t - before) ** 2).sum() for d, t in zip(apart, tensors, strict=True)]
        moved_by = moved_by + ((new[name] - before) ** 2).sum()
    result.merged = new
    return sum((float(d) / norm) ** 0.5 for d in apart) / len(aligned), (float(moved_by) / norm) ** 0.5


def _iterate(result: UniverseResult, job: _Job, workers: int, iteration: int,
             weights: Sequence[float] | None) -> IterationRecord:
    """One step: align every model to U, move them (and their placements), then U ← least-squares mean."""
    start = time.perf_counter()
    matches = _align_all(job, result.merged, result.aligned, workers)
    return _move_and_merge(result, job, [m.transform for m in matches], weights, iteration, start)


def refine_merge(result: UniverseResult, options: MergeOptions, data: Dataset | None,
                 weights: Sequence[float] | None = None, reference: int = 0) -> IterationRecord | None:
    """Multi-model learned refinement of the aligned models (paper §4.3), then U ← least-squares mean; None for one
    model, whose merge is itself. Across widths the narrow models keep their places: moving one moves its coverage,
    by which that mean divides; the full-width models, which cover everything wherever they move, learn theirs."""
    if len(result.aligned) < 2:
        return None
    if data is None:
        raise ConfigError("learned refinement needs data: pass training samples")
    start = time.perf_counter()
    cfg = result.placements[0].wide
    job = _Job("refine", cfg, data, dataclasses.replace(options.match, form="standard"))
    narrow = [i for i, p in enumerate(result.placements) if p.narrow != p.wide]
    transforms = refine_universe(result.aligned, cfg, data, weights, reference=reference, options=job.options.learn,
                                 still=narrow, scoring=_scoring(result, job, weights, narrow))
    return _move_and_merge(result, job, transforms, weights, len(result.history) + 1, start)


def _scoring(result: UniverseResult, job: _Job, weights: Sequence[float] | None, narrow: Sequence[int]) -> Scoring:
    """What the refinement scores across widths: the least-squares mean U is (Σ_i w_i T_i(θ_i) would shrink every
    coordinate by the zeros of the narrow models that lack it), as itself or (``views="members"``) as each model gets
    it, a narrow one its slice at its place (``narrow``: those models), weighted as the models are."""
    placements, anchor = list(result.placements), result.anchor
    if not narrow:
        return PLAIN
    def merge(states: Sequence[State], w: Sequence[float]) -> State:
        return lstsq_merge(states, placements, w, anchor)

    if job.options.learn.views == "merge":
        return Scoring(merge)
    share = check_weights(weights or [1.0] * len(placements), len(placements))
    share = [x / sum(share) for x in share]
    whole = sum(x for x, p in zip(share, placements, strict=True) if p.narrow == p.wide)
    views = [View(p.narrow, x, functools.partial(project, p=p))
             for x, p in zip(share, placements, strict=True) if p.narrow != p.wide]
    return Scoring(merge, tuple([View(weight=whole)] * bool(whole) + views))


def _move_and_merge(result: UniverseResult, job: _Job, moves: Sequence[Transform], weights: Sequence[float] | None,
                    iteration: int, start: float) -> IterationRecord:
    """Apply each model's new transform (and move its placement), then merge by least squares and record it."""
    spec, heads = get_arch(job.cfg.family).spec, job.cfg.heads
    for i, t in enumerate(moves):
        result.aligned[i] = _moved(result.aligned[i], spec, t, heads)
        result.placements[i] = move(result.placements[i], t)
        result.transforms[i] = compose(t, result.transforms[i])
    aligned_at = time.perf_counter()
    distance, change = _remerge(result, weights)
    record = IterationRecord(iteration, distance, change, aligned_at - start, time.perf_counter() - aligned_at,
                             job.method)
    result.history.append(record)
    log.info("universe iteration %d (%s): mean distance to U %.4f, U moved %.2e; align %.2f s, merge %.2f s",
             iteration, job.method, record.mean_distance, record.change, record.align_seconds, record.merge_seconds)
    return record
