"""Weight matching from several residual starts: how flat its objective is across the local optima it ends in,
and how far apart their barriers are. Uses the barrier benchmark's checkpoints (no training here).

    .venv/bin/python -m simulations.bench.weight_starts [--config simulations/bench/configs/barriers.toml]

Start 0 is the identity (what ``glmc align --method weight`` does); the others are Haar-random Q with Q·1 = 1.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import time
import tomllib
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Subset

from glmc import groups
from glmc.align import align_pair
from glmc.archs import get_arch
from glmc.barrier import barrier_curve
from glmc.canonical import canonicalize
from glmc.checkpoint import load_checkpoint
from glmc.match.weight import weight_match
from glmc.tasks import load_task
from glmc.transforms import apply
from simulations.bench.barriers import checkpoint, label, mean_se

RESULTS = Path("simulations/results/weight-starts")


def held_out(dataset: str, cfg: Any, limit: int) -> Dataset:
    """The first ``limit`` test samples, as the barrier benchmark measures them."""
    test = load_task(dataset, cfg).test
    return Subset(test, range(min(limit, len(test))))  # type: ignore[arg-type]


def pair_starts(a_path: Path, b_path: Path, dataset: str, limit: int, count: int, seed: int) -> dict[str, Any]:
    """The vanilla barrier, then weight matching from ``count`` starts: each one's objective, sweeps and barrier."""
    (native_a, meta), (native_b, _) = (load_checkpoint(p) for p in (a_path, b_path))
    cfg = meta.config
    arch, test = get_arch(cfg.family), held_out(dataset, cfg, limit)
    a, b = (canonicalize(arch, s, cfg.depth) for s in (native_a, native_b))
    generator = torch.Generator().manual_seed(seed)
    starts = []
    for index in range(count):
        q = None if index == 0 else groups.random_orthogonal(cfg.width, generator)
        result = weight_match(a, b, arch.spec, cfg.depth, cfg.heads, start=q)
        curve = barrier_curve(a, apply(b, arch.spec, result.transform, cfg.heads), cfg, test)
        starts.append({"start": index, "objective": result.objective[-1], "sweeps": len(result.objective),
                       "barrier": curve.barrier, "align_seconds": result.seconds})
        print(f"{a_path.stem} {b_path.stem} start {index}: objective {result.objective[-1]:.2f}, "
              f"barrier {curve.barrier:.3f}", flush=True)
    vanilla = align_pair(native_a, native_b, cfg, "none")
    vanilla_barrier = barrier_curve(vanilla.a, vanilla.b, cfg, test).barrier
    return {"pair": [a_path.stem, b_path.stem], "vanilla": vanilla_barrier, "starts": starts}


def pair_row(report: dict[str, Any]) -> dict[str, Any]:
    """One pair's spread: objective range (% of its minimum), barrier at the identity start, at the lowest
    objective, and the minimum, median and maximum over starts; Pearson correlation of objective and barrier."""
    starts = report["starts"]
    objectives, barriers = [s["objective"] for s in starts], [s["barrier"] for s in starts]
    best = min(starts, key=lambda s: s["objective"])
    return {"pair": " / ".join(report["pair"]), "vanilla": report["vanilla"],
            "objective_spread_pct": 100 * (max(objectives) - min(objectives)) / min(objectives),
            "identity": barriers[0], "lowest_objective": best["barrier"], "min": min(barriers),
            "median": statistics.median(barriers), "max": max(barriers),
            "correlation": statistics.correlation(objectives, barriers)}


def markdown(name: str, rows: list[dict[str, Any]], count: int, meta: str) -> list[str]:
    """The per-pair table and the mean ratios to vanilla of each choice of start."""
    lines = [f"## {name}: {count} starts per pair", "",
             "| pair | vanilla | objective spread | identity start | lowest objective | min | median | max | "
             "corr(objective, barrier) |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['pair']} | {r['vanilla']:.3f} | {r['objective_spread_pct']:.2f}% | {r['identity']:.3f} | "
              f"{r['lowest_objective']:.3f} | {r['min']:.3f} | {r['median']:.3f} | {r['max']:.3f} | "
              f"{r['correlation']:+.2f} |" for r in rows]
    lines += ["", "Mean barrier ÷ vanilla over the pairs (± s.e.):", ""]
    for key, what in (("identity", "identity start (the default)"), ("lowest_objective", "lowest objective of the "
                      "starts (data-free choice)"), ("median", "median start"), ("min", "best start by barrier "
                      "(needs held-out data: an oracle)")):
        ratio, se = mean_se([r[key] / r["vanilla"] for r in rows])
        lines.append(f"- {what}: {100 * ratio:.1f}% ± {100 * se:.1f}")
    return [*lines, "", meta, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="simulations/bench/configs/barriers.toml")
    args = parser.parse_args(argv)
    config = tomllib.loads(Path(args.config).read_text())
    run, starts = config["run"], config["starts"]
    torch.set_num_threads(run["threads"])
    began, lines, results = time.perf_counter(), ["# Weight matching from several residual starts", ""], {}
    for model in (m for m in config["models"] if label(m) in starts["models"]):
        limit = model.get("run", {}).get("limit", run["limit"])
        paths = [checkpoint(Path(run["out"]), label(model), s) for s in model["seeds"]]
        if missing := [str(p) for p in paths if not p.is_file()]:
            raise SystemExit(f"missing checkpoints (run simulations.bench.barriers first): {', '.join(missing)}")
        reports = [pair_starts(a, b, model["dataset"], limit, starts["count"], starts["seed"])
                   for a, b in itertools.combinations(paths, 2)]
        rows = [pair_row(r) for r in reports]
        results[label(model)] = {"reports": reports, "rows": rows}
        meta = (f"Barriers on the first {limit} test samples, 21 λ values; weight matching as `glmc align --method "
                f"weight` (15 sweeps at most, tolerance 1e-3), random starts seeded {starts['seed']}.")
        lines += markdown(label(model), rows, starts["count"], meta)
    lines.append(f"Command: `python -m simulations.bench.weight_starts --config {args.config}`. Machine: "
                 f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, torch "
                 f"{torch.__version__}, {run['threads']} thread(s); wall time {time.perf_counter() - began:.0f} s.")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "summary.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "results.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
