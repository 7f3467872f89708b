"""Weight matching from several residual starts: how flat its objective is across the local optima it ends in,
and how far apart their barriers are. Uses the barrier benchmark's checkpoints (no training here).

    .venv/bin/python -m simulations.analyses.weight_starts [--config simulations/bench/configs/barriers.toml]
        [--models NAME ...]

Each model's entry is added to results.json when it ends, so models can run one per process, in parallel.

Start 0 is the identity (``--start identity``), start 1 the relaxed start (``--start relaxed``, glmc's default);
the others are Haar-random Q with Q·1 = 1.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from glmc.archs import get_arch
from glmc.cli.options import parse_match_flags
from glmc.core.config import ModelConfig
from glmc.core.state import State
from glmc.data.tasks import held_out
from glmc.io.checkpoint import load_checkpoint
from glmc.match.align import align_pair
from glmc.match.options import Start, WeightOptions
from glmc.match.weight import weight_match
from glmc.merging.interpolation import barrier_curve
from glmc.symmetry import groups
from glmc.symmetry.canonical import canonicalize
from glmc.symmetry.transforms import apply
from simulations.bench.barriers import machine, mean_se, seed_checkpoints, table_main

RESULTS = Path("simulations/results/weight-starts")
NAMED: tuple[Start, ...] = ("identity", "relaxed", "embeddings")  # starts 0, 1 and 2; the rest are random maps


def barrier(a: State, b: State, cfg: ModelConfig, test: Dataset) -> float:
    """The loss barrier between canonical A and B, evaluated in float32 as ``glmc barrier`` does."""
    return barrier_curve(a, b, cfg, test, dtype=torch.float32).barrier


def pair_starts(names: tuple[str, str], natives: tuple[State, State], cfg: ModelConfig, test: Dataset, count: int,
                seed: int, options: WeightOptions | None = None) -> dict[str, Any]:
    """The vanilla barrier, then weight matching (``options``) from ``count`` starts: each one's objective, sweeps
    and barrier."""
    arch, options = get_arch(cfg.family), options or WeightOptions()
    a, b = (canonicalize(arch, s, cfg) for s in natives)
    generator = torch.Generator().manual_seed(seed)
    starts = []
    for index in range(count):
        named = dataclasses.replace(options, start=NAMED[index]) if index < len(NAMED) else options
        q = None if index < len(NAMED) else groups.random_orthogonal(cfg.width, generator)
        result = weight_match(a, b, arch.spec, cfg.depth, cfg.heads, start=q, options=named)
        value = barrier(a, apply(b, arch.spec, result.transform, cfg.heads), cfg, test)
        starts.append({"start": index, "objective": result.objective[-1], "sweeps": len(result.objective),
                       "barrier": value, "align_seconds": result.seconds})
        print(f"{names[0]} {names[1]} start {index}: objective {result.objective[-1]:.2f}, barrier {value:.3f}",
              flush=True)
    vanilla = align_pair(*natives, cfg, "none")
    return {"pair": list(names), "vanilla": barrier(vanilla.a, vanilla.b, cfg, test), "starts": starts}


def pair_row(report: dict[str, Any]) -> dict[str, Any]:
    """One pair's spread: objective range (% of its minimum), barrier at the identity and relaxed starts, at the
    lowest objective, and the minimum, median and maximum over starts; Pearson correlation of objective and
    barrier."""
    starts = report["starts"]
    objectives, barriers = [s["objective"] for s in starts], [s["barrier"] for s in starts]
    best = min(starts, key=lambda s: s["objective"])
    return {"pair": " / ".join(report["pair"]), "vanilla": report["vanilla"],
            "objective_spread_pct": 100 * (max(objectives) - min(objectives)) / min(objectives),
            "identity": barriers[0], "relaxed": barriers[1], "relaxed_objective": objectives[1],
            "identity_objective": objectives[0], "lowest_objective": best["barrier"], "min": min(barriers),
            "median": statistics.median(barriers), "max": max(barriers),
            "correlation": statistics.correlation(objectives, barriers)}


def markdown(name: str, entry: dict[str, Any]) -> list[str]:
    """One model's per-pair table, the mean ratios to vanilla of each choice of start, and how it was run."""
    rows = entry["rows"]
    lines = [f"## {name}: {entry['count']} starts per pair", "",
             "| pair | vanilla | objective spread | identity start | relaxed start | lowest objective | min | median | "
             "max | corr(objective, barrier) |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['pair']} | {r['vanilla']:.3f} | {r['objective_spread_pct']:.2f}% | {r['identity']:.3f} | "
              f"{r['relaxed']:.3f} | {r['lowest_objective']:.3f} | {r['min']:.3f} | {r['median']:.3f} | "
              f"{r['max']:.3f} | {r['correlation']:+.2f} |" for r in rows]
    lower = sum(r["relaxed_objective"] < r["identity_objective"] for r in rows)
    lines += ["", f"The relaxed start ends at a lower objective than the identity on {lower} of {len(rows)} pairs.",
              "", "Mean barrier ÷ vanilla over the pairs (± s.e.):", ""]
    for key, what in (("identity", "identity start (the default)"), ("relaxed", "relaxed start (`--start relaxed`)"),
                      ("lowest_objective", "lowest objective of the starts (data-free choice)"),
                      ("median", "median start"), ("min", "best start by barrier (needs held-out data: an oracle)")):
        ratio, se = mean_se([r[key] / r["vanilla"] for r in rows])
        lines.append(f"- {what}: {100 * ratio:.1f}% ± {100 * se:.1f}")
    return [*lines, "", f"Barriers on the first {entry['limit']} test samples, 21 λ values; weight matching as "
            f"`glmc align --method weight` (15 sweeps at most, tolerance 1e-3); random starts seeded "
            f"{entry['seed']}. Command: `{entry['command']}`. Machine: {entry['machine']}; wall time "
            f"{entry['seconds'] / 60:.1f} min.", ""]


def measure_model(run: dict[str, Any], starts: dict[str, Any], model: dict[str, Any], command: str,
                  ) -> dict[str, Any]:
    """Every pair of one model's seeds from every start, with the settings and wall time."""
    began, limit = time.perf_counter(), model.get("run", {}).get("limit", run["limit"])
    loaded = {p.stem: load_checkpoint(p) for p in seed_checkpoints(run, model)}  # each file and the test split once
    cfg = next(iter(loaded.values()))[1].config
    test = held_out(model["dataset"], cfg, limit=limit)
    options = parse_match_flags(run.get("matcher", [])).weight  # the costs the run pins; the starts are this bench's
    reports = [pair_starts((a, b), (loaded[a][0], loaded[b][0]), cfg, test, starts["count"], starts["seed"], options)
               for a, b in itertools.combinations(loaded, 2)]
    return {"reports": reports, "rows": [pair_row(r) for r in reports], "count": starts["count"],
            "seed": starts["seed"], "limit": limit, "command": command, "machine": machine(),
            "seconds": time.perf_counter() - began}


HEADING = ["# Weight matching from several residual starts", "",
           "Start 0 is the identity (`--start identity`); start 1 is the relaxed start (`--start relaxed`, "
           "glmc's default: the residual solved first with every unit map relaxed to an orthogonal one, "
           "`glmc.match.weight.relaxed_residual`); the others are Haar-random residual maps Q with Q·1 = 1. "
           "Objective: ‖A − T(B)‖² at the end of the search.", ""]


def main(argv: list[str] | None = None) -> int:
    return table_main(argv, "starts", "simulations.analyses.weight_starts", __doc__.splitlines()[0], measure_model,
                      RESULTS, HEADING, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
