"""The figures that judge a merge: each model's own metrics, the merged model's, the logit-averaging ensemble's, the
multi-model barrier over a simplex grid (paper Eq. 2) and, across widths, each narrow model's pairwise barrier
to the wide one (paper Fig. 3c).

Eq. 2: B(θ_1..θ_N) = max_w L(Σ_i w_i θ_i) − Σ_i w_i L(θ_i) over the simplex; here over the grid of weights
that are multiples of 1/steps, evaluated on held-out data like the pairwise barrier.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from glmc.archs import Arch, get_arch
from glmc.core.config import ModelConfig
from glmc.core.state import cast
from glmc.device import resolve, to_device
from glmc.errors import ConfigError
from glmc.merging.interpolation import barrier_curve, evaluate_mixtures
from glmc.merging.merge import MergeSetup, align_to_wide, reference_of
from glmc.merging.universe import UniverseResult
from glmc.symmetry.canonical import canonicalize, to_model
from glmc.train import evaluate


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Every way to write ``total`` as an ordered sum of ``parts`` non-negative integers."""
    if parts == 1:
        return [(total,)]
    return [(first, *rest) for first in range(total, -1, -1) for rest in _compositions(total - first, parts - 1)]


def simplex_grid(n: int, steps: int) -> list[tuple[float, ...]]:
    """Every weight vector on the (n−1)-simplex whose entries are multiples of 1/steps (vertices included)."""
    return [tuple(c / steps for c in counts) for counts in _compositions(steps, n)]


def grid_steps(n: int, max_points: int) -> int:
    """The finest grid of at most ``max_points`` weights on the simplex of n models, and never coarser than 1/2.

    A simplex needs two models at least: with one, every grid is a single point and no grid would ever be too fine.
    """
    if n < 2:
        raise ConfigError(f"a simplex grid needs at least 2 models, got {n}")
    steps = 2
    while math.comb(steps + n, n - 1) <= max_points:
        steps += 1
    return steps


@dataclass
class SimplexBarrier:
    """Loss and accuracy at every grid weight, B(w) = L(Σ w_i θ_i) − Σ w_i L(θ_i), and its maximum (Eq. 2)."""

    weights: list[tuple[float, ...]]
    losses: list[float]
    accuracies: list[float]
    barriers: list[float]
    barrier: float
    method: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def simplex_barrier(states: Sequence[Mapping[str, torch.Tensor]], cfg: ModelConfig, data: Dataset, steps: int,
                    batch_size: int = 256, method: str = "", dtype: torch.dtype | None = None) -> SimplexBarrier:
    """Evaluate Σ w_i θ_i on ``data`` over :func:`simplex_grid`, in ``dtype`` (default: the states' own)."""
    grid = simplex_grid(len(states), steps)
    losses, accuracies = evaluate_mixtures(states, grid, cfg, data, batch_size, dtype=dtype)
    vertex = [losses[grid.index(tuple(float(i == j) for j in range(len(states))))] for i in range(len(states))]
    barriers = [loss - sum(wi * li for wi, li in zip(w, vertex, strict=True)) for w, loss in zip(grid, losses,
                                                                                                 strict=True)]
    return SimplexBarrier(grid, losses, accuracies, barriers, max(barriers), method)


def mean_logits(models: Iterable[nn.Module], arch: Arch, x: torch.Tensor) -> torch.Tensor:
    """The mean of the models' logits on ``x`` (the logit-averaging ensemble's), each model at its own width."""
    return torch.stack([arch.logits(m, x) for m in models]).mean(0)


class LogitEnsemble(nn.Module):
    """The mean of several models' logits, each model at its own width."""

    def __init__(self, models: Sequence[nn.Module], arch: Arch) -> None:
        super().__init__()
        self.members, self.arch = nn.ModuleList(models), arch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mean_logits(self.members, self.arch, x)


