"""docs/results.md from the committed ``simulations/results/*/results.json``: one section per experiment, its tables
rendered from the JSON by the code that published it (:mod:`simulations.compare` for the FL grids, a bench of
:mod:`simulations.bench` or an analysis of :mod:`simulations.analyses` for the others), which :data:`PUBLISHERS` names
and :func:`results_markdown` loads by name (see :mod:`harness`: the harness imports no experiment)."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from harness.engine import PROJECT

RESULTS = PROJECT / "simulations" / "results"
# The module of every FL grid's results (a results.json of an experiment's rows), and the columns of its summary kept
# here (summary.md has them all; its rounds-set-aside column is added where the grid has it).
COMPARE = "simulations.compare"
COMPARE_COLUMNS = ("split", "widths", "aggregation", "server data read", "runs", "accuracy %", "Δ vs fedavg (pts)",
                   "Δ, all rounds", "Δ vs strongest control (pts)")
# What each experiment asks, in the order the page gives them, and the page that discusses it.
ABOUT: dict[str, tuple[str, str]] = {
    "accelerator": ("The same workloads on an NVIDIA H200 and on this project's CPU.", "accelerators.md"),
    "oneshot": ("One-shot FL from independent inits: 5 clients, Dirichlet 0.5, one round.", "federated.md"),
    "oneshot-generated": ("One-shot FL of 3 independently trained GPT-2s with no server data: the server learns on "
                          "text the clients write.", "controls.md"),
    "drift": ("High drift: 5 clients, Dirichlet 0.1, 5 local epochs, 10 rounds, seeds 0–2.", "federated.md"),
    "drift-seeds": ("High drift on two more seeds (3, 4).", "federated.md"),
    "drift-repair": ("High drift with REPAIR of the merge on server-held images.", "federated.md"),
    "width-baselines": ("Mixed widths at the field's protocol: 100 clients, 10% a round, tiers 1/0.5/0.25, against "
                        "FedRolex and the homogeneous controls (vision).", "federated.md"),
    "width-baselines-plateau": ("The image protocol for 120 rounds, toward a plateau, with FjORD beside the other "
                                "width baselines, Dirichlet 0.3 and class shards.", "federated.md"),
    "width-plateau": ("The image protocol for 80 rounds under HeteroFL's step schedule (the rate a tenth after round "
                      "40), Dirichlet 0.3 and class shards.", "federated.md"),
    "width-plateau-multistep": ("The image protocol's Dirichlet split for 120 rounds under HeteroFL's multistep "
                                "schedule over 80 (a tenth of the rate after round 30, a hundredth after 50 and "
                                "held).", "federated.md"),
    "width-shards-plateau": ("Class shards under the same schedule with HeteroFL's masked cross-entropy "
                             "(label-mask).", "federated.md"),
    "width-shards-restricted": ("One HeteroFL run of those shards with the absent labels out of each client's "
                                "softmax (label-mask-fill = exclude): steadier, 10 points lower.", "federated.md"),
    "width-shards-momentum": ("One HeteroFL run of those shards with server momentum (FedAvgM): no swing, then a "
                              "slide.", "federated.md"),
    "width-baselines-text": ("The same protocol on text: llama-fl on Shakespeare, one client per role.",
                             "federated.md"),
    "width-text-plateau": ("The text protocol for 60 rounds under HeteroFL's multistep schedule (a tenth of the rate "
                           "after round 23, a hundredth after 38), toward a plateau.", "federated.md"),
    "width-text-learned": ("learned on the text protocol, with fedavg-ft and server-only on the same 1,000 "
                           "server-held windows.", "federated.md"),
    "width-images-learned": ("learned on the image protocol, with fedavg-ft and server-only on the same 2,000 "
                             "server-held images (seed 0 so far).", "federated.md"),
    "client-cost": ("A client's training against its central-test score (client-test), CPU seconds.",
                    "federated.md"),
    "widths-principal": ("Mixed widths (tiers 1, 0.5, 0.25) with principal placement, the default.", "federated.md"),
    "widths": ("Mixed widths with the aligned placement.", "federated.md"),
    "widths-repair": ("Mixed widths with REPAIR.", "federated.md"),
    "shakespeare": ("GPT-2 on Shakespeare, one client per role.", "federated.md"),
    "overhead": ("Alignment's share of a 10-client round.", "federated.md"),
    "barriers": ("Pairwise loss barriers of independently trained seeds, per matching method.", "methods.md"),
    "barriers-repair": ("Barriers with REPAIR at every point of the path.", "methods.md"),
    "forms": ("Barriers in the paper's rmsnorm and circuit forms.", "methods.md"),
    "weight-starts": ("Weight matching from several residual starts.", "methods.md"),
    "unsearched-drift": ("llama-tiny trained 100, 300 and 1000 steps: drift along the classes weight matching does "
                         "not search, and the barrier after balancing them.", "matching.md"),
    "learning-budget": ("Learned matching with more learning.", "methods.md"),
    "learned-gap": ("Where learned matching's gain over weight matching lies: the residual map or the unit maps.",
                    "methods.md"),
    "q-candidates": ("Candidates for weight matching's residual map, scored against the learned one.", "methods.md"),
    "barrier-sites": ("Where the remaining midpoint loss comes from.", "methods.md"),
    "matching-time": ("Weight-matching time.", "methods.md"),
    "merging": ("Merging N models, of one width and across widths.", "methods.md"),
    "families": ("Barriers between independently trained seeds of each declared family, per method.",
                 "families.md"),
    "llama-shakespeare": ("A causal LM family in the Flower apps: llama-tiny on Shakespeare's roles, FedAvg against "
                          "weight, from a shared start and from independent inits.", "federated.md"),
    "single-attacker": ("One attacker among three honest clients, per aggregation and defence, against the robust "
                        "defaults' target.", "reliability.md"),
}


def _demote(lines: list[str]) -> list[str]:
    """Headings one level down, so each experiment's own title nests under this page's."""
    return [f"#{line}" if line.startswith("#") else line for line in lines]


def _compare(data: dict[str, Any]) -> list[str]:
    """A comparison's table, reduced to its headline columns, from its rows alone."""
    compare = importlib.import_module(COMPARE)
    rows = data["rows"]
    labels = {axis: tuple({"label": v} for v in dict.fromkeys(r[axis] for r in rows)) for axis in ("split", "widths")}
    exp = compare.Experiment(data["experiment"], 0, tuple(dict.fromkeys(r["seed"] for r in rows)), data["config"],
                             labels["split"], labels["widths"],
                             {a: {"aggregation": a} for a in dict.fromkeys(r["aggregation"] for r in rows)})
    summary = compare.summary_rows(rows, exp, data.get("server_data_read"))
    kept = (*COMPARE_COLUMNS, compare.SET_ASIDE, compare.PLATEAU, compare.BEST_BASELINE, compare.TIME_SPLIT)
    table = [{k: v for k, v in row.items() if k in kept or k.startswith((compare.ACCURACY_AT, "rounds to "))}
             for row in summary]
    settings = ", ".join(f"{k}={v}" for k, v in data["config"].items())
    return [f"Seeds {list(exp.seeds)}; {settings}. Accuracy: the global model after the last round, mean ± s.e. over "
            "seeds; Δ: paired by seed with FedAvg (HeteroFL with mixed widths); server data read: what the row reads "
            "of the samples the server holds back ([controls.md](controls.md)); Δ vs strongest control: paired by seed "
            "with the better of fedavg-ft and server-only, where the grid has them; accuracy@tier: the global model "
            "as that tier's clients receive it; Δ vs best width baseline: paired by seed with the best of HeteroFL, "
            "FedRolex, smallest-width and full-width-only; last 20% of rounds gain: their mean accuracy minus that "
            "of the fifth before them, under 0.5 points at a plateau.", "", compare.markdown(table)]


