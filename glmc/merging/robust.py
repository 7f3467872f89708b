"""Robust aggregation that composes with alignment: what one hostile but well-formed reply can do to a round is bounded.

Validation (:mod:`server.validation`) drops malformed replies; a well-formed hostile one (an inflated
``num-examples``, weights scaled or replaced, a tensor of constants) passes it. Three defences bound it, on every
aggregation, in the space the clients are averaged in (after alignment, for the aligned ones):

- **A cap on num-examples** (``max-examples-ratio``, ``peer-examples-ratio``, ``max-examples-share``,
  ``max-examples``): a node's weight is at most that multiple of the lower median weight of the round, at most that
  multiple of the largest weight among the other nodes (1.6: above the 1.54 of every published split's heaviest node
  over its second), at most a common level under which no node keeps more than that share of the round (0.49, with
  four or more replies: none takes half; the published splits reach 0.46), and at most a declared per-node budget.
- **Update-norm clipping** (``clip-ratio``): a client farther from the global model than ``clip-ratio`` times the
  lower median client's distance is pulled back along its update to that distance (as Flower's adaptive clipping
  does with a quantile of the update norms; here the median, so one client cannot move its own bound). Aligned
  aggregations measure after matching, where the distance is the one the average sees; before matching, only a
  client whose norm alone proves it would be clipped is scaled down (:func:`screen`), so that a runaway reply
  cannot derail the matching itself. A narrow client is measured against the global model at its own width.
- **Centred clipping** (``center-clip-ratio``, ``center-clip-by-examples``): then, at equal widths, a client farther
  from the round's coordinate-wise median (of the clients that moved) than ``center-clip-ratio`` times the lower
  median distance to it, times its example allowance (its capped weight, at most the largest other one, over the
  lower median weight, and at least 1), is pulled back toward it (Karimireddy, He and Jaggi 2021 clip around a
  robust centre too). Clipping around the global model bounds how far an attacker reaches, not where: at 5 × the
  median a sign flip or a runaway reply still moved the round 6–7 times as far as the farthest honest client did;
  around the median at 1 ×, one attacker among three honest clients lands no farther out than an honest client sits
  (simulations/results/single-attacker). The allowance keeps a heavier node that took more local steps (whole
  epochs) from being pulled in as if it were one.
- **Coordinate-wise robust averages** (``robust-average``): ``fedmedian`` (Flower's FedMedian) and
  ``fedtrimmedavg`` with ``trim-beta`` (Flower's FedTrimmedAvg: ``int(beta·n)`` values cut from each end), both
  unweighted as in Flower, of the aligned clients. Equal widths only.

With the lower median, one attacker among n ≥ 2 honest clients cannot raise either clipping bound past the largest
honest value, nor its own weight past 1.6 × the heaviest honest client's. The caps sit above every published honest
split and the clipping at 5 above every honest round measured (simulations/results/attacks), so there they change
nothing; the centred clipping does touch honest rounds: it pulls the clients beyond their bound in to it (an honest
round's farthest client sat 1.2–1.3 times as far; docs/reliability.md has what that cost). Bound (mean,
one attacker): the global model lies within ``(clip-ratio + 1) · R`` of the honest clients' own aggregate, R the
largest honest distance from the global model.
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from glmc.core.options import option
from glmc.core.state import State
from glmc.errors import ConfigError

log = logging.getLogger(__name__)

AVERAGES = ("fedavg", "fedmedian", "fedtrimmedavg")  # Flower's names: the weighted mean, FedMedian, FedTrimmedAvg


@dataclass(frozen=True)
class Robustness:
    """The robust-aggregation settings of a run, each with its run-config key (pyproject.toml says what it means)."""

    max_examples_ratio: float = option(5.0, "cap on num-examples, × the lower median", flag=None,
                                       key="max-examples-ratio")
    max_examples: int = option(0, "a declared per-node budget of num-examples; 0 = none", flag=None,
                               key="max-examples")
    clip_ratio: float = option(5.0, "clipping around the global model, × the lower median distance", flag=None,
                               key="clip-ratio")
    peer_examples_ratio: float = option(1.6, "cap on num-examples, × the largest other node's", flag=None,
                                        key="peer-examples-ratio")
    max_examples_share: float = option(0.49, "cap on any node's share of the round", flag=None,
                                       key="max-examples-share")
    center_clip_ratio: float = option(1.0, "clipping around the round's median, × the lower median distance",
                                      flag=None, key="center-clip-ratio")
    center_clip_by_examples: bool = option(True, "the centred bound grows with a node's examples", flag=None,
                                           key="center-clip-by-examples")
    average: str = option("fedavg", "fedavg (weighted mean) | fedmedian | fedtrimmedavg", flag=None,
                          key="robust-average")
    trim_beta: float = option(0.2, "fedtrimmedavg: the fraction cut from each end of every coordinate", flag=None,
                              key="trim-beta")

    def __post_init__(self) -> None:
        if self.average not in AVERAGES:
            raise ConfigError(f"robust-average must be one of {AVERAGES}, got {self.average!r}")
        if min(self.max_examples_ratio, self.clip_ratio, self.max_examples, self.peer_examples_ratio,
               self.center_clip_ratio) < 0:
            raise ConfigError("max-examples-ratio, peer-examples-ratio, max-examples, clip-ratio and "
                              "center-clip-ratio must be >= 0 (0 = off)")
        if not 0 <= self.trim_beta < 0.5:
            raise ConfigError(f"trim-beta must be in [0, 0.5), got {self.trim_beta}")
        if not 0 <= self.max_examples_share < 1:
            raise ConfigError(f"max-examples-share must be in [0, 1) (0 = off), got {self.max_examples_share}")
        for name in ("max_examples_ratio", "clip_ratio", "peer_examples_ratio", "center_clip_ratio"):
            value = getattr(self, name)
            if value and value < 1:
                raise ConfigError(f"{name.replace('_', '-')} below 1 would cut the median client itself, got {value}")

    @classmethod
    def off(cls) -> Robustness:
        """No cap, no clipping, the weighted mean: the aggregation as it was before these defences."""
        return cls(max_examples_ratio=0.0, max_examples=0, clip_ratio=0.0, peer_examples_ratio=0.0,
                   max_examples_share=0.0, center_clip_ratio=0.0)

    @property
    def weighted_mean(self) -> bool:
        return self.average == "fedavg"


def cap_examples(weights: Sequence[float], robust: Robustness) -> list[float]:
    """Every weight capped at ``max_examples_ratio`` × the lower median weight, at ``max_examples``, at
    ``peer_examples_ratio`` × the largest of the other weights (so that no weight raises its own cap), and then at
    the common level under which none keeps more than ``max_examples_share`` of the total (:func:`share_cap`)."""
    caps = [robust.max_examples_ratio * statistics.median_low(weights)] if robust.max_examples_ratio else []
    caps += [float(robust.max_examples)] if robust.max_examples else []
    cap = min(caps, default=math.inf)
    capped = [min(float(w), cap, _peer_cap(weights, i, robust.peer_examples_ratio)) for i, w in enumerate(weights)]
    level = share_cap(capped, robust.max_examples_share)
    return [min(w, level) for w in capped]


def _peer_cap(weights: Sequence[float], i: int, ratio: float) -> float:
    """``ratio`` × the largest weight other than ``weights[i]`` (inf: off, or fewer than three weights: of two, no
    rule tells the attacker from the honest node, and the cap would only cut an honest pair's larger node)."""
    others = [float(w) for j, w in enumerate(weights) if j != i]
    return ratio * max(others) if ratio and len(others) >= 2 else math.inf


def share_cap(weights: Sequence[float], share: float) -> float:
    """The highest level c at which c ≤ ``share`` × Σ min(w_i, c): capped at it, no weight keeps more than
    ``share`` of the total (inf: off, already so, or fewer than four weights: with three, one honest node of 30
    examples beside 10 and 20 holds half, and one attacker's weight is the peer cap's to bound). c / Σ min(w_i, c)
    grows with c and is 1/n at the smallest weight, so bisection finds it (to float precision, from below)."""
    if not share or len(weights) < 4 or max(weights) <= share * sum(weights):
        return math.inf
    low, high = min(weights), max(weights)
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if middle <= share * sum(min(w, middle) for w in weights) else (low, middle)
    return low


def distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """‖a − b‖ over every tensor, in float64."""
    return math.sqrt(sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a))


