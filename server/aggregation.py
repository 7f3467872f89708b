"""The strategy's one aggregation step: client state dicts in, one global state dict out.

``merge`` is the only place that knows how models are combined, so the strategy never branches
on the method. ``fedavg`` is handled by the strategy itself (flwr's own FedAvg code path); every
other method canonicalises (LayerNorms folded), aligns every client into the basin of an anchor
(the previous global model) with the chosen matching, iterates anchor = weighted mean, and takes
the example-weighted mean of the aligned models (architecture.md, "The path the data takes").
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from glmc.align import METHODS, align_pair
from glmc.archs import ModelConfig, State, get_arch
from glmc.canonical import canonicalize
from glmc.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MergeResult:
    """The merged native state (float32) and what it cost and achieved."""

    state: State
    align_seconds: float
    distance_before: float  # mean pairwise ‖θ_i − θ_j‖ of the canonical client models
    distance_after: float  # the same after alignment


def check_method(method: str) -> None:
    """Fail at start-up, not in round 1, if ``method`` has no matching behind it."""
    if method != "fedavg" and method not in METHODS:
        raise ConfigError(f"aggregation {method!r} is not available; glmc.align offers {', '.join(METHODS)}")


def weighted_mean(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> State:
    """Σ_i w_i θ_i / Σ_i w_i, key by key."""
    total = float(sum(weights))
    return {key: sum(w / total * s[key] for s, w in zip(states, weights, strict=True)) for key in states[0]}


def mean_pairwise_distance(states: Sequence[Mapping[str, torch.Tensor]]) -> float:
    """Mean over client pairs of ‖θ_i − θ_j‖ (0 for a single client)."""
    pairs = list(itertools.combinations(states, 2))
    if not pairs:
        return 0.0
    return sum(float(sum(((a[k] - b[k]) ** 2).sum() for k in a)) ** 0.5 for a, b in pairs) / len(pairs)


def canonical_distance(states: Sequence[Mapping[str, torch.Tensor]], cfg: ModelConfig) -> float:
    """Mean pairwise distance of native states in canonical form (LayerNorms folded), as alignment sees them."""
    arch = get_arch(cfg.family)
    return mean_pairwise_distance([canonicalize(arch, s, cfg.depth, dtype=torch.float64) for s in states])


def merge(states: Sequence[State], weights: Sequence[float], cfg: ModelConfig, method: str, *,
          anchor: State | None, data: Dataset | None = None, iters: int = 1) -> MergeResult:
    """Align every client to ``anchor`` (default: the heaviest client), then anchor = mean; ``iters`` times.

    ``states``: native state dicts of one config; ``data``: the server-held batch for data-driven methods.
    """
    arch = get_arch(cfg.family)
    reference = anchor if anchor is not None else states[max(range(len(states)), key=lambda i: weights[i])]
    before = canonical_distance(states, cfg)
    start = time.perf_counter()
    for step in range(iters):
        aligned = [align_pair(reference, s, cfg, method, data=data, batch=_batch(data)).b for s in states]
        merged = weighted_mean(aligned, weights)
        reference = arch.to_native(merged, cfg.depth)
        log.info("alignment iteration %d/%d done after %.1f s", step + 1, iters, time.perf_counter() - start)
    seconds = time.perf_counter() - start
    native = {k: v.to(torch.float32) for k, v in reference.items()}
    return MergeResult(native, seconds, before, mean_pairwise_distance(aligned))


def _batch(data: Dataset | None) -> int:
    return len(data) if data is not None else 0  # type: ignore[arg-type]