def _per_model(bench: ModuleType, data: dict[str, Any]) -> list[str]:
    """A bench that publishes one entry per model: its ``HEADING``, then ``markdown(name, entry)`` of each."""
    entries = (line for name, entry in data.items() for line in bench.markdown(name, entry))
    return _demote([*bench.HEADING[2:], *entries])


def _barriers(bench: ModuleType, data: dict[str, Any]) -> list[str]:
    text = bench.markdown(data["rows"], data["timing"], data["meta"], bench.approximate_table(data["pairs"]))
    return text.splitlines()[2:]


def _merging(bench: ModuleType, data: dict[str, Any]) -> list[str]:
    return bench.markdown(data["rows"], data["simplex"], data["timing"], data["meta"]).splitlines()[2:]


def _matching_time(bench: ModuleType, data: dict[str, Any]) -> list[str]:
    load = ", ".join(f"{x:.1f}" for x in data["load_average"])
    return [f"Command: `python -m {bench.__name__}`; median wall and CPU seconds of weight matching at each torch "
            f"thread count; load average at the end {load}.", "", *bench.timing_table(data["timing"])]


def _accelerator(bench: ModuleType, data: dict[str, Any]) -> list[str]:
    return bench.table(data).splitlines()[2:]


def _markdown(bench: ModuleType, data: dict[str, Any]) -> list[str]:
    """A bench whose ``markdown(data)`` renders its whole results.json."""
    return bench.markdown(data)