@dataclass
class Clipping:
    """States after clipping, with each one's factor (1.0: untouched, the same object) and the largest distance
    from the global model relative to the lower median (what ``clip-ratio`` must clear in an honest round)."""

    states: list[State]
    factors: list[float]
    spread: float | None  # None: nothing to measure against (no global model yet)
    moved: list[bool] | None = None  # per client: away from its center (UNMOVED); None: all of them
    recentred: int = 0  # clients then pulled toward the round's median (:func:`recentre`)
    center_spread: float | None = None  # the farthest distance from that median over the lower median's

    @property
    def clipped(self) -> int:
        return sum(f < 1.0 for f in self.factors)

    @property
    def unmoved(self) -> int:
        """Clients at their center: free riders, or stragglers that trained no step."""
        return 0 if self.moved is None else self.moved.count(False)

    @property
    def acted(self) -> bool:
        """Whether any client was clipped or recentred: the average must be taken again."""
        return bool(self.clipped or self.recentred)


# A client whose distance from its center is at most this fraction of the center's norm did not move (a free rider,
# or a straggler that trained no step): float32 round trips of an unchanged model stay far below it.
UNMOVED = 1e-6


def moved_median(distances: Sequence[float], centers: Sequence[Mapping[str, torch.Tensor]],
                 ) -> tuple[float | None, list[bool]]:
    """The lower median distance of the clients that moved from their centers (None: none did), and which moved.
    Clients that did not move must not set the scale: half the nodes of a round replying the global model unchanged
    made the lower median 0, which pulled every client that trained back onto the global model."""
    moved = [d > UNMOVED * _norm(c) for d, c in zip(distances, centers, strict=True)]
    kept = [d for d, m in zip(distances, moved, strict=True) if m]
    return (statistics.median_low(kept) if kept else None), moved


