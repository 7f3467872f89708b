"""Data-free one-shot merging, offline: which data-free step moves a merge of independently trained clients towards
their mean accuracy. Reads the client models a one-shot FL run saved (``save-clients``) and scores merges of them
on the run's own central test subset, with no server-held data.

    .venv/bin/python -m simulations.analyses.oneshot_merge --runs outputs/oneshot/runs --cell fedavg-ft --seeds 0 1 2

Variants (every one data-free at the server; ``class-weighted head`` uses each client's label histogram, which the
client knows and would send with its model):

- ``largest client alone``: no merge: the client with the most examples (the data-free choice of one client).
- ``weight``: universe weight matching from the heaviest client, ``iters`` iterations; the FL ``weight`` cell.
- ``+ norms``: every merged MLP neuron and attention head rescaled to the clients' mean norm (restore-norms).
- ``last k blocks and head of the largest client``: partial merging: the merge (with norms) in the early blocks,
  the largest client's own last k blocks and head on top.
- ``t of the way from the largest client``: (1 − t)·(largest client, aligned) + t·(merge with norms), at fixed t;
  its control, ``no alignment``: the same path to the clients' unaligned weighted mean (t = 1: FedAvg, folded).
- ``+ class-weighted head``: each class's classifier row and bias the mean of the aligned clients' rows weighted
  by how many examples of that class each client trained on, not by its total: a client that never saw a class
  has an untrained row for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from federation.data import VAL_FRACTION, eval_subset, pool
from federation.settings import RunSettings
from glmc.archs import build_model, get_arch
from glmc.cli.options import add_match_arguments, match_options
from glmc.core.config import ModelConfig
from glmc.core.state import State
from glmc.io.checkpoint import load_checkpoint
from glmc.match.options import MatchOptions
from glmc.merging.evaluation import ensemble_metrics
from glmc.merging.options import MergeOptions
from glmc.merging.rescale import restore_norms
from glmc.merging.universe import members, universe_match
from glmc.symmetry.canonical import canonicalize
from glmc.train import evaluate, set_threads

log = logging.getLogger("simulations.analyses.oneshot_merge")

HEAD = ("head.w", "head.b")  # the canonical classifier: one row (and bias) per class


def load_clients(run: Path) -> tuple[RunSettings, list[State], list[float], list[list[int]]]:
    """The run's settings, its round-1 client models, their example counts and each one's label histogram."""
    header = json.loads((run / "metrics.json").read_text())
    settings = RunSettings.from_run_config(header["settings"])
    paths = sorted((run / "clients" / "round-001").glob("client-*.safetensors"), key=lambda p: int(p.stem[7:]))
    if not paths:
        raise SystemExit(f"{run} has no saved clients (run it with save-clients = true)")
    loaded = [load_checkpoint(p) for p in paths]
    examples = [meta.metrics["examples"] for _, meta in loaded]
    # A client trains on its partition less the validation tenth (federation.data.client_share): match it by that size.
    by_size = {sum(c) - int(sum(c) * VAL_FRACTION): c for c in header["split"]["label_counts"]}
    return settings, [s for s, _ in loaded], examples, [by_size[int(n)] for n in examples]


def class_weighted_head(merged: State, aligned: Sequence[State], counts: Sequence[Sequence[int]]) -> State:
    """``merged`` with each class's head row and bias averaged over the aligned clients by their count of it."""
    share = torch.tensor(counts, dtype=torch.float64)
    share = share / share.sum(0, keepdim=True).clamp_min(1)  # clients × classes
    out = dict(merged)
    for key in HEAD:
        stacked = torch.stack([a[key] for a in aligned])  # clients × classes [× width]
        w = share.reshape(*share.shape, *([1] * (stacked.dim() - 2))).to(stacked)
        out[key] = (w * stacked).sum(0)
    return out


def partial(merged: State, aligned: Sequence[State], keep: int, depth: int, ref: int) -> State:
    """``merged`` in its first ``depth - keep`` blocks; its last ``keep`` blocks, final norm and head those of
    aligned client ``ref`` (partial merging: the later layers of one client on the merged early ones)."""
    own = (*(f"blocks.{i}." for i in range(depth - keep, depth)), "norm.", "head.")
    return {k: aligned[ref][k] if k.startswith(own) else v for k, v in merged.items()}


def accuracy(native: State, cfg: ModelConfig, test: Any) -> float:
    model = build_model(cfg)
    model.load_state_dict({k: v.float() for k, v in native.items()}, strict=True)
    return float(evaluate(model, get_arch(cfg.family), test)["accuracy"])


Variant = Callable[[State, list[State]], State]


