"""Loss barriers along linear paths (paper Eq. 1).

θ(λ) = λ θ_A + (1−λ) θ_B, and B(λ) = L(θ(λ)) − [λ L(θ_A) + (1−λ) L(θ_B)]; the barrier is max_λ B(λ)
over a grid, measured on held-out data. One model is built once and reloaded at each λ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from glmc.archs import get_arch
from glmc.core.config import ModelConfig
from glmc.core.state import cast, mix
from glmc.errors import ConfigError
from glmc.merging.circuits import merge_circuits, require_circuit_layout
from glmc.merging.repair import RepairTarget
from glmc.symmetry.canonical import Form, to_model
from glmc.train import evaluate


def evaluate_mixtures(states: Sequence[Mapping[str, torch.Tensor]], grid: Sequence[Sequence[float]],
                      cfg: ModelConfig, data: Dataset, batch_size: int = 256, form: Form = "standard",
                      dtype: torch.dtype | None = None, repair_data: Dataset | None = None,
                      progress: bool | None = None, circuit_heads: bool = False) -> tuple[list[float], list[float]]:
    """Loss and accuracy of Σ w_i θ_i on ``data`` for every weight vector w of ``grid``, in ``dtype`` (default: the
    states' own); one model is built once and reloaded at each point. With ``circuit_heads``, each mixture's heads
    are refitted to the w-mean of the states' circuits (:func:`glmc.merging.circuits.merge_circuits`); with
    ``repair_data`` (training samples), each mixture is then REPAIRed to the w-mean of the states' channel
    statistics on all of them. ``progress``: a bar with the time left, on stderr (None: when stderr is a terminal)."""
    if repair_data is not None and form != "standard":
        raise ConfigError(f"REPAIR needs the standard form, not {form!r}")
    if circuit_heads:
        require_circuit_layout(cfg, form)
    arch = get_arch(cfg.family)
    if dtype is not None:
        states = [cast(s, dtype) for s in states]
    target = RepairTarget.measure(states, cfg, repair_data) if repair_data is not None else None
    model = to_model(states[0], cfg, form)
    losses, accuracies = [], []
    for weights in tqdm(grid, desc="evaluate", unit="point", disable=None if progress is None else not progress,
                        dynamic_ncols=True):
        mixed = mix(states, weights)
        if circuit_heads:
            mixed = merge_circuits(mixed, states, cfg, weights)
        model.load_state_dict(arch.to_native(target.repair(mixed, weights) if target else mixed, cfg))
        metrics = evaluate(model, arch, data, batch_size)
        losses.append(metrics["loss"])
        accuracies.append(metrics["accuracy"])
    return losses, accuracies


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
