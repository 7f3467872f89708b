"""Accuracy-against-round figures, shared by a run's own outputs and the comparison harness."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

Point = tuple[int, float | None]


def plot_curves(curves: Mapping[str, Sequence[Point]], path: Path, title: str = "",
                bands: Mapping[str, Sequence[float]] | None = None, ylabel: str = "test accuracy") -> Path:
    """One line per curve (points with a None value are skipped); ``bands`` adds ±s.e. shading per curve."""
    # A bare Figure on the Agg canvas: no pyplot, so no global backend switch inside the ServerApp.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, points in curves.items():
        kept = [(x, y) for x, y in points if y is not None]
        if not kept:
            continue
        xs, ys = zip(*kept, strict=True)
        ax.plot(xs, ys, marker="o", ms=3, label=name)
        if bands and name in bands:
            err = [e for (_, y), e in zip(points, bands[name], strict=True) if y is not None]
            ax.fill_between(xs, [y - e for y, e in zip(ys, err, strict=True)],
                            [y + e for y, e in zip(ys, err, strict=True)], alpha=0.2)
    ax.set(xlabel="round", ylabel=ylabel, title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
