"""Weight matching's choices, one at a time, against the official GLMC matcher's: pairwise barriers through
``glmc barrier`` with each variant's flags, on the config's seed pairs (disjoint where a model has the seeds).

    .venv/bin/python -m simulations.analyses.weight_options [--config simulations/analyses/configs/matcher.toml]
        [--models NAME ...]

Each variant is a list of ``glmc barrier`` flags (``--start``, ``--head-cost``, ``--mlp-cost``, ``--stop``,
``--form``); its barrier is divided by the pair's vanilla barrier in the standard form. Seeds without a checkpoint
are trained first with the model's ``train`` flags (cached, as every pair's report).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from simulations.bench.barriers import (
    checkpoint,
    label,
    machine,
    pair_barriers,
    summarise,
    table_main,
    train_missing,
)


def model_pairs(run: dict[str, Any], model: dict[str, Any]) -> list[tuple[Path, Path]]:
    """The model's configured seed pairs as checkpoint paths, training the seeds that have none."""
    train_missing(run, model)
    return [(checkpoint(Path(run["out"]), label(model), a), checkpoint(Path(run["out"]), label(model), b))
            for a, b in model["pairs"]]


def variant_curves(settings: dict[str, Any], model: dict[str, Any], pair: tuple[Path, Path],
                   variant: dict[str, Any]) -> dict[str, Any]:
    """One pair's weight-matched curve under a variant's flags (cached per variant)."""
    tag = "_" + "".join(c if c.isalnum() else "-" for c in variant["name"])
    (curve,) = pair_barriers(settings, model, *pair, ["weight"], variant["args"], tag)["curves"]
    return curve | {"method": variant["name"]}


def measure_model(run: dict[str, Any], options: dict[str, Any], model: dict[str, Any], command: str,
                  ) -> dict[str, Any]:
    """Every variant on every pair of one model, with the vanilla barrier each ratio divides by."""
    began = time.perf_counter()
    settings = run | model.get("run", {})  # a model may override run settings such as limit
    pairs = model_pairs(run, model)
    vanilla = [pair_barriers(settings, model, a, b, ["none"], [], "_none")["curves"][0] for a, b in pairs]
    reports = [{"curves": [v, *(variant_curves(settings, model, pair, var) for var in options["variants"])]}
               for pair, v in zip(pairs, vanilla, strict=True)]
    names = [v["name"] for v in options["variants"]]
    rows = summarise(model, reports, ["none", *names])
    flags = {v["name"]: " ".join(v["args"]) or "(defaults)" for v in options["variants"]}
    return {"pairs": [[p.stem for p in pair] for pair in pairs], "rows": rows, "flags": flags,
            "per_pair": {name: [next(c for c in r["curves"] if c["method"] == name)["barrier"] for r in reports]
                         for name in ["none", *names]},
            "limit": settings["limit"], "points": settings["points"], "command": command, "machine": machine(),
            "seconds": time.perf_counter() - began}


def markdown(name: str, entry: dict[str, Any]) -> list[str]:
    """One model's table: each variant's barrier, its ratio to vanilla, per pair and on average."""
    pairs = [" / ".join(p) for p in entry["pairs"]]
    lines = [f"## {name} ({len(pairs)} pairs: {', '.join(pairs)})", "",
             "| variant | `glmc barrier` flags | barrier | ÷ vanilla | per pair | midpoint acc | align s |",
             "|---|---|---|---|---|---|---|"]
    for r in entry["rows"]:
        flags = entry["flags"].get(r["method"], "--method none")
        per_pair = ", ".join(f"{b:.3f}" for b in entry["per_pair"][r["method"]])
        lines.append(f"| {r['method']} | `{flags}` | {r['barrier']:.3f} ± {r['barrier_se']:.3f} | "
                     f"{100 * r['ratio_to_vanilla']:.1f}% ± {100 * r['ratio_se']:.1f} | {per_pair} | "
                     f"{r['midpoint_accuracy']:.3f} | {r['align_seconds']:.2f} |")
    return [*lines, "", f"Barriers on the first {entry['limit']} test samples, {entry['points']} λ values; ÷ vanilla "
            "divides by the pair's standard-form vanilla barrier. Command: "
            f"`{entry['command']}`. Machine: {entry['machine']}; wall time {entry['seconds'] / 60:.1f} min "
            "(cached pair reports are reused).", ""]


HEADING = ["# Weight matching: this project's choices against the official GLMC matcher's", "",
           "Each variant changes the defaults by the flags shown. The official matcher interpolates circuits in the "
           "RMSNorm form (`--form circuit-rmsnorm`), takes its first residual step from the embeddings and the head "
           "alone (`--start embeddings`), scores heads by unsquared circuit distances (`--head-cost norm`) and MLP "
           "units by the L1 distance of their L2-normalised rows (`--mlp-cost l1`), and runs 15 sweeps "
           "(`--stop fixed`). The official matcher differs in more (docs/matching.md), so these five together "
           "(`official (all five)`) are not it.", ""]


def main(argv: list[str] | None = None) -> int:
    return table_main(argv, "options", "simulations.analyses.weight_options", __doc__.splitlines()[0], measure_model,
                      None, HEADING, markdown, config="simulations/analyses/configs/matcher.toml")


if __name__ == "__main__":
    raise SystemExit(main())