class LoadedEnsemble(nn.Module):
    """:class:`LogitEnsemble` of stored native models (any dtype), each loaded in turn, on every batch, into the one
    float32 module of its config: the same logits, holding one float32 model per width instead of one per input."""

    def __init__(self, natives: Sequence[Mapping[str, torch.Tensor]], configs: Sequence[ModelConfig], arch: Arch,
                 device: torch.device) -> None:
        super().__init__()
        kinds = list(dict.fromkeys(configs))
        self.natives, self.arch, self.shell_of = natives, arch, [kinds.index(c) for c in configs]
        self.shells = nn.ModuleList(arch.build(c).to(device).eval() for c in kinds)

    def loaded(self) -> Iterator[nn.Module]:
        """Each input in turn, as a module: its config's shell holding its weights until the next one is loaded."""
        for native, shell in zip(self.natives, self.shell_of, strict=True):
            self.shells[shell].load_state_dict(native)
            yield self.shells[shell]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mean_logits(self.loaded(), self.arch, x)


class PredictionMixture(nn.Module):
    """Σ_i w_i softmax(f_i(x)): several models' predicted probabilities mixed by fixed weights (normalised), each
    model at its own width; the soft targets a model is distilled to (:func:`glmc.train.train`'s ``teacher``)."""

    def __init__(self, models: Sequence[nn.Module], arch: Arch, weights: Sequence[float]) -> None:
        super().__init__()
        if not models or len(weights) != len(models) or min(weights) < 0 or sum(weights) <= 0:
            raise ConfigError(f"a prediction mixture needs one non-negative weight per model, some positive; got "
                              f"{len(models)} models and weights {list(weights)}")
        self.members, self.arch = nn.ModuleList(models), arch
        self.weights = [w / sum(weights) for w in weights]

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = [w * self.arch.logits(m, x).float().softmax(-1) for w, m in zip(self.weights, self.members,
                                                                                 strict=True)]
        return torch.stack(mixed).sum(0)


def ensemble_metrics(models: Sequence[nn.Module] | LoadedEnsemble, arch: Arch, data: Dataset, batch_size: int = 256,
                     ) -> dict[str, float]:
    """Loss and accuracy of the logit-averaging ensemble of ``models`` (or of one made already), through the same
    :func:`glmc.train.evaluate`."""
    plain = dataclasses.replace(arch, logits=lambda model, x: model(x))
    ensemble = models if isinstance(models, LoadedEnsemble) else LogitEnsemble(models, arch)
    return evaluate(ensemble, plain, data, batch_size)


def width_barriers(natives: Sequence[Mapping[str, torch.Tensor]], configs: Sequence[ModelConfig], setup: MergeSetup,
                   test: Dataset, points: int = 21) -> list[dict[str, Any]]:
    """Pairwise barrier between the wide reference and each narrower model, embedded and aligned to it (Fig. 3c)."""
    ref = reference_of(configs, setup.target)
    if configs[ref] != setup.target:
        return []
    wide = canonicalize(get_arch(setup.target.family), to_device(natives[ref], setup.options.device),
                        setup.target, dtype=torch.float64)
    rows = []
    for i, cfg in enumerate(configs):
        if cfg == setup.target:
            continue
        pair = align_to_wide(wide, natives[i], cfg, setup)
        curve = barrier_curve(wide, pair.aligned[0], setup.target, test, points, method=setup.options.method,
                              dtype=torch.float32)
        rows.append({"input": i, "width": cfg.width, "barrier": curve.barrier, "curve": curve.to_dict(),
                     "align_seconds": pair.seconds})
    return rows


def evaluate_merge(result: UniverseResult, natives: Sequence[Mapping[str, torch.Tensor]],
                   configs: Sequence[ModelConfig], setup: MergeSetup, test: Dataset, steps: int,
                   ) -> dict[str, Any]:
    """Each input's test metrics, the merged model's, the ensemble's and the simplex barrier of the aligned models.
    The inputs and the ensemble are run one float32 model at a time (:class:`LoadedEnsemble`)."""
    arch = get_arch(setup.target.family)
    ensemble = LoadedEnsemble(natives, configs, arch, resolve(setup.options.device))
    inputs = [evaluate(m, arch, test) for m in ensemble.loaded()]
    mixed = ensemble_metrics(ensemble, arch, test)
    del ensemble  # its float32 shells, before the merged model and the simplex's mixtures are built
    merged = evaluate(to_model(cast(result.merged, torch.float32), setup.target), arch, test)
    simplex = simplex_barrier(result.aligned, setup.target, test, steps, method=setup.options.method,
                              dtype=torch.float32)
    return {"inputs": inputs, "merged": merged, "ensemble": mixed, "simplex": simplex.to_dict()}
