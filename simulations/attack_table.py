"""The attack benchmark's table: final accuracy per attack (rows) and aggregation (columns), from the results.json
that ``simulations.compare --config simulations/configs/attacks.toml --publish`` wrote.

    .venv/bin/python -m simulations.attack_table [--results simulations/results/attacks/results.json]

Each cell is the global model's central test accuracy after the last round (mean over seeds), then its difference
from FedAvg with no attacker (the no-attack row's undefended FedAvg). Writes table.md next to the results.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

REFERENCE = ("no-attack", "fedavg-undefended")  # FedAvg with no attacker and no defence
DEFAULT_RESULTS = Path("simulations/results/attacks/results.json")


def final_accuracy(row: dict[str, Any]) -> float | None:
    rounds = [r for r in row["records"] if r.get("central_accuracy") is not None]
    return rounds[-1]["central_accuracy"] if rounds and row["status"] == "finished:completed" else None


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per attack, one column per aggregation, in the order the results list them."""
    attacks = list(dict.fromkeys(r["split"] for r in rows))
    aggregations = list(dict.fromkeys(r["aggregation"] for r in rows))
    cells: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        if (accuracy := final_accuracy(row)) is not None:
            cells.setdefault((row["split"], row["aggregation"]), []).append(100 * accuracy)
    reference = statistics.fmean(cells.get(REFERENCE, [float("nan")]))
    failed = {(r["split"], r["aggregation"]): r for r in rows if r["status"] != "finished:completed"}
    lines = ["| attack | " + " | ".join(aggregations) + " |", "|---|" + "---|" * len(aggregations)]
    for attack in attacks:
        shown = []
        for agg in aggregations:
            values = cells.get((attack, agg))
            shown.append(("failed" if (attack, agg) in failed else "–") if not values else
                         f"{statistics.fmean(values):.1f} ({statistics.fmean(values) - reference:+.1f})")
        lines.append(f"| {attack} | " + " | ".join(shown) + " |")
    notes = [f"- failed, {attack} × {agg} (seed {r['seed']}): {r['status']}, {r['details']}"
             for (attack, agg), r in failed.items()]
    return "\n".join(lines + (["", *notes] if notes else []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations.attack_table", description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    args = parser.parse_args(argv)
    body = json.loads(args.results.read_text())
    rows = body["rows"] if isinstance(body, dict) else body
    seeds = sorted({r["seed"] for r in rows})
    experiment = body["experiment"] if isinstance(body, dict) else "attacks"
    results_flag = "" if args.results == DEFAULT_RESULTS else f" --results {args.results}"
    text = "\n".join([
        "# Attack benchmark: final accuracy %, one attacker among 5 clients", "",
        f"From `{args.results}` (`python -m simulations.compare --config simulations/configs/{experiment}.toml "
        f"--publish`, then `python -m simulations.attack_table{results_flag}`); seeds {seeds}. In brackets: points "
        f"against FedAvg with no "
        f"attacker ({REFERENCE[1]} in the {REFERENCE[0]} row). Machine, wall time and load: summary.md.", "",
        table(rows), ""])
    out = args.results.parent / "table.md"
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