def variants(weights: Sequence[float], counts: Sequence[Sequence[int]], cfg: ModelConfig) -> dict[str, Variant]:
    """name → how to finish the matched merge (canonical merged, aligned clients → canonical model)."""
    def norms(m: State, a: list[State]) -> State:
        return restore_norms(m, a, cfg, weights)

    ref = max(range(len(weights)), key=weights.__getitem__)

    def last_blocks(k: int) -> Variant:
        return lambda m, a: partial(norms(m, a), a, k, cfg.depth, ref)

    def toward_largest(t: float) -> Variant:
        return lambda m, a: {k: (1 - t) * a[ref][k] + t * v for k, v in norms(m, a).items()}

    return {"": lambda m, a: m, " + norms": norms,
            " + class-weighted head": lambda m, a: class_weighted_head(m, a, counts),
            " + norms + class-weighted head": lambda m, a: class_weighted_head(norms(m, a), a, counts),
            **{f", last {k} blocks and head of the largest client": last_blocks(k) for k in (1, 3)},
            **{f" + norms, {t:g} of the way from the largest client": toward_largest(t) for t in (0.25, 0.5)}}


def seed_rows(run: Path, iters: Sequence[int], match: MatchOptions | None = None) -> dict[str, float]:
    """Test accuracy (%) of the clients, their ensemble and every merge variant, for one seed's saved clients; the
    universe's weight matching with ``match``'s options."""
    settings, natives, weights, counts = load_clients(run)
    cfg = pool(settings).task.config
    arch, test = get_arch(cfg.family), eval_subset(pool(settings).test, settings.eval_limit, settings.seed)
    models = []
    for native in natives:
        model = build_model(cfg)
        model.load_state_dict(native, strict=True)
        models.append(model.eval())
    alone = [100 * accuracy(n, cfg, test) for n in natives]
    rows = {"clients (mean)": statistics.fmean(alone), "largest client alone": alone[weights.index(max(weights))],
            "ensemble": 100 * float(ensemble_metrics(models, arch, test)["accuracy"])}
    states = [canonicalize(arch, n, cfg, dtype=torch.float64) for n in natives]
    ref = weights.index(max(weights))
    mean = {k: sum(w * s[k] for w, s in zip(weights, states, strict=True)) / sum(weights) for k in states[0]}
    for t in (0.25, 0.5, 1.0):  # the control of the rows below: the same path to the unaligned mean
        between = {k: (1 - t) * states[ref][k] + t * v for k, v in mean.items()}
        rows[f"no alignment, {t:g} of the way from the largest client"] = 100 * accuracy(
            arch.to_native(between, cfg), cfg, test)
    for n in iters:
        options = MergeOptions("weight", match or MatchOptions(), max_iters=n)
        result = universe_match(members(states, [cfg] * len(states), weights), cfg, options,
                                reference=max(range(len(states)), key=weights.__getitem__))
        for name, finish in variants(weights, counts, cfg).items():
            merged = finish(result.merged, result.aligned)
            rows[f"weight ({n} iters){name}"] = 100 * accuracy(arch.to_native(merged, cfg), cfg, test)
            log.info("%s: weight (%d iters)%s %.2f%%", run.name, n, name, rows[f"weight ({n} iters){name}"])
    return rows


def markdown(per_seed: dict[int, dict[str, float]]) -> str:
    names = list(next(iter(per_seed.values())))
    lines = ["| merge | " + " | ".join(f"seed {s}" for s in per_seed) + " | mean |",
             "|---|" + "---|" * (len(per_seed) + 1)]
    for name in names:
        values = [row[name] for row in per_seed.values()]
        lines.append(f"| {name} | " + " | ".join(f"{v:.1f}" for v in values) + f" | {statistics.fmean(values):.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations.analyses.oneshot_merge",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=Path, default=Path("outputs/oneshot/runs"))
    parser.add_argument("--cell", default="fedavg-ft", help="the aggregation label of the cells that saved clients")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iters", type=int, nargs="+", default=[5], help="universe iterations to try")
    parser.add_argument("--out", type=Path, default=Path("simulations/results/oneshot-data-free"))
    add_match_arguments(parser, sections=["symmetry", "weight"])
    args = parser.parse_args(argv)
    match = match_options(args)
    matcher = dataclasses.asdict(match.symmetry) | dataclasses.asdict(match.weight)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    set_threads(1)
    start = time.perf_counter()
    per_seed = {s: seed_rows(args.runs / f"{args.cell}_dirichlet0.5_equal_s{s}", args.iters, match)
                for s in args.seeds}
    minutes = (time.perf_counter() - start) / 60
    args.out.mkdir(parents=True, exist_ok=True)
    given = sys.argv[1:] if argv is None else list(argv)
    meta = {"command": " ".join(["python -m simulations.analyses.oneshot_merge", *given]),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
            "minutes": round(minutes, 1), "load": [round(x, 2) for x in os.getloadavg()], "matcher": matcher}
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "accuracy": per_seed}, indent=1))
    table = markdown(per_seed)
    (args.out / "summary.md").write_text(
        f"# One-shot merging without server data\n\nCommand: `{meta['command']}`. Machine: {meta['machine']}; "
        f"{meta['minutes']} min, load average at the end {meta['load']}. Test accuracy (%) on the run's central test "
        f"subset of the saved round-1 clients of each seed's cell, merged with no server data. Weight matching: "
        f"{', '.join(f'{k} {v}' for k, v in matcher.items())}.\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
