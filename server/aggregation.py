"""The strategy's one aggregation step: decoded client models in, one global model out.

``merge`` is the only place that knows how models are combined, so the strategy never branches on the
method:

- ``fedavg``: HeteroFL's coverage-weighted average of width slices (:mod:`glmc.merging.heterofl`). The strategy
  itself takes flwr's own FedAvg code path when every client is full width, so that case is FedAvg exactly.
- ``weight`` / ``activation``: canonicalise (LayerNorms folded), embed every client exactly into the
  universe width, universe matching anchored at the previous global model (:func:`glmc.merging.universe.universe_match`,
  iterating U ← least-squares coverage-weighted mean), then back to the native form. At equal widths a round
  whose matching brings the clients less than ``min_gain`` closer averages them unaligned instead (FedAvg).
- ``learned``: the same weight-matching iterations, finished by the multi-model learned refinement on the
  server-held batch (paper §4.3).
- ``canonical``: the ablation of the alignment: the same canonical form, embedding and least-squares merge,
  with no matching. With equal widths it is FedAvg of the LayerNorm-folded models.
- ``fedavg-ft``: the control for the server-held data: ``fedavg``, then the merged model itself trained on that
  data with the learned refinement's budget (:func:`finetune`). ``learned`` minus ``fedavg-ft`` is what spending
  the same samples on choosing symmetries, rather than on the weights, is worth. When learned is scored against
  the clients' mixed predictions (refine-targets "endpoints"), both controls are distilled to them instead: the
  clients' models as clipped, mixed by their capped weights, so a hostile client teaches no more than it moves the
  average.
- ``server-only``: the other control: the clients are ignored; the previous global model (round 1: the initial
  model: seeded, so a model trained from scratch, or the ``init`` checkpoint) is trained on the server-held data
  with the same budget. After R rounds it has had R budgets, as fedavg-ft's model has. A data-using aggregation
  under it gains nothing from the clients that the server's own samples would not give.

Each client later gets the global model restricted to its own width (:func:`federation.restriction.restrict`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch.utils.data import Dataset

from federation.restriction import wire_state
from federation.settings import AGGREGATION_TABLE, CONTROLS, GUARDED
from glmc.archs import build_model, get_arch
from glmc.core.config import ModelConfig, scale_width
from glmc.core.state import State
from glmc.device import to_device
from glmc.errors import ConfigError
from glmc.match.learned import LearnConfig, targets_for
from glmc.merging import heterofl
from glmc.merging.evaluation import PredictionMixture
from glmc.merging.options import MergeOptions
from glmc.merging.robust import Clipping, Robustness, clip, coordinatewise, recentre_round, screen, unclipped
from glmc.merging.universe import universe_match
from glmc.merging.widths import Placement, embed, lstsq_merge, place, project
from glmc.symmetry.canonical import canonicalize
from glmc.train import TrainConfig, train

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Client:
    """One valid reply, decoded: its native state, example count and width tier."""

    state: State
    weight: float
    tier: float
    placement: Placement | None = None  # where to embed a narrow reply (None: the default place; matching finds it)


@dataclass(frozen=True)
class MergeResult:
    """The merged native state (float32, full width; None when ``unaligned``), its cost, and where every client
    now sits."""

    state: State | None
    align_seconds: float  # the server's own step: alignment, or fedavg-ft's fine-tuning
    distance_before: float  # mean pairwise ‖θ_i − θ_j‖ of the clients in the universe (canonical, embedded)
    distance_after: float  # the same after alignment
    placements: list[Placement | None]  # per client, for restricting the next global model (None: HeteroFL)
    clipped_before: int = 0  # aligned aggregations: clients scaled down before matching (glmc.merging.robust.screen)
    clipping: Clipping | None = None  # how far each client was from the global model, and what clipping did

    @property
    def unaligned(self) -> bool:
        """The alignment gained less than ``min_gain``: nothing was merged, the caller averages the clients."""
        return self.state is None


def mean_pairwise_distance(states: Sequence[Mapping[str, torch.Tensor]]) -> float:
    """Mean over client pairs of ‖θ_i − θ_j‖ (0 for a single client)."""
    pairs = list(itertools.combinations(states, 2))
    if not pairs:
        return 0.0
    return sum(float(sum(((a[k] - b[k]) ** 2).sum() for k in a)) ** 0.5 for a, b in pairs) / len(pairs)


def universe_states(clients: Sequence[Client], full: ModelConfig) -> tuple[list[State], list[ModelConfig]]:
    """Every client canonical (float64, LayerNorms folded) at its own width, with its config."""
    arch = get_arch(full.family)
    configs = [scale_width(full, c.tier) for c in clients]
    return [canonicalize(arch, c.state, full, dtype=torch.float64) for c in clients], configs


def embedded_distance(states: Sequence[State], configs: Sequence[ModelConfig], full: ModelConfig,
                      placements: Sequence[Placement | None] | None = None) -> float:
    """Mean pairwise distance of canonical clients embedded (unaligned) into the universe width, each where it
    was sent (default: :func:`glmc.merging.widths.place`)."""
    placements = placements or [None] * len(states)
    return mean_pairwise_distance([embed(s, p or place(c, full)) if c != full else s
                                   for s, c, p in zip(states, configs, placements, strict=True)])


def finetune(native: State, full: ModelConfig, data: Dataset | None, config: TrainConfig,
             teacher: PredictionMixture | None = None) -> tuple[State, float]:
    """The full-width native model trained on the server-held ``data`` (``fedavg-ft``, ``server-only``), against
    its labels or ``teacher``'s predictions; returns it and the seconds."""
    if data is None:
        raise ConfigError("fedavg-ft and server-only train on server-held data: set server-data > 0")
    start = time.perf_counter()
    model = _model(native, full)
    train(model, get_arch(full.family), data, config, progress=False, teacher=teacher)
    return wire_state(model.state_dict()), time.perf_counter() - start


