"""Pairwise barriers with REPAIR at every point of the path (Jordan et al., 2022), next to the same pairs without it.
Uses the barrier benchmark's checkpoints (no training here) and its config's ``[repair]`` table.

    .venv/bin/python -m simulations.bench.repair_barriers [--config simulations/bench/configs/barriers.toml]
        [--models NAME ...]

Each pair runs ``glmc barrier`` twice on the current checkpoints, once plain and once with ``--repair N`` (both
cached under the bench's ``out``), so the two are measured on the same files. Each model's entry is added to
results.json when it ends.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from glmc.barrier import BarrierCurve
from glmc.plots import plot_barrier_curves
from simulations.bench.barriers import checkpoint, label, mean_se, pair_barriers, previous_results, results_lock
from simulations.tomlfile import config_or_exit

RESULTS = Path("simulations/results/barriers-repair")


def pair_curves(run: dict[str, Any], repair: dict[str, Any], model: dict[str, Any], a: Path, b: Path,
                ) -> dict[str, dict[str, Any]]:
    """The pair's curves by name: each method plain, then each REPAIRed (``METHOD+repair``)."""
    plain = pair_barriers(run, model, a, b, repair["methods"], [], "_repair-plain")["curves"]
    repaired = pair_barriers(run, model, a, b, repair["methods"], ["--repair", str(repair["samples"])],
                             "_repair")["curves"]
    return {c["method"]: c for c in [*plain, *repaired]}


def summary_rows(name: str, pairs: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per curve name: barrier and its ratio to the plain vanilla barrier (mean ± s.e. over pairs), and
    the midpoint accuracy."""
    rows = []
    for curve in pairs[0]:
        barrier, se = mean_se([p[curve]["barrier"] for p in pairs])
        ratio, ratio_se = mean_se([p[curve]["barrier"] / p["none"]["barrier"] for p in pairs])
        mid, _ = mean_se([p[curve]["accuracies"][len(p[curve]["lambdas"]) // 2] for p in pairs])
        rows.append({"model": name, "curve": curve, "pairs": len(pairs), "barrier": barrier, "barrier_se": se,
                     "ratio_to_vanilla": ratio, "ratio_se": ratio_se, "midpoint_accuracy": mid})
    return rows


def measure_model(run: dict[str, Any], repair: dict[str, Any], model: dict[str, Any], command: str) -> dict[str, Any]:
    """Every pair of one model's seeds, plain and REPAIRed, with the settings and wall time."""
    began = time.perf_counter()
    settings = run | model.get("run", {})  # a model may override run settings such as limit
    paths = [checkpoint(Path(run["out"]), label(model), s) for s in model["seeds"]]
    if missing := [str(p) for p in paths if not p.is_file()]:
        raise SystemExit(f"missing checkpoints (run simulations.bench.barriers first): {', '.join(missing)}")
    pairs = [pair_curves(settings, repair, model, a, b) for a, b in itertools.combinations(paths, 2)]
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, torch "
               f"{torch.__version__}, {torch.get_num_threads()} thread(s)")
    return {"pairs": [[p.stem for p in pair] for pair in itertools.combinations(paths, 2)], "curves": pairs,
            "rows": summary_rows(label(model), pairs), "samples": repair["samples"], "limit": settings["limit"],
            "points": settings["points"], "command": command, "machine": machine,
            "seconds": time.perf_counter() - began}


def markdown(name: str, entry: dict[str, Any]) -> list[str]:
    """One model's table and how it was run."""
    lines = [f"## {name}", "", "| curve | pairs | barrier | ÷ vanilla | midpoint acc |", "|---|---|---|---|---|"]
    lines += [f"| {r['curve']} | {r['pairs']} | {r['barrier']:.3f} ± {r['barrier_se']:.3f} | "
              f"{100 * r['ratio_to_vanilla']:.1f}% ± {100 * r['ratio_se']:.1f} | {r['midpoint_accuracy']:.3f} |"
              for r in entry["rows"]]
    per_pair = "; ".join(f"{' / '.join(pair)}: " + ", ".join(f"{k} {c['barrier']:.3f}" for k, c in curves.items())
                         for pair, curves in zip(entry["pairs"], entry["curves"], strict=True))
    return [*lines, "", f"Per pair: {per_pair}.", "",
            f"REPAIR on the first {entry['samples']} of a seeded draw of the training split (inputs only); barriers "
            f"on the first {entry['limit']} test samples, {entry['points']} λ values. Command: `{entry['command']}`. "
            f"Machine: {entry['machine']}; wall time {entry['seconds'] / 60:.1f} min.", ""]


def write(out: Path, name: str, entry: dict[str, Any], order: list[str]) -> None:
    """Add one model's entry to results.json (under the barrier bench's lock), rewrite summary.md from every model
    stored, and plot the model's first pair."""
    with results_lock(out):
        results = previous_results(RESULTS) | {name: entry}
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "results.json").write_text(json.dumps(results, indent=1))
    names = sorted(results, key=lambda n: order.index(n) if n in order else len(order))
    lines = ["# Barriers with REPAIR along the path", "",
             "`glmc barrier --repair N`: every θ(λ) = λ θ_A + (1−λ) θ_B is REPAIRed before it is evaluated: each "
             "MLP pre-activation and residual-writer channel is reset to the λ-mean of A's and B's mean and std "
             "(Jordan et al., 2022). Both ends stay A and B, so the barrier keeps its definition. ÷ vanilla divides "
             "by the plain `none` barrier of the same pair.", ""]
    for model in names:
        lines += markdown(model, results[model])
    (RESULTS / "summary.md").write_text("\n".join(lines))
    fields = BarrierCurve.__dataclass_fields__
    curves = [BarrierCurve(**{k: c[k] for k in fields}) for c in entry["curves"][0].values()]
    plot_barrier_curves(curves, RESULTS / f"curves_{name}.png", f"{name}: {' vs '.join(entry['pairs'][0])}")
    print("\n".join(markdown(name, entry)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="simulations/bench/configs/barriers.toml")
    parser.add_argument("--models", nargs="+", help="measure only these of the config's [repair] models")
    args = parser.parse_args(argv)
    config = config_or_exit(parser, args.config)
    run, repair = config["run"], config["repair"]
    torch.set_num_threads(run["threads"])
    wanted = args.models or repair["models"]
    if unknown := sorted(set(wanted) - set(repair["models"])):
        raise SystemExit(f"not in [repair] models of {args.config}: {', '.join(unknown)}")
    command = " ".join(["python -m simulations.bench.repair_barriers", *(argv if argv is not None else sys.argv[1:])])
    for model in (m for m in config["models"] if label(m) in wanted):
        write(Path(run["out"]), label(model), measure_model(run, repair, model, command), repair["models"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
