"""Merging benchmark: merges N trained checkpoints per method through ``glmc merge`` (same width and
mixed widths), draws the simplex heat map of three models through ``glmc barrier --simplex``, times universe
matching of 10 models, and writes a summary.

    .venv/bin/python -m simulations.bench.merging [--config simulations/bench/configs/merging.toml]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from glmc.cli import main as glmc
from glmc.cli.options import parse_match_flags
from glmc.match.registry import get_method
from harness.tomlfile import config_or_exit
from simulations.bench.barriers import results_lock


def checkpoints(run: dict[str, Any], models: list[list[Any]]) -> list[Path]:
    """``[[group, seeds], ...]`` as checkpoint paths; every one must exist (this harness trains nothing)."""
    paths = [Path(run["checkpoints"]) / group / f"seed{seed}.safetensors" for group, seeds in models for seed in seeds]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise SystemExit(f"missing checkpoints (see the config's header for how to train them): {missing}")
    return paths


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def merge(run: dict[str, Any], spec: dict[str, Any], method: str) -> dict[str, Any]:
    """``glmc merge`` of one group by one method (or its earlier report, when resuming); returns its JSON report."""
    out = Path(run["out"]) / f"{slug(spec['name'])}_{method}"
    if run.get("resume") and Path(f"{out}.json").exists():
        return json.loads(Path(f"{out}.json").read_text())
    args = ["merge", *map(str, checkpoints(run, spec["models"])), "--method", method, "--out",
            f"{out}.safetensors", "--json", f"{out}.json", "--limit", str(spec["limit"]), "--simplex-points",
            str(spec["simplex_points"]), "--workers", str(run["workers"]), "--force", "--quiet"]
    extra = [*spec.get("matcher", run.get("matcher", [])), *spec.get("args", []),
             *(spec.get("learn", run["learn"]) if get_method(method).learns else [])]
    if glmc(args + extra) != 0:
        raise SystemExit(f"glmc merge failed: {spec['name']} by {method}")
    return json.loads(Path(f"{out}.json").read_text())


def simplex(run: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """``glmc barrier --simplex`` of three models, one panel per method, plotted into the results folder."""
    a, b, c = checkpoints(run, spec["models"])
    out = Path(run["results"]) / "simplex"
    if run.get("resume") and Path(f"{out}.json").exists():
        return json.loads(Path(f"{out}.json").read_text())
    args = ["barrier", "--simplex", str(a), str(b), str(c), "--simplex-steps", str(spec["steps"]), "--limit",
            str(spec["limit"]), "--json", f"{out}.json", "--plot", f"{out}.png", "--quiet", *run["learn"],
            *run.get("matcher", [])]
    for method in spec["methods"]:
        args += ["--method", method]
    if glmc(args) != 0:
        raise SystemExit("glmc barrier --simplex failed")
    return json.loads(Path(f"{out}.json").read_text())


def timing_states(run: dict[str, Any], spec: dict[str, Any]) -> tuple[list[dict], Any]:
    """The seeds' canonical states plus randomly transformed copies of them (exact symmetries, seeded)."""
    from glmc.archs import get_arch
    from glmc.io.checkpoint import load_checkpoint
    from glmc.symmetry.canonical import canonicalize
    from glmc.symmetry.transforms import MATCHABLE, apply, random_transform

    loaded = [load_checkpoint(p) for p in checkpoints(run, [[spec["group"], spec["seeds"]]])]
    cfg = loaded[0][1].config
    arch, g = get_arch(cfg.family), torch.Generator().manual_seed(0)
    states = [canonicalize(arch, s, cfg, dtype=torch.float64) for s, _ in loaded]
    for i in range(spec["copies"]):
        t = random_transform(cfg, MATCHABLE, g)
        states.append(apply(states[i % len(loaded)], arch.spec, t, cfg.heads))
    return states, cfg