def clip(states: Sequence[State], centers: Sequence[Mapping[str, torch.Tensor]], ratio: float) -> Clipping:
    """Each state pulled toward its center along its update so that ‖θ_i − c_i‖ ≤ ``ratio`` × the lower median
    of those distances among the clients that moved (``ratio`` 0: measured, never clipped)."""
    distances = [distance(s, c) for s, c in zip(states, centers, strict=True)]
    median, moved = moved_median(distances, centers)
    spread = max(distances) / median if median else 1.0
    bound = ratio * median if ratio and median else math.inf
    factors = [bound / d if d > bound else 1.0 for d in distances]
    out = [_toward(s, c, f) for s, c, f in zip(states, centers, factors, strict=True)]
    if any(f < 1.0 for f in factors):
        log.warning("clipped %d of %d clients to %.3g (clip-ratio %g × the lower median distance %.3g of those that "
                    "moved); factors %s", sum(f < 1.0 for f in factors), len(factors), bound, ratio, median,
                    [f"{f:.3g}" for f in factors])
    return Clipping(out, factors, spread, moved)


def screen(states: Sequence[State], centers: Sequence[Mapping[str, torch.Tensor]], ratio: float) -> Clipping:
    """Before matching: a state whose norm exceeds its center's by more than ``ratio`` × the lower median distance
    to the centers (of the clients that moved) is clipped to that distance. Norms do not change under the
    permutations and orthogonal maps matching applies, and ‖θ‖ − ‖c‖ ≤ ‖T(θ) − c‖ for any such T, so this touches
    only clients the clipping after matching would clip anyway; a client sent back in another basis is left alone.
    It keeps runaway values (a reply of all 9999 made weight matching's assignment infeasible) out of the
    matching."""
    distances = [distance(s, c) for s, c in zip(states, centers, strict=True)]
    median, _ = moved_median(distances, centers)
    bound = ratio * median if ratio and median else math.inf
    flagged = [_norm(s) - _norm(c) > bound for s, c in zip(states, centers, strict=True)]
    factors = [bound / d if runaway else 1.0 for d, runaway in zip(distances, flagged, strict=True)]
    if any(flagged):
        log.warning("clipped %d of %d clients before matching: norms beyond the global model's + %.3g",
                    sum(flagged), len(flagged), bound)
    return Clipping([_toward(s, c, f) for s, c, f in zip(states, centers, factors, strict=True)], factors, None)


