"""Figures: barrier curves (loss and accuracy along λ, one line per method) and simplex heat maps."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from glmc.merging.interpolation import BarrierCurve


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


def plot_simplex(panels: Sequence[tuple[str, Sequence[Sequence[float]], Sequence[float]]], path: str | Path,
                 names: Sequence[str] = ("A", "B", "C")) -> Path:
    """Test loss over the simplex of three models A, B, C (``names``), one triangle per method (paper Fig. 4).

    Each panel is (method label, grid weights (w_A, w_B, w_C), loss at Σ w_i θ_i); one colour scale for all.
    """
    import matplotlib.tri as mtri

    corners = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.5, 3**0.5 / 2]])
    lo = min(min(losses) for _, _, losses in panels)
    hi = max(max(losses) for _, _, losses in panels)
    levels = torch.linspace(lo, hi + 1e-9, 25).tolist()  # one scale for every panel
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4), squeeze=False)
    for ax, (name, weights, losses) in zip(axes[0], panels, strict=True):
        xy = torch.tensor(weights, dtype=torch.float32) @ corners
        tri = mtri.Triangulation(xy[:, 0].numpy(), xy[:, 1].numpy())
        shade = ax.tricontourf(tri, list(losses), levels=levels, cmap="viridis")
        for corner, label in zip(corners.tolist(), "ABC", strict=True):
            ax.annotate(label, corner, ha="center", va="top" if corner[1] == 0 else "bottom", fontsize=11)
        ax.set(title=name, aspect="equal", xlim=(-0.08, 1.08), ylim=(-0.1, 0.97))
        ax.axis("off")
    fig.colorbar(shade, ax=axes[0].tolist(), shrink=0.8, label="test loss")
    fig.suptitle("   ".join(f"{letter}: {name}" for letter, name in zip("ABC", names, strict=True)), fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