def _model(native: State, cfg: ModelConfig) -> torch.nn.Module:
    """A runnable model holding ``native`` (a state at ``cfg``), in eval mode."""
    model = build_model(cfg)
    model.load_state_dict(native, strict=True)
    return model.eval()


def client_models(clients: Sequence[Client], full: ModelConfig) -> list[torch.nn.Module]:
    """Each client's model at its own width, in eval mode (the logit ensemble, the distillation teacher)."""
    return [_model(c.state, scale_width(full, c.tier)) for c in clients]


def clients_teacher(states: Sequence[State], clients: Sequence[Client], full: ModelConfig) -> PredictionMixture:
    """The clients' predictions, from ``states`` (theirs as clipping left them), mixed by their capped weights: what
    the controls are distilled to when the learned refinement is scored against its endpoints
    (glmc.match.learned.targets_for), so that both read the same in an honest round (learned's endpoints are the
    clients as screened before matching) and no hostile client teaches as more than the model the average sees.
    Under FedMedian too: a median of the predictions drops each class's one expert when the data are not IID
    (simulations/results/attacks-distil)."""
    held = [replace(c, state=s) for s, c in zip(states, clients, strict=True)]
    return PredictionMixture(client_models(held, full), get_arch(full.family), [c.weight for c in clients])


