"""Barrier rows on a given pair of checkpoints, trained elsewhere (no training here): one ``glmc barrier`` run per
row of the config's ``[[rows]]``, each with its own method and flags (a form, a learning budget), the official
figures of the pair's README printed beside them. ``simulations.bench.barriers`` runs this bench for a config with
a ``[pair]`` table:

    .venv/bin/python -m simulations.bench.barriers --config simulations/bench/configs/official-pair.toml [--rows N ...]

Each row's report is cached under the run's ``out`` with the flags it ran with, so an interrupted run resumes and a
row whose flags changed is measured again.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from glmc.cli import main as glmc
from simulations.bench.official import official_figures


def slug(name: str) -> str:
    """A row name as a file name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def row_args(pair: dict[str, Any], run: dict[str, Any], row: dict[str, Any], out: Path) -> list[str]:
    """The ``glmc barrier`` arguments of one row: the pair, its test split, the run's λ grid and threads, then the
    row's method and flags (a data-driven row names the pair's training split with ``{train}``)."""
    root = Path(pair["path"])
    flags = [flag.format(train=root / pair["train"]) for flag in row.get("flags", [])]
    return ["barrier", str(root / pair["a"]), str(root / pair["b"]), "--method", row["method"],
            "--points", str(run["points"]), "--data-file", str(root / pair["test"]), "--threads", str(run["threads"]),
            "--json", str(out), "--quiet", *flags]


def measure_row(pair: dict[str, Any], run: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """One row's curve (cached with its arguments) and the wall time of the run that measured it."""
    out = Path(run["out"]) / f"{slug(row['name'])}.json"
    args = row_args(pair, run, row, out)
    if out.exists() and (cached := json.loads(out.read_text())).get("args") == args:
        return cached
    began = time.perf_counter()
    if glmc(args) != 0:
        raise SystemExit(f"glmc barrier failed for row {row['name']!r}")
    report = json.loads(out.read_text()) | {"args": args, "wall_seconds": round(time.perf_counter() - began, 1)}
    out.write_text(json.dumps(report, indent=1))
    return report


def row_entry(row: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """The figures a summary keeps of one row."""
    curve = report["curves"][0]
    return {"name": row["name"], "method": row["method"], "form": report["form"], "flags": row.get("flags", []),
            "barrier": curve["barrier"], "losses": curve["losses"], "align_seconds": curve["align_seconds"],
            "align_info": curve.get("align_info", {}), "wall_seconds": report["wall_seconds"],
            "official": row.get("official")}


def markdown(pair: dict[str, Any], rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """The summary: every row's barrier and share of vanilla beside the official code's figure for the same row."""
    figures = official_figures(Path(pair["path"]) / "README.md")
    vanilla = next((r["barrier"] for r in rows if r["method"] == "none"), None)
    official_vanilla = figures.barrier("vanilla")
    lines = [f"# Loss barriers on {pair['name']}", "",
             f"Reproduce: `python -m simulations.bench.barriers --config {meta['config']}`; this summary was written "
             f"by `{meta['command']}`. Machine: {meta['machine']}; the rows' wall times together "
             f"{sum(r['wall_seconds'] for r in rows) / 60:.0f} min (each row's below, measured when it ran; this run "
             f"{meta['wall_minutes']:.1f} min); load average at the end {meta['load']}.",
             *([f"Rows of the config not measured yet: {', '.join(meta['missing'])}."] if meta.get("missing") else []),
             f"Barrier = max over {meta['points']} λ of L(θ(λ)) − [λ L(θ_A) + (1−λ) L(θ_B)] on the pair's test split "
             "(nats per token). The official figures are read from the pair's README.", "",
             "| row | form | barrier | ÷ vanilla | official | official ÷ vanilla | align s | row wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        theirs = figures.barrier(r["official"]) if r["official"] else None
        official = ("—", "—") if theirs is None else (f"{theirs:.4f}", f"{100 * theirs / official_vanilla:.1f}%")
        share = "—" if vanilla is None else f"{100 * r['barrier'] / vanilla:.1f}%"
        lines.append(f"| {r['name']} | {r['form']} | {r['barrier']:.4f} | {share} | "
                     f"{official[0]} | {official[1]} | {r['align_seconds']:.1f} | {r['wall_seconds']:.0f} |")
    lines += ["", "Each row's flags (`glmc barrier` after the pair, `--data-file`, `--points` and `--threads`):", "",
              *(f"- {r['name']}: `{' '.join(['--method', r['method'], *r['flags']])}`" for r in rows)]
    return lines


def run_pair(config: dict[str, Any], config_path: str, rows: list[str] | None, command: str) -> int:
    """Measure the config's rows (or only the named ones, the others kept where results.json has them) and write
    summary.md and results.json to the run's ``results`` after each row, so a run stopped early keeps what it
    measured."""
    pair, run = config["pair"], config["run"]
    began = time.perf_counter()
    results = Path(run["results"])
    kept = json.loads((results / "results.json").read_text())["rows"] if (results / "results.json").exists() else []
    kept_by_name = {r["name"]: r for r in kept}
    if unknown := sorted(set(rows or []) - {r["name"] for r in config["rows"]}):
        raise SystemExit(f"not in the rows of {config_path}: {', '.join(unknown)}")
    entries: dict[str, dict[str, Any]] = {}
    for row in config["rows"]:  # the rows not asked for first: kept as stored, if they are
        if rows and row["name"] not in rows and row["name"] in kept_by_name:
            entries[row["name"]] = kept_by_name[row["name"]]
    for row in config["rows"]:
        if rows and row["name"] not in rows:
            continue
        entries[row["name"]] = row_entry(row, measure_row(pair, run, row))
        print(f"{row['name']}: barrier {entries[row['name']]['barrier']:.4f}", flush=True)
        ordered = [entries[r["name"]] for r in config["rows"] if r["name"] in entries]
        missing = [r["name"] for r in config["rows"] if r["name"] not in entries]
        write(pair, run, ordered, {"command": command, "config": config_path, "missing": missing},
              time.perf_counter() - began)
    print((results / "summary.md").read_text())
    return 0


def write(pair: dict[str, Any], run: dict[str, Any], rows: list[dict[str, Any]], given: dict[str, Any],
          seconds: float) -> None:
    """summary.md and results.json of the rows measured so far; ``given``: the command, config and rows left."""
    from simulations.bench.barriers import machine

    meta = given | {"machine": machine(), "points": run["points"], "wall_minutes": seconds / 60,
                    "load": ", ".join(f"{x:.1f}" for x in os.getloadavg())}
    results = Path(run["results"])
    results.mkdir(parents=True, exist_ok=True)
    (results / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (results / "summary.md").write_text("\n".join(markdown(pair, rows, meta)) + "\n")
