"""Loss barriers along linear paths (paper Eq. 1).

θ(λ) = λ θ_A + (1−λ) θ_B, and B(λ) = L(θ(λ)) − [λ L(θ_A) + (1−λ) L(θ_B)]; the barrier is max_λ B(λ)
over a grid, measured on held-out data. One model is built once and each θ(λ) is made into it tensor by tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from glmc.archs import get_arch
from glmc.core.config import ModelConfig
from glmc.core.state import cast, mix, mixture
from glmc.errors import ConfigError
from glmc.merging.circuits import merge_circuits, require_circuit_layout
from glmc.merging.repair import RepairTarget
from glmc.symmetry.canonical import Form, empty_model, load_canonical
from glmc.train import evaluate


def evaluate_mixtures(states: Sequence[Mapping[str, torch.Tensor]], grid: Sequence[Sequence[float]],
                      cfg: ModelConfig, data: Dataset, batch_size: int = 256, form: Form = "standard",
                      dtype: torch.dtype | None = None, repair_data: Dataset | None = None,
                      progress: bool | None = None, circuit_heads: bool = False) -> tuple[list[float], list[float]]:
    """Loss and accuracy of Σ w_i θ_i on ``data`` for every weight vector w of ``grid``, in ``dtype`` (default: the
    states' own); one model is built once and each point is made into it tensor by tensor
    (:func:`glmc.core.state.mixture`), so :class:`glmc.core.state.Lazy` states are never held whole and the path
    holds one model. With ``circuit_heads``, each mixture's heads are refitted to the w-mean of the states' circuits
    (:func:`glmc.merging.circuits.merge_circuits`); with ``repair_data`` (training samples), each mixture is then
    REPAIRed to the w-mean of the states' channel statistics on all of them: both read every tensor of every state
    at each point, so there the states are cast to ``dtype`` and each point is made whole. ``progress``: a bar with
    the time left, on stderr (None: when stderr is a terminal)."""
    if repair_data is not None and form != "standard":
        raise ConfigError(f"REPAIR needs the standard form, not {form!r}")
    if circuit_heads:
        require_circuit_layout(cfg, form)
    whole = circuit_heads or repair_data is not None
    if dtype is not None and whole:
        states = [cast(s, dtype) for s in states]
    target = RepairTarget.measure(states, cfg, repair_data) if repair_data is not None else None
    first = states[0][next(iter(states[0]))]
    model, arch = empty_model(cfg, form, first.device, dtype or first.dtype), get_arch(cfg.family)
    losses, accuracies = [], []
    for weights in tqdm(grid, desc="evaluate", unit="point", disable=None if progress is None else not progress,
                        dynamic_ncols=True):
        point = _whole_point(states, weights, cfg, circuit_heads, target) if whole else \
            mixture(states, weights, dtype)
        load_canonical(model, point, cfg)
        metrics = evaluate(model, arch, data, batch_size)
        losses.append(metrics["loss"])
        accuracies.append(metrics["accuracy"])
    return losses, accuracies


def _whole_point(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float], cfg: ModelConfig,
                 circuit_heads: bool, target: RepairTarget | None) -> Mapping[str, torch.Tensor]:
    """Σ w_i θ_i made whole, its heads refitted as circuits where ``circuit_heads``, then REPAIRed to ``target``."""
    mixed = mix(states, weights)
    if circuit_heads:
        mixed = merge_circuits(mixed, states, cfg, weights)
    return target.repair(mixed, weights) if target else mixed


@dataclass
class BarrierCurve:
    """Loss and accuracy along the path, the barrier curve B(λ), and its maximum."""

    lambdas: list[float]
    losses: list[float]
    accuracies: list[float]
    barriers: list[float]
    barrier: float
    method: str = ""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def linear_barriers(lambdas: list[float], losses: list[float]) -> list[float]:
    """B(λ) = L(λ) − [λ L(1) + (1−λ) L(0)]; λ=1 is A and λ=0 is B, so both ends are 0 by construction."""
    loss_b, loss_a = losses[lambdas.index(0.0)], losses[lambdas.index(1.0)]
    return [loss - (lam * loss_a + (1 - lam) * loss_b) for lam, loss in zip(lambdas, losses, strict=True)]


def barrier_curve(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], cfg: ModelConfig, data: Dataset,
    points: int = 21, batch_size: int = 256, form: Form = "standard", method: str = "",
    dtype: torch.dtype | None = None, repair_data: Dataset | None = None, circuit_heads: bool = False,
) -> BarrierCurve:
    """Evaluate θ(λ) on ``data`` at ``points`` evenly spaced λ in [0, 1] (both ends included), in ``dtype``
    (default: the states' own; the tools evaluate in float32, as the models run); with ``circuit_heads``, each
    θ(λ)'s heads refitted to the λ-mean of the circuits, and with ``repair_data``, each θ(λ) REPAIRed (Jordan et
    al., 2022): both leave the ends as the functions they are."""
    lambdas = [i / (points - 1) for i in range(points)]
    losses, accuracies = evaluate_mixtures((a, b), [(lam, 1.0 - lam) for lam in lambdas], cfg, data, batch_size,
                                           form, dtype, repair_data, circuit_heads=circuit_heads)
    barriers = linear_barriers(lambdas, losses)
    return BarrierCurve(lambdas, losses, accuracies, barriers, max(barriers), method)
