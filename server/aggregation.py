"""The strategy's one aggregation step: decoded client models in, one global model out.

``merge`` is the only place that knows how models are combined, so the strategy never branches on the
method:

- ``fedavg``: HeteroFL's coverage-weighted average of width slices (:mod:`glmc.merging.heterofl`). The strategy
  itself takes flwr's own FedAvg code path when every client is full width, so that case is FedAvg exactly.
- ``fedrolex``: the same average of FedRolex's windows, which roll one unit a round (``server_round``).
  ``fjord`` is ``fedavg``'s average of leading slices: its clients train them with Ordered Dropout.
  ``smallest-width`` and ``full-width-only`` are FedAvg of equal widths: the strategy trains every client at the
  smallest tier, or leaves the narrow replies out.
- ``weight`` / ``activation``: canonicalise (LayerNorms folded), embed every client exactly into the
  universe width, universe matching anchored at the previous global model (:func:`glmc.merging.universe.universe_match`,
  iterating U ← least-squares coverage-weighted mean), then back to the native form. A round whose matching brings
  the clients less than ``min_gain`` closer merges them unaligned instead: FedAvg at equal widths, the same
  least-squares merge of the clients where they were placed across widths (the ``canonical`` ablation's).
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

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch.utils.data import Dataset

from federation.protocol import Client
from federation.restriction import wire_state
from federation.settings import AGGREGATION_TABLE
from glmc.archs import build_model, get_arch
from glmc.core.config import ModelConfig, scale_width
from glmc.core.state import State
from glmc.errors import ConfigError
from glmc.match.learned import targets_for
from glmc.match.options import ActivationOptions
from glmc.merging import heterofl
from glmc.merging.evaluation import PredictionMixture
from glmc.merging.merge import (
    MergeSetup,
    embedded_distance,
    merge_models,
    recentred,
    require_equal_widths,
)
from glmc.merging.options import MergeOptions
from glmc.merging.robust import Clipping, Robustness, clip, coordinatewise, unclipped
from glmc.merging.widths import Placement
from glmc.symmetry.canonical import canonicalize
from glmc.train import TrainConfig, train

log = logging.getLogger(__name__)


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
    unaligned: bool = False  # the matching gained less than min_gain: set aside (state None at equal widths: FedAvg)


def universe_states(clients: Sequence[Client], full: ModelConfig) -> tuple[list[State], list[ModelConfig]]:
    """Every client canonical (float64, LayerNorms folded) at its own width, with its config."""
    arch = get_arch(full.family)
    configs = [scale_width(full, c.tier) for c in clients]
    return [canonicalize(arch, c.state, full, dtype=torch.float64) for c in clients], configs


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
          anchor: State | None, data: Dataset | None = None, tune: TrainConfig | None = None,
          server_round: int = 0) -> MergeResult:
    """Merge ``clients`` into one full-width native model by ``aggregation`` (see the module docstring), which sets
    the method of ``options``; the rest of ``options`` says how (iterations, workers, matching, corrections on
    ``data``, robustness: the clients' weights come already capped, the guard, and the device; the result comes back
    on the CPU). The aligned aggregations run the library's one merge (:func:`glmc.merging.merge.merge_models`).

    ``anchor``: the previous global model (native, full width), or None to start from the heaviest client.
    ``tune``: how ``fedavg-ft`` and ``server-only`` train on ``data`` (default: one epoch, one thread).
    ``server_round``: the round whose width windows the narrow clients held (FedRolex's offset).
    """
    robust, device = options.robustness, options.device
    method = AGGREGATION_TABLE[aggregation].method
    if method is None:  # HeteroFL's slices, or the server's own model (SLICED)
        tune = replace(tune or TrainConfig(threads=1), device=device)
        distil = AGGREGATION_TABLE[aggregation].control and data is not None and \
            targets_for(options.match.learn, data) == "endpoints"
        offset = AGGREGATION_TABLE[aggregation].offset(server_round)
        return _merge_sliced(clients, full, aggregation, anchor, data, tune, robust, distil, offset)
    options = replace(options, method=method)
    if data is not None:  # activation matching reads all of the server data
        options = replace(options, match=replace(options.match, activation=ActivationOptions(len(data))))  # type: ignore[arg-type]
    weights = [c.weight for c in clients]
    merged = merge_models([c.member(full) for c in clients], MergeSetup(full, options, data), anchor=anchor,
                          reference=max(range(len(clients)), key=weights.__getitem__))
    result = merged.universe
    if merged.averaged_by_caller:  # set aside at equal widths: the strategy averages (FedAvg)
        return MergeResult(None, result.seconds, merged.distance_before, merged.distance_after, [None] * len(clients),
                           merged.clipped_before, unaligned=True)
    native = wire_state(get_arch(full.family).to_native(result.merged, full))
    return MergeResult(native, result.seconds, merged.distance_before, merged.distance_after, list(result.placements),
                       merged.clipped_before, merged.clipping, merged.set_aside)


def _merge_sliced(clients: Sequence[Client], full: ModelConfig, aggregation: str, anchor: State | None,
                  data: Dataset | None, tune: TrainConfig, robust: Robustness, distil: bool,
                  offset: int = 0) -> MergeResult:
    """HeteroFL's average of the clipped width slices (their windows at ``offset``; or their FedMedian /
    FedTrimmedAvg at equal widths), then for fedavg-ft the fine-tuning on the server data; server-only trains the
    previous global model instead. With ``distil`` both train against the clipped clients' mixed predictions
    (:func:`clients_teacher`), not labels."""
    states, configs = universe_states(clients, full)
    before = embedded_distance(states, configs, full, [c.placement for c in clients])
    previous = anchor if anchor is not None else _zeros(full)  # no global model yet: what no client holds is 0
    centers = [previous if cfg == full else heterofl.restrict(previous, full, cfg, offset) for cfg in configs]
    natives = [c.state for c in clients]
    clipping = clip(natives, centers, robust.clip_ratio) if anchor is not None else unclipped(natives)
    weights = [c.weight for c in clients]
    clipping = recentred(clipping, weights, configs, full, robust, anchor)
    teacher = clients_teacher(clipping.states, clients, full) if distil else None
    if aggregation == "server-only":
        native, seconds = finetune(_server_only(anchor), full, data, tune, teacher)
        return MergeResult(native, seconds, before, before, [None] * len(clients), 0, clipping if distil else None)
    if robust.weighted_mean:
        native = heterofl.merge(clipping.states, configs, weights, full, previous, offset)
    else:
        require_equal_widths(any(cfg != full for cfg in configs), robust)
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
