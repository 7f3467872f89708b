"""Universe matching (paper §4.3, after C2M3): align many models into one basin and merge them.

U ← a chosen model (or the previous global model). Repeat: align every model to U by a pairwise method (the N
alignments of an iteration run in a process pool), then set U to the least-squares coverage-weighted mean of
the aligned models (:func:`glmc.merging.widths.lstsq_merge`, the weighted mean at equal widths). Stop when U, or the
mean distance to it, changes by less than ``tol`` (relative), or after ``max_iters``. The result approximately
minimises the multi-model barrier of Eq. 2. Models narrower than the universe are embedded exactly first
(:mod:`glmc.merging.widths`).

``method="none"`` skips alignment: one least-squares merge, i.e. FedAvg at equal widths and HeteroFL with
coordinate placements, through the same code path. ``refine=True`` finishes with the multi-model learned
refinement (mixing weights ~ Dirichlet(c·N·ŵ), ``glmc.match.dual.refine_universe``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset, TensorDataset

from glmc.archs import get_arch
from glmc.core.config import ModelConfig
from glmc.core.state import State
from glmc.device import device_of, to_device
from glmc.errors import ConfigError, check_options, check_weights
from glmc.match.common import MatchResult, sq_distance
from glmc.match.options import MatchOptions
from glmc.match.registry import get_method
from glmc.match.weight import DEFAULT_START, Start, WeightOptions
from glmc.merging.widths import FILLS, Placement, embed, lstsq_merge, move, place, widen
from glmc.symmetry.transforms import Transform, apply, compose, maps_to

if TYPE_CHECKING:
    from glmc.match.learned import LearnConfig

log = logging.getLogger(__name__)


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


def _align_one(job: _Job, anchor: State, state: State) -> MatchResult:
    """The transform that brings ``state`` next to ``anchor`` (both canonical, standard form, width of cfg), by the
    registry's pairwise function of ``job.method``."""
    return get_method(job.method).match()(anchor, state, job.cfg, job.data, job.options)


_SHARED: dict[str, Any] = {}  # a worker's copy of one iteration's job, anchor and states


def _share(job: _Job, anchor: State, states: list[State]) -> None:
    """Pool initializer: keep the iteration's inputs; one torch thread, the pool supplies the parallelism."""
    torch.set_num_threads(1)
    _SHARED.update(job=job, anchor=anchor, states=states)


def _align_shared(index: int) -> MatchResult:
    return _align_one(_SHARED["job"], _SHARED["anchor"], _SHARED["states"][index])


# On a GPU, an iteration's weight matchings of models up to this many parameters run on the CPU, in the process
# pool when there is one: on the H200 a gpt2-bench pair (0.83M parameters) matched in 1.08 s against 1.21 s on one
# CPU thread, so the GPU bought nothing, and on it the matchings run one after another. Larger models stay on the
# GPU (a GPT-2-small pair: 3.2 s there). Not yet measured with this rule on a GPU.
HOST_MATCH_MAX_PARAMS = 1_000_000


def matching_device(method: str, anchor: State) -> torch.device:
    """Where an iteration's pairwise matchings run: where the anchor lives, or the CPU for a small model's weight
    matching (:data:`HOST_MATCH_MAX_PARAMS`)."""
    device = device_of(anchor)
    small = sum(x.numel() for x in anchor.values()) <= HOST_MATCH_MAX_PARAMS
    return torch.device("cpu") if device.type != "cpu" and method == "weight" and small else device


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
    if workers <= 1 or device_of(anchor).type != "cpu":  # a forked child cannot use its parent's CUDA context
        return [_align_one(job, anchor, s) for s in states]
    start_method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(min(workers, len(states)), mp_context=multiprocessing.get_context(start_method),
                             initializer=_share, initargs=(job, anchor, list(states))) as pool:
        return list(pool.map(_align_shared, range(len(states))))


def _relative(a: State, b: State) -> float:
    """‖a − b‖ / ‖b‖ over every parameter."""
    return (sq_distance(a, b) / max(sq_distance(b, {k: torch.zeros_like(v) for k, v in b.items()}), 1e-300)) ** 0.5


def _small_dataset(data: Dataset | None, n: int | None) -> Dataset | None:
    """The first ``n`` (input, target) pairs as one small TensorDataset, cheap to send to worker processes."""
    if data is None:
        return None
    count = len(data) if n is None else min(n, len(data))  # type: ignore[arg-type]
    pairs = [data[i] for i in range(count)]
    return TensorDataset(torch.stack([p[0] for p in pairs]), torch.stack([torch.as_tensor(p[1]) for p in pairs]))


def _into_universe(states: Sequence[State], cfg: ModelConfig, configs: Sequence[ModelConfig] | None,
                   starts: Sequence[Placement | None] | None = None, fill: str = "zeros",
                   ) -> tuple[list[State], list[Placement]]:
    """Embed every state into the universe config (exact) at its start placement (default: :func:`place`), its
    heads and units widened to the universe's first when ``fill`` is ``copies``."""
    configs = list(configs) if configs is not None else [cfg] * len(states)
    starts = list(starts) if starts is not None else [None] * len(states)
    if not len(configs) == len(starts) == len(states):
        raise ConfigError(f"{len(states)} states but {len(configs)} configs and {len(starts)} start placements")
    if fill not in FILLS:
        raise ConfigError(f"unknown fill {fill!r}; known: {', '.join(FILLS)}")
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
    return [embed(s, p) if p.narrow != cfg else dict(s) for s, p in zip(states, placements, strict=True)], placements


