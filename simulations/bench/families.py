"""Barriers between independently trained seeds of each declared family, through the commands a user runs: ``glmc
train`` for each seed, then ``glmc barrier`` per pair and method (vanilla, permutations only, activation matching,
weight, learned and dual learned matching), each row with its barrier ÷ vanilla and its alignment time.

    .venv/bin/python -m simulations.bench.families [--config simulations/bench/configs/families.toml]
        [--models MODEL ...] [--methods METHOD ...]

Seeds are trained into outputs/bench/families/<model>/ unless already there (a checkpoint is bit-identical for the
same seed and thread count). A method a family refuses is a row that says so, with glmc's one-line reason. Writes the
config's results folder (results.json, summary.md) after every family; with ``--models`` or ``--methods`` the other
rows are kept.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from glmc.cli import main as glmc
from harness.tomlfile import config_or_exit
from simulations.bench.barriers import machine

OUT = Path("outputs/bench/families")
HEADING = "# Barriers between independently trained seeds, per family"


def _run(argv: list[str]) -> tuple[int, str]:
    """One glmc command: its exit code and its stderr's last line (a refusal's one-line reason)."""
    stderr = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
        code = glmc(argv)
    lines = stderr.getvalue().strip().splitlines()
    return code, lines[-1] if lines else ""


def label(family: dict[str, Any]) -> str:
    """What a family's rows and seed folder are called: its ``label`` (a preset trained for another number of steps),
    else its preset."""
    return str(family.get("label", family["model"]))


def _preset(family: dict[str, Any]) -> str:
    """The preset a recipe line names, where its label is not the preset itself."""
    return "" if label(family) == family["model"] else f"`{family['model']}` on "


def train(family: dict[str, Any], run: dict[str, Any]) -> list[Path]:
    """The family's seeds, trained here unless their checkpoints exist."""
    root = OUT / label(family)
    paths = [root / f"seed{seed}.safetensors" for seed in range(2 * len(run["pairs"]))]
    for seed, path in enumerate(paths):
        if path.is_file():
            continue
        code, why = _run(["train", "--model", family["model"], "--dataset", family["dataset"], "--max-steps",
                          str(family["steps"]), "--dropout", str(family["dropout"]), "--seed", str(seed), "--threads",
                          str(run["threads"]), "--quiet", "--out", str(path)])
        if code != 0:
            raise SystemExit(f"glmc train of {family['model']} seed {seed} exited {code}: {why}")
    return paths


