"""Merging N models of one family, of the same or different widths, into one: the target config, the inputs'
checks, and the one merge pipeline that the CLI, the API and the FL round all run (:func:`merge_models`):
canonical form → clipping around an anchor → universe matching → the guard → the learned refinement → robust merge →
corrections."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.utils.data import Dataset

from glmc.archs import Arch, get_arch
from glmc.core.config import ModelConfig, preset, scale_width
from glmc.core.state import State, cast
from glmc.device import device_of, to_device
from glmc.errors import ConfigError
from glmc.io.checkpoint import CheckpointMeta
from glmc.match.registry import get_method
from glmc.merging.options import MergeOptions
from glmc.merging.robust import Clipping, Robustness, clip, coordinatewise, recentre_round, screen, unclipped
from glmc.merging.universe import Member, UniverseResult, refine_merge, universe_match
from glmc.merging.widths import WIDTH_FIELDS, Placement, check_embeddable, embed, lstsq_merge, place, project
from glmc.symmetry.canonical import canonical_view, canonicalize

log = logging.getLogger(__name__)


def target_config(metas: Sequence[CheckpointMeta], width_of: CheckpointMeta | None = None,
                  width_mult: float | None = None) -> tuple[ModelConfig, float]:
    """The merged model's config and width multiplier: another checkpoint's, a preset tier, or the widest input's."""
    if width_of is not None:
        return width_of.config, width_of.width_mult
    widest = max(metas, key=lambda m: (m.config.width, m.config.mlp, m.config.heads))
    if width_mult is None:
        return widest.config, widest.width_mult
    shared = {k: v for k, v in widest.config.to_dict().items() if k not in WIDTH_FIELDS}
    return scale_width(preset(widest.preset).replace(**shared), width_mult), width_mult


def check_inputs(metas: Sequence[CheckpointMeta], target: ModelConfig) -> None:
    """One-line ConfigError unless every input fits the target: family, depth, data and vocabulary, width."""
    for meta in metas:
        check_embeddable(meta.config, target)
    if len({m.dataset for m in metas}) > 1:
        raise ConfigError(f"checkpoints were trained on different datasets: {sorted({m.dataset for m in metas})}")
    if len({m.vocab for m in metas}) > 1:
        raise ConfigError("checkpoints have different vocabularies")


@dataclass(frozen=True)
class MergeSetup:
    """What to merge into, with what: the target config, the options, and the training samples that data-driven
    methods and the corrections read (never the held-out split)."""

    target: ModelConfig
    options: MergeOptions = field(default_factory=MergeOptions)
    train: Dataset | None = None


@dataclass
class Merged:
    """A merge: the universe (every input aligned, where each sits, how each moved, and U, the merged model after
    every correction), the inputs' mean pairwise distance before and after alignment, and what clipping did.
    ``set_aside``: the guard found the alignment gained too little. At equal widths nothing was merged (the caller
    averages: FedAvg); across widths the universe is the unmatched merge of the models where they were placed."""

    universe: UniverseResult
    distance_before: float
    distance_after: float
    clipped_before: int = 0  # inputs scaled down before matching (glmc.merging.robust.screen)
    clipping: Clipping | None = None  # how far each aligned input was from the anchor, and what clipping did
    set_aside: bool = False
    averaged_by_caller: bool = False  # set aside at equal widths: nothing merged, the caller averages (FedAvg)


def reference_of(configs: Sequence[ModelConfig], target: ModelConfig) -> int:
    """The first model already at the target width is U's first value (else the first model)."""
    return next((i for i, c in enumerate(configs) if c == target), 0)


def merge_models(members: Sequence[Member], setup: MergeSetup, *, anchor: Mapping[str, torch.Tensor] | None = None,
                 reference: int | None = None, lazy: bool = False) -> Merged:
    """Merge native ``members`` (each with its config, weight and start placement) into one model of
    ``setup.target``: canonical form (float64; ``lazy``: made on each read from the inputs as stored, so universe
    matching holds its running mean and no copy of a model, for inputs mapped from files, at about twice the time
    at 5 iterations: each read moves a tensor once per iteration), each clipped around ``anchor`` (a native model of
    the target, e.g. the previous global model; None: nothing to clip around), universe matching from the anchor
    (else from model ``reference``, default :func:`reference_of`), the guard (``options.min_gain``: a matching that
    brings the models too little closer is set aside), the learned refinement where the method refines (from the
    unmatched models when the guard set the matching aside), the robust merge (``options.robustness``), then the
    corrections, on ``options.device``."""
    options, target = setup.options, setup.target
    arch, entry = get_arch(target.family), get_method(options.method)
    configs, weights = [m.config for m in members], [m.weight for m in members]
    # A method that does not match, at one width, takes the models as trained (the paper's vanilla baseline) unless
    # told to fold their norms; everything else, and any embedding across widths, needs the standard form.
    raw = not entry.matches and not options.fold_norms and all(c == target for c in configs)
    states = [_canonical(arch, to_device(m.state, options.device), m.config, raw, lazy) for m in members]
    start = _canonical(arch, to_device(anchor, options.device), target, False, lazy) if anchor is not None else None
    starts, robust = [m.placement for m in members], options.robustness
    early = around_anchor(screen, states, configs, starts, start, target, robust.clip_ratio)  # no runaway matched
    before = embedded_distance(early.states, configs, target, starts)
    screened = [dataclasses.replace(m, state=s) for m, s in zip(members, early.states, strict=True)]
    reference = reference_of(configs, target) if reference is None else reference
    result = universe_match(screened, target, options, anchor=start, data=setup.train, reference=reference,
                            refine=False)
    after = mean_pairwise_distance(result.aligned)
    set_aside = entry.guarded and gains_too_little(before, after, options.min_gain)
    if set_aside and not entry.refines and all(c == target for c in configs):  # unaligned: FedAvg, the caller's own
        return Merged(result, before, before, early.clipped, set_aside=True, averaged_by_caller=True)
    if set_aside:  # the same merge of the clients where they were placed, unmatched (then refined, if it refines)
        matched, after = result, before
        result = universe_match(screened, target, dataclasses.replace(options, method="none"), anchor=start)
        result.history = matched.history + result.history  # the matching was done: its time counts
    if entry.refines and refine_merge(result, options, setup.train, weights, reference):
        after = mean_pairwise_distance(result.aligned)
    clipping = around_anchor(clip, result.aligned, [target] * len(members), result.placements, start, target,
                             robust.clip_ratio)  # the distance the average sees
    clipping = recentred(clipping, weights, configs, target, robust, start)
    merged = _robust_merge(result.merged, clipping, result.placements, weights, robust, start)
    result.merged = options.corrections.apply(merged, clipping.states, target, setup.train, weights,
                                              result.placements)
    return Merged(result, before, after, early.clipped, clipping, set_aside)


