"""Learned matching with more learning: other step counts and learning rates than the barrier bench's learned
row, on the same checkpoints. Uses the barrier benchmark's checkpoints (no training here) and its config's
``[budget]`` table; a setting with ``models`` runs on those models only, and one with ``method`` learns by that
method instead of the table's.

    .venv/bin/python -m simulations.analyses.learning_budget [--config simulations/bench/configs/barriers.toml]
        [--models NAME ...]

Each setting's flags are added after the model's own learning flags (``learn``; glmc's defaults without it), so
they override them; a setting runs on the first ``pairs`` seed pairs. Every run is one cached ``glmc barrier``
call, so an interrupted bench resumes, and each pair's vanilla barrier comes from a plain ``none`` run on the same
files. A learned run whose cache is gone but whose curve is published, for the same pair, learning flags and
checkpoints (the published plain curve is this run's, loss for loss), is kept from the published results rather
than learned again; seeds retrained on another machine can differ in their last bits, and are learned anew.
"""

from __future__ import annotations

import itertools
import statistics
import time
from pathlib import Path
from typing import Any

from simulations.bench.barriers import (
    label,
    machine,
    pair_barriers,
    previous_results,
    report_path,
    seed_checkpoints,
    summarise,
    table_main,
)


def setting_label(method: str, args: list[str]) -> str:
    """A setting's curve name: the method and the flags it adds."""
    return f"{method} {' '.join(args)}".strip() if args else f"{method} (the bench's flags)"


def setting_tag(method: str, args: list[str]) -> str:
    """A setting's cache-file suffix, from its flags (so reordering the config keeps the caches)."""
    return f"_{method}" + "".join(f"_{a.lstrip('-')}" for a in args)


def settings_of(budget: dict[str, Any], model: dict[str, Any]) -> list[dict[str, Any]]:
    """The settings that run on ``model``: those without ``models``, and those that name it."""
    return [s for s in budget["settings"] if label(model) in s.get("models", [label(model)])]


def method_of(budget: dict[str, Any], setting: dict[str, Any]) -> str:
    """The method a setting learns by: its own ``method``, else the table's."""
    return setting.get("method", budget["method"])


def published_curve(results: Path, model: dict[str, Any], pair: tuple[Path, Path], name: str,
                    plain: dict[str, Any]) -> dict[str, Any] | None:
    """The curve ``name`` of ``pair`` in the results published in ``results``, if they have it with the model's
    learning flags and were measured on these checkpoints: their plain curve is ``plain`` (seeds retrained
    elsewhere differ)."""
    entry = previous_results(results).get(label(model))
    if entry is None or entry["learn"] != model.get("learn", []):
        return None
    curves = dict(zip(map(tuple, entry["pairs"]), entry["curves"], strict=True)).get(tuple(p.stem for p in pair), [])
    if not any(c["method"] == "none" and c["losses"] == plain["losses"] for c in curves):
        return None
    return next((c for c in curves if c["method"] == name), None)


def setting_curve(run: dict[str, Any], budget: dict[str, Any], model: dict[str, Any], pair: tuple[Path, Path],
                  method: str, args: list[str], plain: dict[str, Any]) -> dict[str, Any]:
    """One setting's curve on one pair, named by :func:`setting_label`: cached, published in the ``budget``
    table's results (same checkpoints: the pair's ``plain`` curve), or measured now."""
    name, tag = setting_label(method, args), setting_tag(method, args)
    if not report_path(run, model, *pair, tag).exists() and (
            published := published_curve(Path(budget["results"]), model, pair, name, plain)) is not None:
        return published
    extra = [*model.get("learn", []), *args]
    return pair_barriers(run, model, *pair, [method], extra, tag)["curves"][0] | {"method": name}


