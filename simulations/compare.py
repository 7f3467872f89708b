"""Comparison harness: a grid of Flower simulations (aggregation × split × width mix × seed), one table.

    .venv/bin/python -m simulations.compare --config simulations/configs/NAME.toml [--publish] [--force]

Every cell is a real `flwr run . --stream` (:mod:`harness.engine`) of the apps in ``client/`` and
``server/``, sharing one local SuperLink. It writes ``outputs/NAME/``: ``runs/<cell>/`` (each run's own
metrics, checkpoints and plot), ``cells/<cell>.json`` (a finished cell is not run again unless ``--force``),
``results.json``, ``summary.md`` (mean ± s.e. over seeds, the paired difference to fedavg and to the strongest
control for the server-held data, and what each row reads of that data) and one accuracy-against-round plot per
split and width mix, one curve per aggregation. ``--publish`` copies the summary, JSON and plots to
``simulations/results/NAME/``; ``--from-results`` summarises the rows of an earlier results.json again, running
nothing (cells the grid gained since are listed as not run yet); ``--reuse`` takes its finished cells and runs the
rest of the grid; ``--extend`` continues saved cells from their last checkpoint once num-server-rounds is raised.

Config: ``[experiment]`` (name, num-supernodes, seeds, aggregations), ``[run]`` (run-config keys shared by
every cell) and ``[[splits]]`` / ``[[widths]]`` tables, each a ``label`` plus the run-config keys it sets. An
aggregation is a name, or a variant: a table with a ``label``, its ``aggregation`` and the keys it sets.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from federation.preflight import check_run_config
from federation.settings import CONTROLS, DATA_AGGREGATIONS, SLICED, RunSettings
from glmc.errors import ConfigError
from harness.engine import PROJECT, exit_on_sigterm, local_superlink_env, run_simulation
from harness.tomlfile import read_toml
from server.plots import plot_curves
from server.records import ACCURACY_AT, first_round_at

log = logging.getLogger("simulations.compare")


@dataclass(frozen=True)
class Experiment:
    """One config file: the grid's axes and the run config every cell shares."""

    name: str
    num_supernodes: int
    seeds: tuple[int, ...]
    run: dict[str, Any]
    splits: tuple[dict[str, Any], ...]
    widths: tuple[dict[str, Any], ...]
    variants: dict[str, dict[str, Any]]  # label → the run-config keys of that aggregation (at least its name)

    @property
    def aggregations(self) -> tuple[str, ...]:
        """The labels in config order: an aggregation's name, or a variant's label."""
        return tuple(self.variants)

    @classmethod
    def load(cls, path: Path) -> Experiment:
        """The config at ``path``, every cell's run config checked by the apps' parser before any cell runs; a
        missing file, bad TOML, a missing key or a bad run-config value is a one-line ConfigError."""
        try:
            raw = read_toml(path)
            exp = raw["experiment"]
            splits, widths = (tuple(raw.get(axis, [{"label": "default"}])) for axis in ("splits", "widths"))
            loaded = cls(exp["name"], int(exp["num-supernodes"]), tuple(exp["seeds"]), dict(raw.get("run", {})),
                         splits, widths, dict(_variant(a) for a in exp["aggregations"]))
        except KeyError as err:
            raise ConfigError(f"{path} lacks {err.args[0]!r} ([experiment] needs name, num-supernodes, seeds and "
                              "aggregations)") from err
        for cell in grid(loaded):
            try:
                cell.run_config(loaded, Path("outputs"))
            except ConfigError as err:
                raise ConfigError(f"{path}, cell {cell.name}: {err}") from err
        return loaded


@dataclass(frozen=True)
class Cell:
    """One simulation of the grid."""

    aggregation: str
    split: dict[str, Any]
    widths: dict[str, Any]
    seed: int

    @property
    def name(self) -> str:
        return f"{self.aggregation}_{self.split['label']}_{self.widths['label']}_s{self.seed}"

    def run_config(self, exp: Experiment, out: Path) -> dict[str, Any]:
        """The run-config overrides of this cell, checked by the apps' own parser before anything starts."""
        config = {**exp.run, **_keys(self.split), **_keys(self.widths), **exp.variants[self.aggregation],
                  "seed": self.seed, "output-dir": str(out / "runs"), "run-name": self.name}
        check_run_config(config)  # every cell's keys, values and fit, before any cell runs
        return config


def _keys(axis: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in axis.items() if k != "label"}


