"""Pairwise barriers with REPAIR at every point of the path (Jordan et al., 2022), next to the same pairs without it.
Uses the barrier benchmark's checkpoints (no training here) and its config's ``[repair]`` table.

    .venv/bin/python -m simulations.analyses.repair_barriers [--config simulations/bench/configs/barriers.toml]
        [--models NAME ...]

Each pair runs ``glmc barrier`` twice on the current checkpoints, once plain and once with ``--repair N`` (both
cached under the bench's ``out``), so the two are measured on the same files. Each model's entry is added to
results.json when it ends.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

from glmc.merging.interpolation import BarrierCurve
from glmc.plots import plot_barrier_curves
from simulations.bench.barriers import machine, pair_barriers, seed_checkpoints, summarise, table_main

RESULTS = Path("simulations/results/barriers-repair")


def pair_curves(run: dict[str, Any], repair: dict[str, Any], model: dict[str, Any], a: Path, b: Path,
                ) -> dict[str, dict[str, Any]]:
    """The pair's curves by name: each method plain, then each REPAIRed (``METHOD+repair``)."""
    plain = pair_barriers(run, model, a, b, repair["methods"], [], "_repair-plain")["curves"]
    repaired = pair_barriers(run, model, a, b, repair["methods"], ["--repair", str(repair["samples"])],
                             "_repair")["curves"]
    return {c["method"]: c for c in [*plain, *repaired]}


def measure_model(run: dict[str, Any], repair: dict[str, Any], model: dict[str, Any], command: str) -> dict[str, Any]:
    """Every pair of one model's seeds, plain and REPAIRed, with the settings and wall time."""
    began = time.perf_counter()
    settings = run | model.get("run", {})  # a model may override run settings such as limit
    paths = seed_checkpoints(run, model)
    pairs = [pair_curves(settings, repair, model, a, b) for a, b in itertools.combinations(paths, 2)]
    rows = summarise(model, [{"curves": list(p.values())} for p in pairs], list(pairs[0]))
    return {"pairs": [[p.stem for p in pair] for pair in itertools.combinations(paths, 2)], "curves": pairs,
            "rows": rows, "samples": repair["samples"], "limit": settings["limit"],
            "points": settings["points"], "command": command, "machine": machine(),
            "seconds": time.perf_counter() - began}


def markdown(name: str, entry: dict[str, Any]) -> list[str]:
    """One model's table and how it was run."""
    lines = [f"## {name}", "", "| curve | pairs | barrier | ÷ vanilla | midpoint acc |", "|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['pairs']} | {r['barrier']:.3f} ± {r['barrier_se']:.3f} | "
              f"{100 * r['ratio_to_vanilla']:.1f}% ± {100 * r['ratio_se']:.1f} | {r['midpoint_accuracy']:.3f} |"
              for r in entry["rows"]]
    per_pair = "; ".join(f"{' / '.join(pair)}: " + ", ".join(f"{k} {c['barrier']:.3f}" for k, c in curves.items())
                         for pair, curves in zip(entry["pairs"], entry["curves"], strict=True))
    return [*lines, "", f"Per pair: {per_pair}.", "",
            f"REPAIR on the first {entry['samples']} of a seeded draw of the training split (inputs only); barriers "
            f"on the first {entry['limit']} test samples, {entry['points']} λ values. Command: `{entry['command']}`. "
            f"Machine: {entry['machine']}; wall time {entry['seconds'] / 60:.1f} min.", ""]


HEADING = ["# Barriers with REPAIR along the path", "",
           "`glmc barrier --repair N`: every θ(λ) = λ θ_A + (1−λ) θ_B is REPAIRed before it is evaluated: each MLP "
           "pre-activation and residual-writer channel is reset to the λ-mean of A's and B's mean and std (Jordan et "
           "al., 2022). Both ends stay A and B, so the barrier keeps its definition. ÷ vanilla divides by the plain "
           "`none` barrier of the same pair.", ""]


def plot(name: str, entry: dict[str, Any]) -> None:
    """The curves of the model's first pair."""
    fields = BarrierCurve.__dataclass_fields__
    curves = [BarrierCurve(**{k: c[k] for k in fields}) for c in entry["curves"][0].values()]
    plot_barrier_curves(curves, RESULTS / f"curves_{name}.png", f"{name}: {' vs '.join(entry['pairs'][0])}")


def main(argv: list[str] | None = None) -> int:
    return table_main(argv, "repair", "simulations.analyses.repair_barriers", __doc__.splitlines()[0], measure_model,
                      RESULTS, HEADING, markdown, plot)


if __name__ == "__main__":
    raise SystemExit(main())