def time_universe(run: dict[str, Any], spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Wall and CPU time of weight-matching universe matching of all the timing models, per worker count."""
    from glmc.merging.options import MergeOptions
    from glmc.merging.universe import members, universe_match

    cached = Path(run["out"]) / "timing.json"
    if run.get("resume") and cached.exists():
        return json.loads(cached.read_text())
    states, cfg = timing_states(run, spec)
    match = parse_match_flags(run.get("matcher", []))
    rows = []
    for workers in spec["workers"]:
        wall, cpu, children = time.perf_counter(), time.process_time(), os.times()
        options = MergeOptions("weight", match, max_iters=spec["max_iters"], workers=workers)
        result = universe_match(members(states, [cfg] * len(states)), cfg, options)
        after = os.times()
        rows.append({"models": len(states), "workers": workers, "wall_seconds": time.perf_counter() - wall,
                     "cpu_seconds": time.process_time() - cpu + (after.children_user - children.children_user),
                     "iterations": len(result.history), "history": result.history_dicts(),
                     "load_average": os.getloadavg()})
    cached.write_text(json.dumps(rows))
    return rows


def row(name: str, report: dict[str, Any]) -> dict[str, Any]:
    """One summary row of a merge report."""
    inputs = [r["accuracy"] for r in report["inputs"]]
    method = report["method"] + (", norms restored" if report.get("restore_norms") else "")
    return {"group": name, "method": method, "models": len(inputs),
            "inputs": [f"{Path(r['path']).parent.name}/{Path(r['path']).stem} ({r['accuracy']:.4f})"
                       for r in report["inputs"]],
            "mean_input_accuracy": statistics.fmean(inputs),
            "mean_input_loss": statistics.fmean(r["loss"] for r in report["inputs"]),
            "merged_accuracy": report["merged"]["accuracy"], "merged_loss": report["merged"]["loss"],
            "ensemble_accuracy": report["ensemble"]["accuracy"], "ensemble_loss": report["ensemble"]["loss"],
            "simplex_barrier": report["simplex"]["barrier"], "universe_seconds": report["universe_seconds"],
            "iterations": len(report["universe"]),
            "width_barriers": _by_width(report.get("width_barriers", []))}


def _by_width(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each narrower input's pairwise barrier to the wide reference, grouped by its width."""
    out: dict[str, list[float]] = {}
    for r in rows:
        out.setdefault(str(r["width"]), []).append(r["barrier"])
    return out


def markdown(rows: list[dict[str, Any]], panels: dict[str, Any], timing: list[dict[str, Any]],
             meta: dict[str, Any]) -> str:
    """The committed summary: merges, the simplex barriers, universe-matching time, and how it was produced."""
    lines = ["# Merging N models (universe matching, widths)", "",
             f"Command: `{meta['command']}`, config `{meta['config']}`.",
             f"Machine: {meta['machine']}; wall time of this invocation {meta['wall_minutes']:.1f} min "
             f"({meta['reused']}); load average at the end {meta['load']}.", "",
             "Accuracy and loss on held-out data (first `limit` samples of the test split); vanilla = `none` "
             "(parameter averaging; across widths, the least-squares merge of the exact embeddings without "
             "alignment); the ensemble averages the inputs' logits. Simplex barrier = paper Eq. 2 on the grid.", "",
             "| models | method | N | mean input acc | merged acc | Δ points | merged loss | ensemble acc "
             "| simplex barrier | width barriers (d: B) | iters | universe s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        widths = "; ".join(f"{d}: " + ", ".join(f"{b:.3f}" for b in bs) for d, bs in r["width_barriers"].items())
        lines.append(f"| {r['group']} | {r['method']} | {r['models']} | {r['mean_input_accuracy']:.4f} | "
                     f"{r['merged_accuracy']:.4f} | {100 * (r['merged_accuracy'] - r['mean_input_accuracy']):+.1f} "
                     f"| {r['merged_loss']:.3f} | {r['ensemble_accuracy']:.4f} | {r['simplex_barrier']:.3f} | "
                     f"{widths or '–'} | {r['iterations']} | {r['universe_seconds']:.0f} |")
    names = ", ".join(f"{Path(m).parent.name}/{Path(m).stem}" for m in panels["models"])
    lines += ["", "Inputs (test accuracy on the same samples):", ""]
    lines += [f"- {group}: {', '.join(inputs)}" for group, inputs in {r["group"]: r["inputs"] for r in rows}.items()]
    lines += ["", f"Simplex of three models ({names}; "
              f"weights in multiples of 1/{panels['steps']}): `simplex.png`.", "",
              "| method | simplex barrier | max loss |", "|---|---|---|"]
    lines += [f"| {p['method']} | {p['barrier']:.3f} | {max(p['losses']):.3f} |" for p in panels["panels"]]
    lines += ["", "Universe matching by weight matching (float64, anchor = model 0), "
              f"{timing[0]['models']} models: {meta['timing_models']}", "",
              "| workers | iterations | wall s | CPU s (incl. workers) | load average (1, 5, 15 min) |",
              "|---|---|---|---|---|"]
    lines += [f"| {t['workers']} | {t['iterations']} | {t['wall_seconds']:.1f} | {t['cpu_seconds']:.1f} | "
              f"{', '.join(f'{x:.1f}' for x in t['load_average'])} |" for t in timing]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="simulations/bench/configs/merging.toml")
    parser.add_argument("--resume", action="store_true", help="reuse the reports and timings already written")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="measure only these merges (by name); every "
                        "other merge, the simplex panels and the timing are kept from the published results.json")
    args = parser.parse_args(argv)
    config = config_or_exit(parser, args.config)
    run, start = config["run"] | {"resume": args.resume}, time.perf_counter()
    torch.set_num_threads(run["threads"])
    if args.only:
        published(parser, run, config, args.only)  # refuse a bad --only before measuring
    names = [spec["name"] for spec in config["merges"]]
    measured = {spec["name"]: [merge(run, spec, m) for m in spec["methods"]] for spec in config["merges"]
                if not args.only or spec["name"] in args.only}
    fresh = {} if args.only else {"simplex": simplex(run, config["simplex"]),
                                  "timing": time_universe(run, config["timing"])}
    with results_lock(Path(run["out"])):  # read only now, so that a partial run that ended meanwhile keeps its reports
        kept = (published(parser, run, config, args.only) if args.only else {"reports": {}}) | fresh
        reports = {name: measured.get(name) or kept["reports"][name] for name in names
                   if name in measured or name in kept["reports"]}
        missing = [name for name in names if name not in reports]  # e.g. being measured by a parallel run
        reused = (f"kept from the published results: every merge but {', '.join(args.only)}, the simplex, the "
                  "timing" if args.only else "reports of earlier invocations reused" if args.resume
                  else "everything computed") + (f"; not measured yet: {', '.join(missing)}" if missing else "")
        write_results(run, args.config, reports, kept["simplex"], kept["timing"], config["timing"],
                      time.perf_counter() - start, reused)
    return 0


