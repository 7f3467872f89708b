"""Where an aligned pair's midpoint loss comes from: each site of the model (the embeddings, each layer's heads,
each layer's MLP, the readout) moved alone to the midpoint of A and the aligned B, the rest left as it was. Uses
the barrier benchmark's checkpoints (no training here) and its config's ``[sites]`` table.

    .venv/bin/python -m simulations.analyses.barrier_sites [--config simulations/bench/configs/barriers.toml]
        [--models NAME ...]

A site's cost is ½[L(A, site at the midpoint) − L(A)] + ½[L(T(B), site at the midpoint) − L(T(B))]: what its own
misalignment adds, seen from both ends. The sites are read from the symmetry spec: a layer's modules with a head
axis are its heads, those with an MLP axis its MLP; outside the layers, one site per top-level module. Sites that
alignment leaves equal in both models (folded LayerNorms) are left out.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from glmc.archs import get_arch
from glmc.cli.options import parse_match_flags
from glmc.core.config import ModelConfig
from glmc.core.spec import HEADS, MLP, MLP_IN, QKV, SpecTable, expand
from glmc.core.state import State, mix
from glmc.data.tasks import held_out
from glmc.io.checkpoint import load_checkpoint
from glmc.match.align import align_pair
from glmc.merging.interpolation import evaluate_mixtures
from simulations.bench.barriers import machine, mean_se, seed_checkpoints, table_main

RESULTS = Path("simulations/results/barrier-sites")


def unit_of(axes: tuple[object, ...]) -> str | None:
    """The unit a tensor's axes name: "heads", "MLP", or None for residual-only tensors."""
    if HEADS in axes or QKV in axes:
        return "heads"
    return "MLP" if MLP in axes or MLP_IN in axes else None


def sites(spec: SpecTable, depth: int, a: State, b: State) -> dict[str, list[str]]:
    """Site → its tensor names, in the spec's order, leaving out the sites where A and B are equal. A layer's
    tensor joins the unit of its module (an output bias, residual-only, joins its weight's heads or MLP)."""
    named = {name: where for name, where in expand(spec, depth).items() if name in a}
    units = {name.rsplit(".", 1)[0]: unit for name, (_, template) in named.items()
             if (unit := unit_of(spec[template])) is not None}
    out: defaultdict[str, list[str]] = defaultdict(list)
    for name, (layer, _) in named.items():
        unit = units.get(name.rsplit(".", 1)[0], "other")
        out[name.split(".")[0] if layer is None else f"layer {layer} {unit}"].append(name)
    return {site: names for site, names in out.items() if not all(torch.equal(a[n], b[n]) for n in names)}


def losses(states: list[State], cfg: ModelConfig, test: Dataset) -> list[float]:
    """The held-out loss of each state, in float32 as ``glmc barrier`` evaluates."""
    return [evaluate_mixtures([state], [[1.0]], cfg, test, dtype=torch.float32)[0][0] for state in states]


def pair_sites(natives: tuple[State, State], cfg: ModelConfig, test: Dataset, method: str,
               matcher: list[str]) -> dict[str, Any]:
    """One pair aligned by ``method`` (``matcher``: its weight flags): the ends' and the midpoint's losses, and every
    site's cost."""
    aligned = align_pair(*natives, cfg, method, parse_match_flags(matcher))
    a, b = aligned.a, aligned.b
    mid = mix([a, b], [0.5, 0.5])
    named = sites(get_arch(cfg.family).spec, cfg.depth, a, b)
    moved = [end | {n: mid[n] for n in names} for names in named.values() for end in (a, b)]
    loss_a, loss_b, loss_mid, *rest = losses([a, b, mid, *moved], cfg, test)
    costs = {site: (rest[2 * i] - loss_a + rest[2 * i + 1] - loss_b) / 2 for i, site in enumerate(named)}
    return {"method": method, "loss_a": loss_a, "loss_b": loss_b, "midpoint": loss_mid - (loss_a + loss_b) / 2,
            "sites": costs}


def measure_model(run: dict[str, Any], table: dict[str, Any], model: dict[str, Any], command: str) -> dict[str, Any]:
    """Every pair of one model's seeds, by each of the table's methods."""
    began = time.perf_counter()
    settings = run | model.get("run", {})  # a model may override run settings such as limit
    pairs = list(itertools.combinations(seed_checkpoints(run, model), 2))
    reports = []
    for pa, pb in pairs:
        (sa, meta), (sb, _) = load_checkpoint(pa), load_checkpoint(pb)
        test = held_out(meta.dataset, meta.config, None, settings["limit"])
        reports.append([pair_sites((sa, sb), meta.config, test, method, table.get("matcher", []))
                        for method in table["methods"]])
        print(f"{pa.stem} {pb.stem}: " + ", ".join(f"{r['method']} midpoint {r['midpoint']:.3f}"
                                                   for r in reports[-1]), flush=True)
    return {"pairs": [[p.stem for p in pair] for pair in pairs], "methods": table["methods"], "reports": reports,
            "limit": settings["limit"], "command": command, "machine": machine(),
            "seconds": time.perf_counter() - began}


def cell(values: list[float]) -> str:
    """mean ± s.e. over the pairs."""
    mean, se = mean_se(values)
    return f"{mean:.3f} ± {se:.3f}"


def markdown(name: str, entry: dict[str, Any]) -> list[str]:
    """One model's table (a column per method) and how it was run."""
    methods, reports = entry["methods"], entry["reports"]
    column = {m: [pair[i] for pair in reports] for i, m in enumerate(methods)}
    lines = [f"## {name} ({len(entry['pairs'])} pairs)", "", "| site | " + " | ".join(methods) + " |",
             "|---|" + "---|" * len(methods),
             "| everything at the midpoint | " + " | ".join(cell([r["midpoint"] for r in column[m]])
                                                          for m in methods) + " |"]
    for site in dict.fromkeys(site for report in reports[0] for site in report["sites"]):
        lines.append(f"| {site} alone | " + " | ".join(
            cell([r["sites"][site] for r in column[m]]) if site in column[m][0]["sites"] else "—"
            for m in methods) + " |")
    return [*lines, "", f"Losses on the first {entry['limit']} test samples. Command: `{entry['command']}`. "
            f"Machine: {entry['machine']}; wall time {entry['seconds'] / 60:.1f} min.", ""]


HEADING = ["# Where the midpoint loss comes from", "",
           "Each row: the loss a site adds when it alone is moved to the midpoint of A and the aligned B (the mean "
           "of what it adds to A and to B), mean ± s.e. over the pairs; the first row moves every site at once "
           "(the midpoint's loss above the mean of the ends: the barrier at λ = 0.5). Sites interact, so the rows "
           "need not add up to the first.", ""]


def main(argv: list[str] | None = None) -> int:
    return table_main(argv, "sites", "simulations.analyses.barrier_sites", __doc__.splitlines()[0], measure_model,
                      RESULTS, HEADING, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