Render = Callable[[ModuleType, dict[str, Any]], list[str]]
# Every results folder that is not an FL grid's and has a table here: the module that published it, and how that
# module renders it.
PUBLISHERS: dict[str, tuple[str, Render]] = {
    "barriers": ("simulations.bench.barriers", _barriers),
    "merging": ("simulations.bench.merging", _merging),
    "accelerator": ("simulations.bench.accelerator", _accelerator),
    "families": ("simulations.bench.families", _markdown),
    "single-attacker": ("simulations.bench.single_attacker", _markdown),
    "matching-time": ("simulations.analyses.matching_time", _matching_time),
    "barrier-sites": ("simulations.analyses.barrier_sites", _per_model),
    "barriers-repair": ("simulations.analyses.repair_barriers", _per_model),
    "forms": ("simulations.analyses.forms", _per_model),
    "learning-budget": ("simulations.analyses.learning_budget", _per_model),
    "learned-gap": ("simulations.analyses.learned_gap", _per_model),
    "q-candidates": ("simulations.analyses.q_candidates", _per_model),
    "weight-starts": ("simulations.analyses.weight_starts", _per_model),
    "unsearched-drift": ("simulations.analyses.unsearched_drift", _markdown),
    "client-cost": ("simulations.bench.client_cost", _markdown),
}


def _section(folder: Path) -> list[str]:
    data = json.loads((folder / "results.json").read_text())
    about, page = ABOUT.get(folder.name, ("", ""))
    if "rows" in data and "experiment" in data:
        body = _compare(data)
    elif folder.name in PUBLISHERS:
        module, render = PUBLISHERS[folder.name]
        body = render(importlib.import_module(module), data)
    else:
        body = ["(No table here for this experiment yet: see its summary.md.)"]
    where = f"Files: [`simulations/results/{folder.name}/`](../simulations/results/{folder.name}/)" + (
        f"; discussed in [{page}]({page})." if page else ".")
    return [f"## {folder.name}", "", *([about, ""] if about else []), where, "", *body, ""]


def results_markdown(root: Path = RESULTS) -> str:
    """The whole page: every folder with a results.json, in ``ABOUT``'s order, then any others by name."""
    folders = sorted((p.parent for p in root.glob("*/results.json")),
                     key=lambda f: (list(ABOUT).index(f.name) if f.name in ABOUT else len(ABOUT), f.name))
    head = ["# Results", "",
            "Every table below is rendered from a committed `results.json` by the code that measured it, so the page "
            "cannot drift from the data. Each experiment's folder also holds its full `summary.md` (the command, "
            "machine and wall time) and its plots; each config is in `simulations/configs/`, "
            "`simulations/bench/configs/` or `simulations/analyses/configs/`.", ""]
    return "\n".join([*head, *(line for folder in folders for line in _section(folder))])