def published(parser: argparse.ArgumentParser, run: dict[str, Any], config: dict[str, Any],
              only: list[str]) -> dict[str, Any]:
    """The published results.json (after checking that ``only`` names merges of the config)."""
    names = [spec["name"] for spec in config["merges"]]
    unknown = [n for n in only if n not in names]
    if unknown:
        parser.error(f"--only: no merge named {unknown[0]!r} in the config")
    path = Path(run["results"]) / "results.json"
    kept = json.loads(path.read_text()) if path.exists() else {"reports": {}}
    return kept


def write_results(run: dict[str, Any], config: str, reports: dict[str, list[dict[str, Any]]],
                  panels: dict[str, Any], timing: list[dict[str, Any]], timing_spec: dict[str, Any],
                  seconds: float, reused: str) -> None:
    """summary.md and results.json under the results folder (the simplex plot is already there)."""
    out = Path(run["results"])
    out.mkdir(parents=True, exist_ok=True)
    rows = [row(name, r) for name, group in reports.items() for r in group]
    seeds = timing_spec["seeds"]
    meta = {"command": "python -m simulations.bench.merging", "config": config, "wall_minutes": seconds / 60,
            "reused": reused,
            "load": ", ".join(f"{x:.1f}" for x in os.getloadavg()),
            "timing_models": f"{timing_spec['group']} seeds {seeds} plus {timing_spec['copies']} randomly "
                             f"transformed copies of them (exact symmetries; each is aligned to U, the mean, "
                             f"so a copy is no easier than a seed)",
            "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, torch threads "
                       f"{run['threads']}, python {platform.python_version()}, torch {torch.__version__}".strip()}
    (out / "summary.md").write_text(markdown(rows, panels, timing, meta))
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "timing": timing, "simplex": panels,
                                                  "reports": reports}, indent=1))
    print((out / "summary.md").read_text())


if __name__ == "__main__":
    raise SystemExit(main())