def universe_match(
    states: Sequence[State], cfg: ModelConfig, method: str = "weight", *, weights: Sequence[float] | None = None,
    anchor: State | None = None, reference: int = 0, configs: Sequence[ModelConfig] | None = None,
    max_iters: int = 5, tol: float = 1e-3, data: Dataset | None = None, batch: int = 512, workers: int = 1,
    refine: bool = False, learn: LearnConfig | None = None, starts: Sequence[Placement | None] | None = None,
    fill: str = "zeros", weight_start: Start = DEFAULT_START, weight: WeightOptions | None = None,
) -> UniverseResult:
    """Align N canonical standard-form models into one universe of config ``cfg`` and merge them (paper §4.3).

    Stops after ``max_iters`` or once U moves, or the mean distance to U falls, by less than ``tol`` (relative).
    ``configs[i]`` is state i's own config when it is narrower than ``cfg`` (default: all are ``cfg``);
    ``weights`` are the example counts n_i; ``anchor`` is the first U (default: model ``reference``);
    ``method`` is any pairwise method of :mod:`glmc.align`; ``data`` feeds the data-driven ones (activation: its
    first ``batch`` inputs; learned: all of it) and the refinement; ``workers`` > 1 runs each iteration's
    alignments in a process pool; ``refine`` adds the multi-model learned refinement with options ``learn``;
    ``starts[i]`` is where narrow state i sits in the universe before matching (default: :func:`place`);
    ``fill`` is how a narrow model fills the universe's extra heads and units (:data:`glmc.merging.widths.FILLS`);
    ``weight_start`` and ``weight``: where each pairwise weight matching starts and its options
    (:func:`glmc.match.weight.weight_match`).
    """
    if len(states) == 0:
        raise ConfigError("universe matching needs at least one model")
    if weights is not None:
        check_weights(weights, len(states))
    check_options("universe matching", [("≥ 1", lambda v: v >= 1, {"max_iters": max_iters, "workers": workers}),
                                        ("finite and ≥ 0", lambda v: math.isfinite(v) and v >= 0, {"tol": tol})])
    aligned, placements = _into_universe(states, cfg, configs, starts, fill)
    transforms = [Transform.identity(cfg.depth) for _ in aligned]
    if method == "none":
        start = time.perf_counter()
        merged = lstsq_merge(aligned, placements, weights)
        record = IterationRecord(0, _mean_distance(aligned, merged), 0.0, 0.0, time.perf_counter() - start, method)
        return UniverseResult(aligned, placements, transforms, merged, [record])
    universe = dict(anchor) if anchor is not None else aligned[reference]
    if workers > 1:  # workers get a small materialised copy, not a pickled view of the whole dataset
        data = _small_dataset(data, batch if method == "activation" else None)
    job = _Job(method, cfg, data, MatchOptions("standard", batch, learn, weight_start, weight))
    result = UniverseResult(aligned, placements, transforms, universe)
    for iteration in range(1, max_iters + 1):
        _iterate(result, job, workers, iteration, weights)
        if _converged(result.history, tol):
            break
    if refine and len(aligned) > 1:  # one model's merge is itself: there is no mixture to refine
        _refine(result, job, weights, reference)
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


def _iterate(result: UniverseResult, job: _Job, workers: int, iteration: int,
             weights: Sequence[float] | None) -> IterationRecord:
    """One step: align every model to U, move them (and their placements), then U ← least-squares mean."""
    start = time.perf_counter()
    matches = _align_all(job, result.merged, result.aligned, workers)
    return _move_and_merge(result, job, [m.transform for m in matches], weights, iteration, start)


def _refine(result: UniverseResult, job: _Job, weights: Sequence[float] | None, reference: int) -> IterationRecord:
    """Multi-model learned refinement of the aligned models (paper §4.3), then U ← least-squares mean."""
    from glmc.match.dual import refine_universe

    if job.data is None:
        raise ConfigError("learned refinement needs data: pass training samples")
    start = time.perf_counter()
    transforms = refine_universe(result.aligned, job.cfg, job.data, weights, reference=reference,
                                 options=job.options.learn)
    return _move_and_merge(result, dataclasses.replace(job, method="refine"), transforms, weights,
                           len(result.history) + 1, start)


def _move_and_merge(result: UniverseResult, job: _Job, moves: Sequence[Transform], weights: Sequence[float] | None,
                    iteration: int, start: float) -> IterationRecord:
    """Apply each model's new transform (and move its placement), then merge by least squares and record it."""
    spec, heads = get_arch(job.cfg.family).spec, job.cfg.heads
    for i, t in enumerate(moves):
        result.aligned[i] = apply(result.aligned[i], spec, t, heads)
        result.placements[i] = move(result.placements[i], t)
        result.transforms[i] = compose(t, result.transforms[i])
    aligned_at = time.perf_counter()
    merged = lstsq_merge(result.aligned, result.placements, weights)
    record = IterationRecord(iteration, _mean_distance(result.aligned, result.merged),
                             _relative(merged, result.merged), aligned_at - start, time.perf_counter() - aligned_at,
                             job.method)
    result.merged = merged
    result.history.append(record)
    log.info("universe iteration %d (%s): mean distance to U %.4f, U moved %.2e; align %.2f s, merge %.2f s",
             iteration, job.method, record.mean_distance, record.change, record.align_seconds, record.merge_seconds)
    return record