def _variant(entry: str | dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """An ``aggregations`` entry as (label, run-config keys): a name stands for itself."""
    if isinstance(entry, str):
        return entry, {"aggregation": entry}
    if "label" not in entry or "aggregation" not in entry:
        raise ConfigError(f"an aggregation variant needs a label and an aggregation: {entry}")
    return entry["label"], _keys(entry)


def server_data_read(exp: Experiment, label: str) -> str:
    """What aggregation ``label`` reads of the server-held data: "none", "inputs", "labels" (and inputs) or
    "generated" (no data: the clients' models write it); "unknown" where its keys do not parse: an Experiment
    rebuilt from results.json rows alone, a variant's label standing for its aggregation (such a results.json says
    it in ``server_data_read``)."""
    keys = {**exp.run, **_keys(exp.splits[0]), **_keys(exp.widths[0]), **exp.variants[label]}
    try:
        return RunSettings.from_run_config(keys).server_data_read()
    except ConfigError:
        return "unknown"


def controls(exp: Experiment) -> list[str]:
    """The labels of the grid's controls for the server-held data (fedavg-ft, server-only and their variants)."""
    return [label for label, keys in exp.variants.items() if keys["aggregation"] in CONTROLS]


def grid(exp: Experiment) -> list[Cell]:
    """Seed by seed: each seed runs every aggregation before the next starts, so a grid stopped part-way (its
    finished cells are kept) already holds paired comparisons."""
    return [Cell(a, s, w, seed) for seed in exp.seeds for s in exp.splits for w in exp.widths for a in exp.aggregations]


def run_cell(exp: Experiment, cell: Cell, out: Path, env: dict[str, str], gpus_per_client: float = 0.0,
             earlier: dict[str, Any] | None = None) -> dict[str, Any]:
    """Simulate one cell and return its row: identity, status, wall time, per-round records. ``earlier``: the
    saved row of a shorter run of it, continued from its last checkpoint (resume), its wall time counted too."""
    config = cell.run_config(exp, out) | ({"resume": True} if earlier else {})
    log.info("%s %s", "extending" if earlier else "running", cell.name)
    result = run_simulation(config, exp.num_supernodes, gpus_per_client=gpus_per_client, env=env)
    metrics_path = out / "runs" / cell.name / "metrics.json"
    records = json.loads(metrics_path.read_text())["records"] if result.ok and metrics_path.is_file() else []
    status, details = rounds_status(result.status, result.details, records)
    extended = {"extended_from": ran(earlier)} if earlier else {}
    return cell_row(cell, status, details, round(result.seconds + (earlier or {}).get("seconds", 0.0), 1), records,
                    load=[round(x, 2) for x in os.getloadavg()], **extended)


def ran(row: dict[str, Any]) -> int:
    """The rounds a saved row's run trained."""
    return max((r["round"] for r in row["records"]), default=0)


def short_cells(exp: Experiment, out: Path) -> list[str]:
    """The saved cells in ``out`` whose run trained fewer rounds than the grid asks now (num-server-rounds raised)."""
    short = []
    for cell in grid(exp):
        saved = out / "cells" / f"{cell.name}.json"
        asked = RunSettings.from_run_config(cell.run_config(exp, out)).num_server_rounds
        if saved.is_file() and ran(json.loads(saved.read_text())) < asked:
            short.append(cell.name)
    return short


def rounds_status(status: str, details: str, records: Sequence[dict[str, Any]]) -> tuple[str, str]:
    """A run that finished with a trained round that kept the global model (too few valid replies: e.g. clients
    killed for memory) is not the grid's experiment: ``failed:not-aggregated``, so it is not saved and runs again.
    full-width-only keeping the model in a round that sampled too few full-width clients is its own rule, not that."""
    kept = [r for r in records if r["round"] > 0 and not r["aggregated"] and not _left_out_by_design(r)]
    if not kept:
        return status, details
    why = (kept[0]["dropped"] or [kept[0].get("failure") or "too few replies"])[0]
    return "failed:not-aggregated", f"rounds {[r['round'] for r in kept]} kept the global model: {why[:300]}"


def _left_out_by_design(record: dict[str, Any]) -> bool:
    """A round whose valid replies full-width-only left out (narrow ones), with nothing dropped and nothing failed."""
    return bool(record.get("left_out")) and not record["dropped"] and not record.get("failure")


def recovered(cell: Cell, out: Path) -> dict[str, Any] | None:
    """The row of a cell whose run finished (its server log says so) but was not saved, as a later status rule judges
    it (:func:`rounds_status`); its wall time is its rounds' own (the start-up is not known), its load not recorded.
    None where the run did not finish."""
    run = out / "runs" / cell.name
    log_file, metrics = run / "server.log", run / "metrics.json"
    if not (log_file.is_file() and metrics.is_file() and "run finished" in log_file.read_text()):
        return None
    records = json.loads(metrics.read_text())["records"]
    status, details = rounds_status("finished:completed", "", records)
    return cell_row(cell, status, details, round(sum(r["round_seconds"] for r in records), 1), records,
                    recovered=True)


def pending(cell: Cell) -> dict[str, Any]:
    """The row of a cell not run yet (``--finished-only``): counted in a group's runs, with no records."""
    return cell_row(cell, "pending", "", 0.0, [])


def cell_row(cell: Cell, status: str, details: str, seconds: float, records: list[dict[str, Any]],
             **extra: Any) -> dict[str, Any]:
    """A cell's row of results.json: its identity, status, wall time, anything ``extra`` and its round records."""
    return {"cell": cell.name, "aggregation": cell.aggregation, "split": cell.split["label"],
            "widths": cell.widths["label"], "seed": cell.seed, "status": status, "details": details,
            "seconds": seconds, **extra, "records": records}


def run_grid(exp: Experiment, out: Path, force: bool, reused: Sequence[dict[str, Any]] = (),
             gpus_per_client: float = 0.0, selected: Callable[[Cell], bool] = lambda cell: True,
             recover: bool = False) -> list[dict[str, Any]]:
    """Every cell, reusing the saved rows of finished ones (and the finished ``reused`` rows of an earlier
    results.json) unless ``force``; cells not ``selected`` are run by no one here, only summarised (another process
    may run them: each finished cell is saved on its own). A saved cell that ran fewer rounds than the grid asks
    (:func:`short_cells`) is continued from its last checkpoint. ``gpus_per_client``: see :func:`run_simulation`.
    ``recover``: first save the cells whose run finished but was not saved (:func:`recovered`)."""
    earlier = {r["cell"]: r for r in reused if r["status"] == "finished:completed"}
    short = set(short_cells(exp, out))
    rows = []
    with local_superlink_env() as env:
        for cell in grid(exp):
            saved = out / "cells" / f"{cell.name}.json"
            keep = not force or not selected(cell)  # --force runs again only the cells this process runs
            if cell.name in earlier and keep:
                rows.append(earlier[cell.name])
                continue
            if recover and not saved.is_file() and (row := recovered(cell, out)) is not None \
                    and row["status"] == "finished:completed":
                saved.parent.mkdir(parents=True, exist_ok=True)
                saved.write_text(json.dumps(row))
            if saved.is_file() and keep and cell.name not in short:
                rows.append(json.loads(saved.read_text()))
                continue
            if not selected(cell):
                rows.append(pending(cell))
                continue
            shorter = json.loads(saved.read_text()) if cell.name in short and keep else None
            row = run_cell(exp, cell, out, env, gpus_per_client, earlier=shorter)
            if row["status"] == "finished:completed":
                saved.parent.mkdir(parents=True, exist_ok=True)
                saved.write_text(json.dumps(row))
            rows.append(row)
    return rows


def saved_rows(exp: Experiment, path: Path) -> list[dict[str, Any]]:
    """The rows of an earlier ``results.json`` of this experiment (cells of this grid, maybe not all of them); a file
    of another experiment, of cells outside this grid or of another [run] config is a one-line ConfigError."""
    try:
        saved = json.loads(path.read_text())
        name, config, rows = saved["experiment"], saved["config"], saved["rows"]
        cells = {r["cell"] for r in rows}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"cannot read the rows of {path}: {err!r}") from err
    if name != exp.name or not cells <= {c.name for c in grid(exp)}:
        raise ConfigError(f"{path} holds experiment {name!r} with other cells than the {exp.name!r} grid")
    if config != exp.run:
        raise ConfigError(f"{path} ran with another [run] config than {exp.name!r} has now")
    return list(rows)