def curve(a: Path, b: Path, method: str, family: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """One method's barrier between a and b (``glmc barrier --json``, the run's ``matcher`` flags), or its refusal."""
    report = a.parent / f"barrier-{a.stem}-{b.stem}-{method}.json"
    code, why = _run(["barrier", str(a), str(b), "--method", method, "--steps", str(run["learn_steps"]), "--points",
                      str(run["points"]), "--limit", str(run["limit"]), "--threads", str(run["threads"]), "--json",
                      str(report), *run.get("matcher", [])])
    if code != 0:
        return {"method": method, "refused": why}
    (result,) = json.loads(report.read_text())["curves"]
    return {"method": method, "barrier": result["barrier"], "align_seconds": result.get("align_seconds", 0.0),
            "endpoints": [result["losses"][0], result["losses"][-1]]}


def measure(family: dict[str, Any], run: dict[str, Any], methods: list[str]) -> list[dict[str, Any]]:
    """Every (pair, method) row of one family."""
    paths = train(family, run)
    rows = []
    for i, j in run["pairs"]:
        for method in methods:
            rows.append({"model": label(family), "pair": [i, j], **curve(paths[i], paths[j], method, family, run)})
            print(f"{label(family)} seeds {i},{j} {method}: {rows[-1].get('barrier', rows[-1].get('refused'))}",
                  flush=True)
    return rows


def table(rows: list[dict[str, Any]], methods: list[str]) -> list[dict[str, Any]]:
    """Per (model, method): the mean barrier over the pairs, its ratio to the same pairs' vanilla, the mean time."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        vanilla = {tuple(r["pair"]): r["barrier"] for r in rows if r["model"] == model and r["method"] == "none"}
        for method in methods:
            chosen = [r for r in rows if r["model"] == model and r["method"] == method]
            done = [r for r in chosen if "barrier" in r]
            if not chosen:
                continue
            if not done:
                out.append({"model": model, "method": method, "refused": chosen[0]["refused"]})
                continue
            ratios = [r["barrier"] / vanilla[tuple(r["pair"])] for r in done if vanilla.get(tuple(r["pair"]))]
            out.append({"model": model, "method": method, "pairs": len(done),
                        "barrier": statistics.fmean(r["barrier"] for r in done),
                        "barrier_sd": statistics.pstdev(r["barrier"] for r in done),
                        "ratio": statistics.fmean(ratios) if ratios else None,
                        "align_seconds": statistics.fmean(r["align_seconds"] for r in done)})
    return out


def markdown(data: dict[str, Any]) -> list[str]:
    """The committed summary from results.json: how it was run, the families' recipes, one row per (model, method)."""
    config, summary, runs = data["config"], data["summary"], data["runs"]
    run = config["run"]
    lines = [
             *(f"Run {i}: `{r['command']}`, config `{r['config']}`; machine: {r['machine']}; wall time "
               f"{r['wall_minutes']:.1f} min; load average {r['load_before']} before." for i, r in enumerate(runs)),
             "", f"Pairs of seeds {', '.join(f'{i}–{j}' for i, j in run['pairs'])}; {run['points']} points on the "
             f"first {run['limit']} held-out windows; learned and dual matching {run['learn_steps']} steps. Barrier: "
             "the mean over the pairs (± their spread); ratio: the mean of barrier ÷ the same pair's vanilla; time: "
             "the alignment's mean wall seconds.", "", "Recipes:", "",
             *(f"- `{label(f)}`: {_preset(f)}{f['dataset']}, {f['steps']} steps, dropout {f['dropout']}; {f['note']}"
               for f in config["families"]), "",
             "| model | method | barrier | ratio to vanilla | align s |", "|---|---|---|---|---|"]
    for r in summary:
        if "refused" in r:
            lines.append(f"| {r['model']} | {r['method']} | refused: {r['refused']} | – | – |")
            continue
        ratio = "–" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"| {r['model']} | {r['method']} | {r['barrier']:.4f} ± {r['barrier_sd']:.4f} | {ratio} | "
                     f"{r['align_seconds']:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations.bench.families", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="simulations/bench/configs/families.toml")
    parser.add_argument("--models", nargs="*", help="only these families' presets; the others' rows are kept")
    parser.add_argument("--methods", nargs="*", help="only these methods; the others' rows are kept")
    args = parser.parse_args(argv)
    config = config_or_exit(parser, args.config)
    run, out = config["run"], Path(config["run"]["results"])
    methods = args.methods or run["methods"]
    families = [f for f in config["families"] if not args.models or {f["model"], label(f)} & set(args.models)]
    kept = json.loads((out / "results.json").read_text()) if (args.models or args.methods) and (
        out / "results.json").is_file() else {}
    todo = {(label(f), m) for f in families for m in methods}
    rows = [r for r in kept.get("rows", []) if (r["model"], r["method"]) not in todo and r["method"] in run["methods"]]
    began = time.perf_counter()
    this = {"command": " ".join(["python -m simulations.bench.families", *(sys.argv[1:] if argv is None else argv)]),
            "config": args.config, "machine": machine(), "load_before": ", ".join(f"{x:.1f}" for x in os.getloadavg())}
    runs = [*kept.get("runs", []), this]
    for family in families:
        rows += measure(family, run, methods)
        this["wall_minutes"] = (time.perf_counter() - began) / 60
        order = {label(f): i for i, f in enumerate(config["families"])}
        rows.sort(key=lambda r: (order.get(r["model"], len(order)), run["methods"].index(r["method"])))
        data = {"config": config, "runs": runs, "rows": rows, "summary": table(rows, run["methods"])}
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(data, indent=1) + "\n")
        (out / "summary.md").write_text("\n".join([HEADING, "", *markdown(data)]) + "\n")
    print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