def merge(clients: Sequence[Client], full: ModelConfig, aggregation: str, options: MergeOptions, *,
          anchor: State | None, data: Dataset | None = None, tune: TrainConfig | None = None) -> MergeResult:
    """Merge ``clients`` into one full-width native model by ``aggregation`` (see the module docstring), which sets
    the method of ``options``; the rest of ``options`` says how (iterations, workers, matching, corrections on
    ``data``, robustness: the clients' weights come already capped, and the device; the result comes back on the
    CPU).

    ``anchor``: the previous global model (native, full width), or None to start from the heaviest client.
    ``tune``: how ``fedavg-ft`` and ``server-only`` train on ``data`` (default: one epoch, one thread).
    ``options.min_gain``: for weight and activation at equal widths, when matching brings the clients less than
    this fraction closer, merge nothing and say ``unaligned``: the caller averages them as FedAvg
    (:func:`_gains_too_little`).
    """
    robust, device = options.robustness, options.device
    method = AGGREGATION_TABLE[aggregation].method
    if method is None:  # HeteroFL's slices, or the server's own model (SLICED)
        tune = replace(tune or TrainConfig(threads=1), device=device)
        distil = (aggregation in CONTROLS and data is not None
                  and targets_for(options.match.learn or LearnConfig(), data) == "endpoints")
        return _merge_sliced(clients, full, aggregation, anchor, data, tune, robust, distil)
    batch = len(data) if data is not None else 512  # type: ignore[arg-type]
    options = replace(options, method=method, match=replace(options.match, batch=batch))
    arch = get_arch(full.family)
    states, configs = universe_states(clients, full)
    states = [to_device(s, device) for s in states]
    starts = [c.placement for c in clients]
    start = (canonicalize(arch, to_device(anchor, device), full, dtype=torch.float64)
             if anchor is not None else None)
    early = _around_anchor(screen, states, configs, starts, start, full, robust.clip_ratio)  # no runaway matched
    before = embedded_distance(early.states, configs, full, starts)
    weights = [c.weight for c in clients]
    result = universe_match(early.states, full, **options.universe(), weights=weights, anchor=start,
                            reference=max(range(len(clients)), key=weights.__getitem__), configs=configs, data=data,
                            starts=starts)
    seconds = sum(r.align_seconds + r.merge_seconds for r in result.history)
    after = mean_pairwise_distance(result.aligned)
    if aggregation in GUARDED and _gains_too_little(before, after, options.min_gain, configs, full):
        return MergeResult(None, seconds, before, before, [None] * len(clients), early.clipped)
    clipping = _around_anchor(clip, result.aligned, [full] * len(clients), result.placements, start, full,
                              robust.clip_ratio)  # the distance the average sees
    clipping = _recentred(clipping, weights, configs, full, robust, start)
    merged = _robust_merge(result.merged, clipping, result.placements, weights, robust)
    merged = options.corrections.apply(merged, clipping.states, full, data, weights, result.placements)
    return MergeResult(wire_state(arch.to_native(merged, full)), seconds, before, after, list(result.placements),
                       early.clipped, clipping)


def _around_anchor(how: Callable[[Sequence[State], Sequence[State], float], Clipping], states: Sequence[State],
                   configs: Sequence[ModelConfig], placements: Sequence[Placement | None], anchor: State | None,
                   full: ModelConfig, ratio: float) -> Clipping:
    """Canonical ``states`` clipped (or screened) around the canonical ``anchor`` as each one sees it: at its own width
    (``configs[i]`` narrower than ``full``: the anchor projected where it sits), or in the universe (a narrow
    ``placements[i]``: the anchor projected there, then embedded back). No anchor, nothing to clip around."""
    if anchor is None:
        return unclipped(states)
    centers = []
    for cfg, p in zip(configs, placements, strict=True):
        if cfg != full:
            centers.append(project(anchor, p or place(cfg, full)))
        elif p is not None and p.narrow != full:
            centers.append(embed(project(anchor, p), p))
        else:
            centers.append(anchor)
    return how(states, centers, ratio)


def _recentred(clipping: Clipping, weights: Sequence[float], configs: Sequence[ModelConfig], full: ModelConfig,
               robust: Robustness, anchor: State | None) -> Clipping:
    """``clipping`` with its clients recentred on their coordinate-wise median (:func:`glmc.merging.robust.recentre`)
    when they all have the full width and there is a global model; else as it is: a narrow client's coordinates are
    not all comparable, and round 1 of independent inits, which clips no one, recentres no one either."""
    if anchor is None or any(c != full for c in configs):
        return clipping
    return recentre_round(clipping, robust, weights)