def whole_grid(exp: Experiment, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` in grid order, a pending row for every cell they lack (one the grid gained after they ran)."""
    by_cell = {r["cell"]: r for r in rows}
    return [by_cell.get(cell.name) or pending(cell) for cell in grid(exp)]


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (0 for one value)."""
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return statistics.fmean(values), se


def final(row: dict[str, Any], key: str) -> float | None:
    """``key`` of the last round that has it."""
    values = [r[key] for r in row["records"] if r.get(key) is not None]
    return values[-1] if values else None


def trained(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The records of the trained rounds (round 0 is the initial model)."""
    return [r for r in row["records"] if r["round"] > 0]


def round_mean(row: dict[str, Any], last: int | None = None, key: str = "central_accuracy") -> float | None:
    """Mean ``key`` (central accuracy) over the trained rounds (the last ``last`` of them if given): steadier than the
    final round's, which swings by several points from round to round in the drift runs."""
    values = [r[key] for r in trained(row) if r.get(key) is not None]
    kept = values[-last:] if last else values
    return statistics.fmean(kept) if kept else None


PLATEAU_SHARE, PLATEAU_GAIN = 0.2, 0.005  # a run has plateaued when its last 20% of rounds gain under 0.5 points
PLATEAU = "last 20% of rounds gain (pts), runs under 0.5"


def late_gain(row: dict[str, Any]) -> float | None:
    """What the last 20% of the trained rounds gained in central accuracy: their mean minus the mean of the 20% before
    them (the gain of a steady climb, and steadier than two single rounds' evaluations)."""
    values = [r["central_accuracy"] for r in trained(row) if r.get("central_accuracy") is not None]
    k = max(1, round(PLATEAU_SHARE * len(values)))
    if len(values) < 2 * k:
        return None
    return statistics.fmean(values[-k:]) - statistics.fmean(values[-2 * k:-k])


def plateau_column(ok: list[dict[str, Any]]) -> str:
    """The late gain (mean ± s.e., points) and how many runs stayed under PLATEAU_GAIN."""
    gains = [g for r in ok if (g := late_gain(r)) is not None]
    return f"{_fmt(gains)} ({sum(g < PLATEAU_GAIN for g in gains)}/{len(ok)})" if gains else "–"


def paired(ok: list[dict[str, Any]], base: list[dict[str, Any]], metric: Callable[[dict[str, Any]], float | None],
           ) -> list[float]:
    """``metric`` of each finished run minus that of the ``base`` run of its seed."""
    by_seed = {r["seed"]: metric(r) for r in base}
    return [a - b for r in ok if (a := metric(r)) is not None and (b := by_seed.get(r["seed"])) is not None]


# The summary's columns of paired differences from FedAvg: final accuracy, and its mean over the last rounds / all.
DELTAS: tuple[tuple[str, Callable[[dict[str, Any]], float | None]], ...] = (
    ("Δ vs fedavg (pts)", lambda r: final(r, "central_accuracy")),
    ("Δ, last 3 rounds", lambda r: round_mean(r, 3)),
    ("Δ, all rounds", round_mean),
)


def tier_accuracies(row: dict[str, Any]) -> dict[str, list[tuple[int, float | None]]]:
    """Width tier ("0.5") → (round, central accuracy of the global model at that tier) over the row's rounds."""
    tiers = dict.fromkeys(k.removeprefix(ACCURACY_AT) for r in row["records"] for k in r.get("tier_metrics", {})
                          if k.startswith(ACCURACY_AT))
    return {t: [(r["round"], r.get("tier_metrics", {}).get(ACCURACY_AT + t)) for r in row["records"]] for t in tiers}


def tier_columns(ok: list[dict[str, Any]], target: float) -> dict[str, str]:
    """Per width tier: the final accuracy at it (%, mean ± s.e.) and the rounds to ``target`` (mean over the runs
    that reached it, and how many did)."""
    columns = {}
    tiers = dict.fromkeys(t for r in ok for t in tier_accuracies(r))
    for tier in tiers:
        curves = [tier_accuracies(r).get(tier, []) for r in ok]
        columns[f"accuracy@{tier} %"] = _fmt([next((a for _, a in reversed(c) if a is not None), None)
                                              for c in curves])
        reached = [k for c in curves if (k := first_round_at(c, target)) is not None]
        columns[f"rounds to {target:g}@{tier}"] = (f"{statistics.fmean(reached):.1f} ({len(reached)}/{len(ok)})"
                                                   if reached else f"– (0/{len(ok)})")
    return columns


def align_share(row: dict[str, Any]) -> float | None:
    """Alignment seconds over total round seconds, over the trained rounds."""
    rounds = trained(row)
    total = sum(r["round_seconds"] for r in rounds)
    return sum(r["align_seconds"] for r in rounds) / total if total else None


TIME_SPLIT = "round s: nodes (their training) / aggregation / evaluation"
TIME_KEYS = ("nodes_seconds", "train_seconds", "aggregate_seconds", "evaluate_seconds")


def time_split(ok: list[dict[str, Any]]) -> str:
    """Where a trained round's wall time went, mean over the rounds and runs: the nodes' phase (instructions out to
    the last reply in), the clients' own training within it (summed over them: they train side by side), the
    aggregation (alignment included) and the central evaluation at every tier."""
    rounds = [r for row in ok for r in trained(row)]
    means = [statistics.fmean(r[key] for r in rounds) for key in TIME_KEYS] if rounds else []
    return "{:.1f} ({:.1f}) / {:.1f} / {:.1f}".format(*means) if means else "–"


SET_ASIDE = "rounds set aside %"  # the summary's column, there when the guard set any round aside
# The clients' mean pairwise distance before and after alignment, averaged over every trained round: the last round
# alone hid the rounds where matching acted (from independent inits, only the first).
DISTANCE = "distance before → after, mean of rounds"
SET_ASIDE_NOTE = ("Rounds set aside: the share of trained rounds whose matching brought the clients less than "
                  "min-alignment-gain closer; the guard merged those rounds unmatched (at equal widths as FedAvg, so "
                  "an equal-width row at 100 is FedAvg's run; across widths as the canonical ablation).\n")


def unaligned_share(row: dict[str, Any]) -> float | None:
    """The share of trained rounds whose alignment min-alignment-gain set aside (merged unmatched)."""
    rounds = trained(row)
    return sum(bool(r.get("unaligned")) for r in rounds) / len(rounds) if rounds else None


def defences(row: dict[str, Any]) -> str:
    """What the robust defences did over the trained rounds: rounds that capped a num-examples or clipped a client
    (after matching; before it in brackets), rounds that recentred one (center-clip-ratio), rounds kept for a
    failure, and the largest spread (the farthest client's distance from the global model over the lower median's),
    which the clip-ratio must clear."""
    rounds = trained(row)
    spreads = [r["spread"] for r in rounds if r.get("spread") is not None]
    acted = {k: sum(r.get(k, 0) > 0 for r in rounds) for k in ("capped", "clipped", "clipped_before", "recentred")}
    return (f"{acted['capped']}, {acted['clipped']} ({acted['clipped_before']}), {acted['recentred']}, "
            f"{sum(bool(r.get('failure')) for r in rounds)}; {max(spreads):.2f}" if spreads else "–")


def _fmt(values: Sequence[float | None], scale: float = 100.0, digits: int = 1) -> str:
    kept = [v * scale for v in values if v is not None]
    if not kept:
        return "–"
    mean, se = mean_se(kept)
    return f"{mean:.{digits}f} ± {se:.{digits}f}"


def groups(exp: Experiment) -> list[tuple[str, str]]:
    """(split, widths) labels in config order."""
    return [(s["label"], w["label"]) for s in exp.splits for w in exp.widths]


def select(rows: list[dict[str, Any]], split: str, widths: str, aggregation: str) -> list[dict[str, Any]]:
    return [r for r in rows if (r["split"], r["widths"], r["aggregation"]) == (split, widths, aggregation)]


# How the summary names what a row reads of the server-held data.
READS = {"none": "no", "inputs": "inputs", "labels": "inputs + labels", "generated": "text the clients wrote",
         "unknown": "–"}


def finished(rows: list[dict[str, Any]], split: str, widths: str, aggregation: str) -> list[dict[str, Any]]:
    return [r for r in select(rows, split, widths, aggregation) if r["status"] == "finished:completed"]


def width_baselines(exp: Experiment) -> list[str]:
    """The labels of the grid's width baselines, where it has any beside HeteroFL: the aggregations that neither
    align nor read server data (fedavg/HeteroFL, fedrolex, smallest-width, full-width-only, fjord)."""
    found = [label for label, keys in exp.variants.items()
             if keys["aggregation"] in SLICED and keys["aggregation"] not in DATA_AGGREGATIONS]
    return found if len(found) > 1 else []


def strongest(rows: list[dict[str, Any]], labels: Sequence[str], split: str, widths: str) -> str | None:
    """The label of highest mean final accuracy in this group (None: none of them finished a run)."""
    scores = {label: statistics.fmean(accs) for label in labels
              if (accs := [a for r in finished(rows, split, widths, label)
                           if (a := final(r, "central_accuracy")) is not None])}
    return max(scores, key=scores.__getitem__) if scores else None


def delta_against(rows: list[dict[str, Any]], labels: Sequence[str], split: str,
                  widths: str) -> Callable[[str], str]:
    """agg → its paired final-accuracy Δ against the group's strongest of ``labels``, naming it."""
    best = strongest(rows, labels, split, widths)
    base = finished(rows, split, widths, best) if best else []

    def delta(agg: str) -> str:
        if best is None or agg == best:
            return "–"
        text = _fmt(paired(finished(rows, split, widths, agg), base, lambda r: final(r, "central_accuracy")))
        return text if text == "–" else f"{text} (vs {best})"

    return delta


def summary_rows(rows: list[dict[str, Any]], exp: Experiment,
                 reads: dict[str, str] | None = None) -> list[dict[str, str]]:
    """One table row per (split, widths, aggregation): accuracies in %, mean ± s.e. over seeds; what the row reads
    of the server-held data (``reads``: label → a ``server_data_read`` value, default: from ``exp``); with controls
    in the grid, its Δ against the strongest of them."""
    reads = reads or {label: server_data_read(exp, label) for label in exp.aggregations}
    table = []
    guarded = any(r.get("unaligned") for row in rows for r in row["records"])
    target = float(exp.run.get("target-accuracy", RunSettings.target_accuracy))
    defended = any("spread" in r for row in rows for r in row["records"])
    settles = any(late_gain(row) is not None for row in rows if row["status"] == "finished:completed")
    timed = all(k in r for row in rows for r in trained(row) for k in TIME_KEYS) and any(map(trained, rows))
    for split, widths in groups(exp):
        base = finished(rows, split, widths, "fedavg")
        against_control = delta_against(rows, controls(exp), split, widths)
        against_baseline = delta_against(rows, width_baselines(exp), split, widths)
        for agg in exp.aggregations:
            cell = select(rows, split, widths, agg)
            ok = [r for r in cell if r["status"] == "finished:completed"]
            deltas = {name: "–" if agg == "fedavg" else _fmt(paired(ok, base, metric)) for name, metric in DELTAS}
            table.append({
                "split": split, "widths": widths, "aggregation": agg,
                "server data read": READS[reads.get(agg, "unknown")], "runs": f"{len(ok)}/{len(cell)}",
                "accuracy %": _fmt([final(r, "central_accuracy") for r in ok]), **tier_columns(ok, target),
                **({PLATEAU: plateau_column(ok)} if settles else {}), **deltas,
                **({"Δ vs strongest control (pts)": against_control(agg)} if controls(exp) else {}),
                **({BEST_BASELINE: against_baseline(agg)} if width_baselines(exp) else {}),
                "clients % (mean)": _fmt([final(r, "mean_client_accuracy") for r in ok]),
                "ensemble %": _fmt([final(r, "ensemble_accuracy") for r in ok]),
                "align / round time %": _fmt([align_share(r) for r in ok]),
                **({TIME_SPLIT: time_split(ok)} if timed else {}),
                DISTANCE: " → ".join(_fmt([round_mean(r, key=key) for r in ok], 1, 2)
                                     for key in ("distance_before", "distance_after")),
                **({SET_ASIDE: _fmt([unaligned_share(r) for r in ok], digits=0)} if guarded else {}),
                **({"rounds capped, clipped (before matching), recentred, failed; max spread": " / ".join(
                    defences(r) for r in ok)} if defended else {}),
            })
    return table


def markdown(table: list[dict[str, str]]) -> str:
    """The table in markdown: every row's columns in order of first appearance, "–" where a row has none (a cell
    with no finished run has no per-tier columns)."""
    head = list(dict.fromkeys(h for row in table for h in row))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join([*lines, *("| " + " | ".join(row.get(h, "–") for h in head) + " |" for row in table)])


def plot_groups(rows: list[dict[str, Any]], exp: Experiment, out: Path) -> list[Path]:
    """accuracy-<split>-<widths>.png: mean central accuracy per round (± s.e. band), one curve per aggregation."""
    paths = []
    for split, widths in groups(exp):
        curves, bands = {}, {}
        for agg in exp.aggregations:
            runs = [r for r in select(rows, split, widths, agg) if r["records"]]
            rounds = sorted({rec["round"] for r in runs for rec in r["records"]})
            stats = [mean_se([rec["central_accuracy"] for r in runs for rec in r["records"]
                              if rec["round"] == k and rec["central_accuracy"] is not None] or [math.nan])
                     for k in rounds]
            curves[agg] = [(k, None if math.isnan(m) else m) for k, (m, _) in zip(rounds, stats, strict=True)]
            bands[agg] = [se for _, se in stats]
        title = f"{exp.name}: {split}, widths {widths} ({len(exp.seeds)} seeds)"
        paths.append(plot_curves(curves, out / f"accuracy-{split}-{widths}.png", title, bands, "central test accuracy"))
        tiers = tier_curves(rows, exp, split, widths)
        if tiers:
            paths.append(plot_curves(tiers, out / f"accuracy-{split}-{widths}-tiers.png", f"{title}, by width tier",
                                     ylabel="central test accuracy at the tier"))
    return paths


def tier_curves(rows: list[dict[str, Any]], exp: Experiment, split: str,
                widths: str) -> dict[str, list[tuple[int, float | None]]]:
    """"<aggregation> @<tier>" → mean accuracy per round of the global model at each narrow tier, over the seeds."""
    curves: dict[str, list[tuple[int, float | None]]] = {}
    for agg in exp.aggregations:
        runs = [tier_accuracies(r) for r in select(rows, split, widths, agg) if r["records"]]
        for tier in dict.fromkeys(t for run in runs for t in run if t != "1"):
            by_round: dict[int, list[float]] = {}
            for run in runs:
                for k, a in run.get(tier, []):
                    if a is not None:
                        by_round.setdefault(k, []).append(a)
            curves[f"{agg} @{tier}"] = [(k, statistics.fmean(v)) for k, v in sorted(by_round.items())]
    return curves


def provenance(config: Path, rows: list[dict[str, Any]]) -> str:
    """How the table was made: the command, the machine, the summed wall time of the runs and their load."""
    import platform

    import torch

    minutes = sum(r["seconds"] for r in rows) / 60
    loads = [r["load"][0] for r in rows if r.get("load")]
    load = (f"1-minute load average at the end of each run {min(loads):.1f}–{max(loads):.1f}" if loads else
            "the load was not recorded (these runs predate its recording)")
    if found := sum(bool(r.get("recovered")) for r in rows):
        load += (f"; {found} cells recovered from their run folders (--recover: saved after a later status rule), "
                 "their wall time their rounds' own and their load not recorded")
    return (f"Command: `python -m simulations.compare --config {config}`. Machine: {platform.machine()}, "
            f"{os.cpu_count()} cores, python {platform.python_version()}, torch {torch.__version__}; the runs took "
            f"{minutes:.0f} min of wall time in all (cells reused from earlier runs included); {load}.\n")


def write_outputs(exp: Experiment, rows: list[dict[str, Any]], out: Path, config: Path) -> tuple[str, list[Path]]:
    """results.json, summary.md and the plots; returns the table and the plot paths."""
    summary = summary_rows(rows, exp)
    table = markdown(summary)
    reads = {label: server_data_read(exp, label) for label in exp.aggregations}
    (out / "results.json").write_text(json.dumps({"experiment": exp.name, "config": exp.run, "rows": rows,
                                                  "server_data_read": reads, "controls": controls(exp)}, indent=1))
    plots = plot_groups(rows, exp, out)
    settings = ", ".join(f"{k}={v}" for k, v in exp.run.items())
    waiting = [r["cell"] for r in rows if r["status"] == "pending"]
    partial = (f"**Partial:** {len(rows) - len(waiting)} of {len(rows)} cells finished; not run yet: "
               f"{', '.join(waiting)}.\n" if waiting else "")
    text = (f"# {exp.name}\n\n{partial}{provenance(config, rows)}"
            f"{exp.num_supernodes} clients, seeds {list(exp.seeds)}; {settings}.\n"
            "Accuracy: the global model on the central test set after the last round, mean ± s.e. over seeds; "
            "Δ: paired by seed, of that accuracy, of its mean over the last 3 rounds, and of its mean over all "
            "trained rounds (which also rewards getting there sooner). Server data read: what the aggregation reads "
            "of the samples the server holds back from every client (no / their inputs only / inputs + labels)."
            f"{CONTROL_NOTE if controls(exp) else ''}{BASELINE_NOTE if width_baselines(exp) else ''}\n"
            + (SET_ASIDE_NOTE if SET_ASIDE in summary[0] else "") + "\n"
            + table + "\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n")
    (out / "summary.md").write_text(text)
    return table, plots


BEST_BASELINE = "Δ vs best width baseline (pts)"
BASELINE_NOTE = (" Δ vs best width baseline: paired by seed, against the best (by mean accuracy) of the grid's "
                 "aggregations that neither align nor read server data (HeteroFL, FedRolex, smallest-width, "
                 "full-width-only, FjORD).")
CONTROL_NOTE = (" Δ vs strongest control: paired by seed, against the better (by mean accuracy) of the grid's "
                "controls for the server-held data, which read its labels: fedavg-ft (FedAvg, then its model trained "
                "on those samples) and server-only (a model trained on them alone, from scratch, ignoring the "
                "clients), each with the same server-side budget as learned alignment's refinement.")


def selection(exp: Experiment, seeds: Sequence[int] | None, labels: Sequence[str] | None,
              splits: Sequence[str] | None = None) -> Callable[[Cell], bool]:
    """Which cells this process runs (``--seeds``, ``--only``, ``--splits``: all when not given); a seed, label or
    split the grid lacks is a one-line ConfigError."""
    if unknown := sorted(set(seeds or ()) - set(exp.seeds)):
        raise ConfigError(f"--seeds {unknown} are not seeds of {exp.name!r}: {exp.seeds}")
    if unknown_labels := sorted(set(labels or ()) - set(exp.aggregations)):
        raise ConfigError(f"--only {unknown_labels} are not aggregations of {exp.name!r}: {list(exp.aggregations)}")
    split_labels = [s["label"] for s in exp.splits]
    if unknown_splits := sorted(set(splits or ()) - set(split_labels)):
        raise ConfigError(f"--splits {unknown_splits} are not splits of {exp.name!r}: {split_labels}")
    return lambda cell: ((seeds is None or cell.seed in seeds) and (labels is None or cell.aggregation in labels)
                         and (splits is None or cell.split["label"] in splits))


def publish(out: Path, name: str, plots: Sequence[Path]) -> Path:
    """Copy summary.md, results.json and this grid's ``plots`` to simulations/results/NAME/ (committed); not every
    plot in ``out``: one left there by an earlier design of the grid (a split it dropped) would be published as its."""
    dest = PROJECT / "simulations" / "results" / name
    dest.mkdir(parents=True, exist_ok=True)
    for path in [out / "summary.md", out / "results.json", *plots]:
        shutil.copy2(path, dest / path.name)
    return dest


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations.compare", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, type=Path, help="simulations/configs/NAME.toml")
    parser.add_argument("--out", type=Path, help="output directory (default: outputs/NAME)")
    parser.add_argument("--publish", action="store_true", help="copy the summary to simulations/results/NAME")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--force", action="store_true", help="run finished cells again")
    mode.add_argument("--finished-only", action="store_true",
                      help="run nothing: summarise the cells already finished (e.g. while the grid runs)")
    mode.add_argument("--from-results", type=Path, metavar="JSON",
                      help="run nothing: summarise the rows of an earlier results.json of this experiment again "
                           "(e.g. simulations/results/NAME/results.json after the table gains a column; cells the "
                           "grid gained since are listed as not run yet)")
    mode.add_argument("--reuse", type=Path, metavar="JSON",
                      help="take the finished cells of an earlier results.json of this experiment and run only the "
                           "others (e.g. simulations/results/NAME/results.json after the grid gains an aggregation)")
    mode.add_argument("--extend", action="store_true",
                      help="continue each saved cell that ran fewer rounds than the config asks (num-server-rounds "
                           "raised) from its last checkpoint (resume), keeping its rounds; with lr-decay, set "
                           "lr-decay-rounds to the rounds its schedule spanned")
    parser.add_argument("--seeds", type=int, nargs="+", metavar="S",
                        help="run only the cells of these seeds (the others are summarised if finished, else "
                             "pending): several processes on one --out can share a grid, one cell each at a time")
    parser.add_argument("--only", nargs="+", metavar="LABEL", help="run only the cells of these aggregations "
                        "(labels of the config's aggregations), as --seeds does")
    parser.add_argument("--splits", nargs="+", metavar="LABEL", help="run only the cells of these splits (labels of "
                        "the config's [[splits]]), as --seeds does")
    parser.add_argument("--recover", action="store_true",
                        help="first save the cells whose run finished but was not saved (judged failed under an "
                             "earlier status rule, or the grid stopped before saving): their rows come from the run "
                             "folders, without their start-up time or load")
    parser.add_argument("--client-gpus", type=float, default=0.0, metavar="F",
                        help="GPUs per simulated client (Flower's client-resources-num-gpus; 0.25 puts four clients "
                             "on one GPU); the apps' client-device and server-device default to auto")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    exit_on_sigterm()
    try:
        if not args.client_gpus >= 0:
            raise ConfigError(f"--client-gpus must be ≥ 0, got {args.client_gpus}")
        if args.client_gpus and not torch.cuda.is_available():  # Ray would wait for a GPU forever
            raise ConfigError("--client-gpus asks for GPUs, but torch sees no CUDA GPU on this machine")
        exp = Experiment.load(args.config)
        selected = selection(exp, args.seeds, args.only, args.splits)
        if (args.seeds or args.only or args.splits) and (args.finished_only or args.from_results):
            raise ConfigError("--seeds, --only and --splits choose the cells to run; --finished-only and "
                              "--from-results run none")
        rows = whole_grid(exp, saved_rows(exp, args.from_results)) if args.from_results else None
        reused = saved_rows(exp, args.reuse) if args.reuse else []
        out = (args.out or PROJECT / "outputs" / exp.name).resolve()
        short = short_cells(exp, out)
        if short and not (args.extend or args.force or args.from_results or args.finished_only):
            raise ConfigError(f"{len(short)} saved cells of {out} ran fewer rounds than the config asks (first: "
                              f"{short[0]}): --extend continues them from their last checkpoint, --force runs "
                              "them again")
    except ConfigError as err:
        print(f"compare: error: {err}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    if rows is None:
        rows = run_grid(exp, out, args.force, reused=reused, gpus_per_client=args.client_gpus,
                        selected=(lambda cell: False) if args.finished_only else selected, recover=args.recover)
    table, plots = write_outputs(exp, rows, out, args.config)
    print(table)
    for path in plots:
        print(f"plot: {path}")
    if args.publish:
        print(f"published to {publish(out, exp.name, plots)}")
    failed = [r for r in rows if r["status"] not in ("finished:completed", "pending")]
    for row in failed:
        print(f"FAILED {row['cell']}: {row['status']} {row['details']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
