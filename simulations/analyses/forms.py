"""Pairwise barriers in the paper's reparameterised forms (rmsnorm, circuit) next to the standard form, on the
barrier benchmark's checkpoints (no training here) and its config's ``[forms]`` table.

    .venv/bin/python -m simulations.analyses.forms [--config simulations/bench/configs/barriers.toml]
        [--models NAME ...]

The paper measures its barriers after two reparameterisations: LayerNorm as RMSNorm, which frees the residual
map to the whole O(d), and heads multiplied out into QK and OV circuits, so that the path interpolates circuits
instead of their factors. Each pair runs ``glmc barrier --form FORM`` once per form (cached), on the same files.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

from simulations.bench.barriers import machine, mean_se, pair_barriers, seed_checkpoints, summarise, table_main

RESULTS = Path("simulations/results/forms")


def measure_model(run: dict[str, Any], forms: dict[str, Any], model: dict[str, Any], command: str) -> dict[str, Any]:
    """Every pair of one model's seeds in every form; rows per form with each barrier divided both by that form's
    vanilla barrier and by the standard one (the issue's definition)."""
    if "standard" not in forms["forms"]:
        raise SystemExit("[forms] forms must include \"standard\": every form is also divided by its vanilla barrier")
    began = time.perf_counter()
    settings = run | model.get("run", {})  # a model may override run settings such as limit
    paths = seed_checkpoints(run, model)
    pairs = list(itertools.combinations(paths, 2))
    curves = {form: [pair_barriers(settings, model, a, b, forms["methods"], ["--form", form], f"_form-{form}")["curves"]
                     for a, b in pairs] for form in forms["forms"]}
    standard = [next(c for c in pair if c["method"] == "none")["barrier"] for pair in curves["standard"]]
    rows = []
    for form, per_pair in curves.items():
        for row in summarise(model, [{"curves": c} for c in per_pair], forms["methods"]):
            ratios = [next(c for c in pair if c["method"] == row["method"])["barrier"] / vanilla
                      for pair, vanilla in zip(per_pair, standard, strict=True)]
            ratio, ratio_se = mean_se(ratios)
            rows.append(row | {"form": form, "ratio_to_standard_vanilla": ratio, "standard_ratio_se": ratio_se})
    return {"pairs": [[p.stem for p in pair] for pair in pairs], "curves": curves, "rows": rows,
            "limit": settings["limit"], "points": settings["points"], "command": command, "machine": machine(),
            "seconds": time.perf_counter() - began}


def markdown(name: str, entry: dict[str, Any]) -> list[str]:
    """One model's table and how it was run."""
    lines = [f"## {name} ({len(entry['pairs'])} pairs)", "",
             "| form | method | barrier | ÷ the form's vanilla | ÷ standard vanilla | midpoint acc |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['form']} | {r['method']} | {r['barrier']:.3f} ± {r['barrier_se']:.3f} | "
              f"{100 * r['ratio_to_vanilla']:.1f}% ± {100 * r['ratio_se']:.1f} | "
              f"{100 * r['ratio_to_standard_vanilla']:.1f}% ± {100 * r['standard_ratio_se']:.1f} | "
              f"{r['midpoint_accuracy']:.3f} |" for r in entry["rows"]]
    return [*lines, "", f"Barriers on the first {entry['limit']} test samples, {entry['points']} λ values. Command: "
            f"`{entry['command']}`. Machine: {entry['machine']}; wall time {entry['seconds'] / 60:.1f} min.", ""]


HEADING = ["# Barriers in the paper's forms", "",
           "`glmc barrier --form`: `standard` interpolates the models as they are; `rmsnorm` centres the residual "
           "writers, runs LayerNorm as RMSNorm and aligns the residual over the whole O(d) (not only the maps that "
           "fix 1); `circuit` aligns in the standard form, then multiplies every head out into its QK and OV "
           "circuits, so the path interpolates circuits. Both ends are the same functions in every form; only the "
           "path between them differs.", ""]


def main(argv: list[str] | None = None) -> int:
    return table_main(argv, "forms", "simulations.analyses.forms", __doc__.splitlines()[0], measure_model,
                      RESULTS, HEADING, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
