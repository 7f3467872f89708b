"""Figures: barrier curves (loss and accuracy along λ, one line per method)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from glmc.barrier import BarrierCurve


def plot_barrier_curves(curves: Sequence[BarrierCurve], path: str | Path, title: str = "") -> Path:
    """Loss and accuracy against λ (λ=0 is B, λ=1 is A), one curve per alignment method."""
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for curve in curves:
        label = f"{curve.method} (barrier {curve.barrier:.3f})"
        ax_loss.plot(curve.lambdas, curve.losses, marker="o", ms=3, label=label)
        ax_acc.plot(curve.lambdas, curve.accuracies, marker="o", ms=3, label=curve.method)
    ax_loss.set(xlabel="λ", ylabel="test loss", title="loss along λθ_A + (1−λ)θ_B")
    ax_acc.set(xlabel="λ", ylabel="test accuracy", title="accuracy")
    ax_loss.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