def _robust_merge(merged: State, clipping: Clipping, placements: Sequence[Placement], weights: Sequence[float],
                  robust: Robustness) -> State:
    """The universe's merge again when a defence acts: the least-squares mean of the clipped clients, or their
    coordinate-wise FedMedian / FedTrimmedAvg (equal widths); else ``merged`` itself, untouched."""
    if robust.weighted_mean:
        return lstsq_merge(clipping.states, placements, weights) if clipping.acted else merged
    _require_equal_widths(any(p.narrow != p.wide for p in placements), robust)
    return coordinatewise(clipping.states, robust.average, robust.trim_beta)


def _require_equal_widths(mixed: bool, robust: Robustness) -> None:
    if mixed:
        raise ConfigError(f"robust-average {robust.average!r} takes the coordinates of equal-width clients; this "
                          "round has narrow ones")


def _merge_sliced(clients: Sequence[Client], full: ModelConfig, aggregation: str, anchor: State | None,
                  data: Dataset | None, tune: TrainConfig, robust: Robustness, distil: bool) -> MergeResult:
    """HeteroFL's average of the clipped width slices (or their FedMedian / FedTrimmedAvg at equal widths), then
    for fedavg-ft the fine-tuning on the server data; server-only trains the previous global model instead. With
    ``distil`` both train against the clipped clients' mixed predictions (:func:`clients_teacher`), not labels."""
    states, configs = universe_states(clients, full)
    before = embedded_distance(states, configs, full, [c.placement for c in clients])
    previous = anchor if anchor is not None else _zeros(full)  # no global model yet: what no client holds is 0
    centers = [previous if cfg == full else heterofl.restrict(previous, full, cfg) for cfg in configs]
    natives = [c.state for c in clients]
    clipping = clip(natives, centers, robust.clip_ratio) if anchor is not None else unclipped(natives)
    weights = [c.weight for c in clients]
    clipping = _recentred(clipping, weights, configs, full, robust, anchor)
    teacher = clients_teacher(clipping.states, clients, full) if distil else None
    if aggregation == "server-only":
        native, seconds = finetune(_server_only(anchor), full, data, tune, teacher)
        return MergeResult(native, seconds, before, before, [None] * len(clients), 0, clipping if distil else None)
    if robust.weighted_mean:
        native = heterofl.merge(clipping.states, configs, weights, full, previous)
    else:
        _require_equal_widths(any(cfg != full for cfg in configs), robust)
        native = coordinatewise(clipping.states, robust.average, robust.trim_beta)
    native, seconds = wire_state(native), 0.0
    if aggregation == "fedavg-ft":
        native, seconds = finetune(native, full, data, tune, teacher)
    return MergeResult(native, seconds, before, before, [None] * len(clients), 0, clipping)


def _zeros(cfg: ModelConfig) -> State:
    """A native state of ``cfg`` that is zero everywhere: HeteroFL's base where there is no global model (round 1 of
    independent inits), so the merge has the full width's shapes whoever replied first (the first client's state,
    the base before, was narrow when that client was) and the coordinates no client holds are the exact
    embedding's zeros."""
    return {k: torch.zeros_like(v) for k, v in build_model(cfg).state_dict().items()}


def _server_only(anchor: State | None) -> State:
    """``server-only``'s start: the previous global model, whatever the clients sent."""
    if anchor is None:
        raise ConfigError("server-only trains the previous global model on the server data: it needs one")
    return wire_state(anchor)


def _gains_too_little(before: float, after: float, min_gain: float, configs: Sequence[ModelConfig],
                      full: ModelConfig) -> bool:
    """Whether to set this round's alignment aside: equal widths (where the unaligned average is FedAvg itself)
    and the clients' mean pairwise distance fell by less than ``min_gain`` of itself."""
    if not min_gain or before <= 0 or any(c != full for c in configs):
        return False
    gain = 1.0 - after / before
    if gain < min_gain:
        log.info("alignment brought the clients %.2f%% closer (%.4g → %.4g), less than min-alignment-gain %.2f%%: "
                 "averaging them unaligned (FedAvg)", 100 * gain, before, after, 100 * min_gain)
    return gain < min_gain