def recentre(clipping: Clipping, ratio: float, weights: Sequence[float] | None = None) -> Clipping:
    """``clipping``'s states, those that moved (free riders stay as they are, and set neither the center nor the
    scale), pulled toward their coordinate-wise median along their offset from it so that ‖θ_i − m‖ ≤ ``ratio`` ×
    the lower median of those distances, times client i's example allowance (:func:`example_allowance`). One
    attacker among n ≥ 2 honest clients cannot move that median out of the honest clients' range in any coordinate,
    nor raise its bound past the largest honest distance times the heaviest honest node's allowance. Needs three
    clients that moved (with two, both sit at the same distance from their mean); ``ratio`` 0: measured, never
    pulled."""
    moved = clipping.moved or [True] * len(clipping.states)
    group = [s for s, m in zip(clipping.states, moved, strict=True) if m]
    if len(group) < 3:
        return clipping
    median = coordinatewise(group, "fedmedian", 0.0)
    distances = [distance(s, median) for s in group]
    scale = statistics.median_low(distances)
    allowance = (example_allowance([w for w, m in zip(weights, moved, strict=True) if m]) if weights
                 else [1.0] * len(group))
    bounds = [ratio * scale * a if ratio else math.inf for a in allowance]
    pulled = iter([_toward(s, median, b / d) if d > b else s for s, d, b in zip(group, distances, bounds, strict=True)])
    states = [next(pulled) if m else s for s, m in zip(clipping.states, moved, strict=True)]
    recentred = sum(d > b for d, b in zip(distances, bounds, strict=True))
    if recentred:
        log.info("recentred %d of %d clients toward their median (center-clip-ratio %g × the lower median distance "
                 "%.3g, times the heavier nodes' example allowance)", recentred, len(group), ratio, scale)
    return replace(clipping, states=states, recentred=recentred, center_spread=max(distances) / scale if scale else 1.0)


def recentre_round(clipping: Clipping, robust: Robustness, weights: Sequence[float]) -> Clipping:
    """:func:`recentre` at ``robust``'s ratio, with the round's capped ``weights`` where ``center_clip_by_examples``
    (else every client gets the same bound)."""
    return recentre(clipping, robust.center_clip_ratio, weights if robust.center_clip_by_examples else None)


def example_allowance(weights: Sequence[float]) -> list[float]:
    """How many times the recentring bound each client gets: its weight, at most the largest other weight (so that
    no claim raises its own bound), over the lower median weight, and at least 1. Trained by whole epochs, a node
    with k times the examples takes k times the steps and sits farther from the round's median (drift's split: the
    3.84 × node at 2.8 × the lower median distance, the 2.53 × one at 2.6 ×); one bound for all cost that run 6.4
    points (simulations/results/robust-honest-drift-defaults)."""
    typical = statistics.median_low(weights)
    others = [max((w for j, w in enumerate(weights) if j != i), default=0.0) for i in range(len(weights))]
    return [max(1.0, min(w, other) / typical) if typical > 0 else 1.0 for w, other in zip(weights, others, strict=True)]


def _toward(state: State, center: Mapping[str, torch.Tensor], factor: float) -> State:
    """center + factor · (state − center), each tensor in its own dtype; ``state`` itself when factor is 1."""
    if factor == 1.0:
        return state
    return {k: (center[k].double() + factor * (v.double() - center[k].double())).to(v.dtype) for k, v in state.items()}


def _norm(state: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((v.double() ** 2).sum()) for v in state.values()))


def unclipped(states: Sequence[State]) -> Clipping:
    """No global model to measure against (round 1 of independent inits): every state as it is."""
    return Clipping(list(states), [1.0] * len(states), None)


def weighted_mean(states: Sequence[State], weights: Sequence[float]) -> State:
    """Σ w_i θ_i / Σ w_i in float64, each tensor back in its own dtype."""
    total = float(sum(weights))
    return {k: (functools.reduce(torch.add, [w * s[k].double() for s, w in zip(states, weights, strict=True)])
                / total).to(v.dtype) for k, v in states[0].items()}


def coordinatewise(states: Sequence[State], average: str, beta: float) -> State:
    """Flower's FedMedian (the median of every coordinate; the mean of the middle two for even n) or FedTrimmedAvg
    (the mean of every coordinate after cutting ``int(beta·n)`` values from each end), unweighted."""
    n = len(states)
    low, high = ((n - 1) // 2, n // 2 + 1) if average == "fedmedian" else (int(beta * n), n - int(beta * n))
    merged: State = {}
    for key, like in states[0].items():
        ordered = torch.stack([s[key].double() for s in states]).sort(dim=0).values
        merged[key] = ordered[low:high].mean(dim=0).to(like.dtype)
    return merged


def combine(states: Sequence[State], weights: Sequence[float], robust: Robustness) -> State:
    """The robust average of equal-width states: the weighted mean, FedMedian or FedTrimmedAvg."""
    if robust.weighted_mean:
        return weighted_mean(states, weights)
    return coordinatewise(states, robust.average, robust.trim_beta)