def _canonical(arch: Arch, native: Mapping[str, torch.Tensor], cfg: ModelConfig, raw: bool, lazy: bool) -> State:
    """A native state in float64: canonical in the standard form (``lazy``: made tensor by tensor on each read from
    the native one as stored, :func:`glmc.symmetry.canonical.canonical_view`, so no float64 copy of the model is held;
    the merge reads it by name, as a State is read), or ``raw``: the model's own parameters."""
    if raw:
        return arch.to_canonical(cast(native, torch.float64), cfg)
    if lazy:
        return typing.cast(State, canonical_view(arch, native, cfg, dtype=torch.float64))
    return canonicalize(arch, native, cfg, dtype=torch.float64)


def align_to_wide(wide: State, native: Mapping[str, torch.Tensor], cfg: ModelConfig,
                  setup: MergeSetup) -> UniverseResult:
    """A narrower native model (``cfg``) embedded into the canonical ``wide`` model's width (``setup.target``) and
    aligned to it by the method's own pairwise matching: one universe step anchored at ``wide``, so it computes the
    narrow function."""
    narrow = canonicalize(get_arch(cfg.family), to_device(native, device_of(wide)), cfg, dtype=torch.float64)
    options = dataclasses.replace(setup.options, max_iters=1, workers=1)
    return universe_match([Member(narrow, cfg)], setup.target, options, anchor=wide, data=setup.train,
                          pairwise=True)


def mean_pairwise_distance(states: Sequence[Mapping[str, torch.Tensor]]) -> float:
    """Mean over pairs of ‖θ_i − θ_j‖ (0 for a single state)."""
    pairs = list(itertools.combinations(states, 2))
    if not pairs:
        return 0.0
    return sum(float(sum(((a[k] - b[k]) ** 2).sum() for k in a)) ** 0.5 for a, b in pairs) / len(pairs)


def embedded_distance(states: Sequence[State], configs: Sequence[ModelConfig], full: ModelConfig,
                      placements: Sequence[Placement | None] | None = None) -> float:
    """Mean pairwise distance of canonical states embedded (unaligned) into the ``full`` width, each where it
    sits (default: :func:`glmc.merging.widths.place`)."""
    placements = placements or [None] * len(states)
    return mean_pairwise_distance([embed(s, p or place(c, full)) if c != full else s
                                   for s, c, p in zip(states, configs, placements, strict=True)])


def around_anchor(how: Callable[[Sequence[State], Sequence[State], float], Clipping], states: Sequence[State],
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


def recentred(clipping: Clipping, weights: Sequence[float], configs: Sequence[ModelConfig], full: ModelConfig,
              robust: Robustness, anchor: State | None) -> Clipping:
    """``clipping`` with its states recentred on their coordinate-wise median (:func:`glmc.merging.robust.recentre`)
    when they all have the full width and there is an anchor; else as it is: a narrow model's coordinates are not
    all comparable, and round 1 of independent inits, which clips no one, recentres no one either."""
    if anchor is None or any(c != full for c in configs):
        return clipping
    return recentre_round(clipping, robust, weights)


def _robust_merge(merged: State, clipping: Clipping, placements: Sequence[Placement], weights: Sequence[float],
                  robust: Robustness, anchor: State | None) -> State:
    """The universe's merge again when a defence acts: the least-squares mean of the clipped states (what none
    covers keeps the ``anchor``'s values), or their coordinate-wise FedMedian / FedTrimmedAvg (equal widths); else
    ``merged`` itself, untouched."""
    if robust.weighted_mean:
        return lstsq_merge(clipping.states, placements, weights, anchor) if clipping.acted else merged
    require_equal_widths(any(p.narrow != p.wide for p in placements), robust)
    return coordinatewise(clipping.states, robust.average, robust.trim_beta)


def require_equal_widths(mixed: bool, robust: Robustness) -> None:
    """A coordinate-wise robust average takes equal widths only: a one-line ConfigError when ``mixed``."""
    if mixed:
        raise ConfigError(f"robust-average {robust.average!r} takes the coordinates of equal-width models; this "
                          "merge has narrow ones")


def gains_too_little(before: float, after: float, min_gain: float) -> bool:
    """Whether to set the alignment aside: the mean pairwise distance (narrow models embedded where they were placed)
    fell by less than ``min_gain`` of itself."""
    if not min_gain or before <= 0:
        return False
    gain = 1.0 - after / before
    if gain < min_gain:
        log.info("alignment brought the models %.2f%% closer (%.4g → %.4g), less than min-alignment-gain %.2f%%: "
                 "merging them unaligned", 100 * gain, before, after, 100 * min_gain)
    return gain < min_gain