def setting_curves(run: dict[str, Any], budget: dict[str, Any], model: dict[str, Any], setting: dict[str, Any],
                   pairs: list[tuple[Path, Path]], plains: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One setting's curve on each of its pairs (``plains``: each pair's plain curve)."""
    return [setting_curve(run, budget, model, pair, method_of(budget, setting), setting["args"], plain)
            for pair, plain in zip(pairs[:setting["pairs"]], plains, strict=False)]


def measure_model(run: dict[str, Any], budget: dict[str, Any], model: dict[str, Any], command: str
                  ) -> dict[str, Any]:
    """Every setting on its pairs, each pair's vanilla barrier, the summary rows, the settings and wall time."""
    began = time.perf_counter()
    settings = run | model.get("run", {})  # a model may override run settings such as limit
    pairs = list(itertools.combinations(seed_checkpoints(run, model), 2))
    own = settings_of(budget, model)
    used = pairs[:max(s["pairs"] for s in own)]
    curves = [pair_barriers(settings, model, a, b, ["none"], [], "_budget-plain")["curves"] for a, b in used]
    labels, plains = [], [pair[0] for pair in curves]
    for setting in own:
        labels.append(setting_label(method_of(budget, setting), setting["args"]))
        for pair, curve in zip(curves, setting_curves(settings, budget, model, setting, used, plains), strict=False):
            pair.append(curve)
    return {"pairs": [[p.stem for p in pair] for pair in used], "curves": curves,
            "rows": summarise(model, [{"curves": c} for c in curves], ["none", *labels]),
            "learn": model.get("learn", []), "limit": settings["limit"], "points": settings["points"],
            "command": command, "machine": machine(), "seconds": time.perf_counter() - began}


def learning(curve: dict[str, Any]) -> str:
    """How a learned run went: validation loss at λ = 0.5 before and at the best step, and why it stopped."""
    info = curve["align_info"]
    return f"{info['val_loss_init']:.3f} → {info['val_loss']:.3f} (best step {info['best_step']}; {info['stopped']})"


def markdown(name: str, entry: dict[str, Any]) -> list[str]:
    """One model's table, each run's learning, and how it was run."""
    lines = [f"## {name}", "", "| curve | pairs | barrier | ÷ vanilla | midpoint acc | learn s (median) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['pairs']} | {r['barrier']:.3f} ± {r['barrier_se']:.3f} | "
              f"{100 * r['ratio_to_vanilla']:.1f}% ± {100 * r['ratio_se']:.1f} | {r['midpoint_accuracy']:.3f} | "
              f"{r['align_seconds']:.0f} |" for r in entry["rows"]]
    lines += ["", "Per run: barrier; validation loss at λ = 0.5 before learning → at its best step.", ""]
    for pair, curves in zip(entry["pairs"], entry["curves"], strict=True):
        lines += [f"- {' / '.join(pair)}, {c['method']}: {c['barrier']:.3f}; {learning(c)}"
                  for c in curves if c["method"] != "none"]
    seconds = statistics.fmean(c["align_seconds"] for cs in entry["curves"] for c in cs if c["method"] != "none")
    flags = f"`{' '.join(entry['learn'])}`" if entry["learn"] else "none (glmc's defaults)"
    return [*lines, "", f"Model learning flags before each setting's: {flags}. Barriers on "
            f"the first {entry['limit']} test samples, {entry['points']} λ values. Command: `{entry['command']}`. "
            f"Machine: {entry['machine']}; mean learning time {seconds / 60:.1f} min a run; wall time of the "
            f"bench run {entry['seconds'] / 60:.1f} min (cached runs, and runs kept from the published results, "
            "count as zero).", ""]


HEADING = ["# Learned matching with more learning", "",
           "The barrier bench's learned row runs a fixed budget (its model's `learn` flags). Here the same pairs "
           "learn longer or at a larger learning rate; ÷ vanilla divides by the plain `none` barrier of the same "
           "pair. The learning rate follows a cosine decay to zero over the run's steps, so a longer run also "
           "decays more slowly. A `--form` setting learns and measures the path in that form; its ÷ vanilla still "
           "divides by the standard form's vanilla barrier.", ""]


def main(argv: list[str] | None = None) -> int:
    return table_main(argv, "budget", "simulations.analyses.learning_budget", __doc__.splitlines()[0], measure_model,
                      None, HEADING, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
