"""One attacker among three honest clients, against the target a robust default must meet: it moves the aggregate no
further from the honest-only aggregate than the farthest honest client does when it is the one added, and it takes
less than half of the round's weight.

    .venv/bin/python -m simulations.bench.single_attacker [--aggregations fedavg canonical weight ...]

The clients are :mod:`simulations.bench.attack_clients`' (vit-tiny, seeded fine-tunes of one global model, 20,000
examples each), through the real strategy; the aggregations that read server data get 64 seeded random images
(:func:`server_data`). For each defence (the defaults, the old defaults, FedMedian, FedTrimmedAvg, lower cap and clip
ratios) and attack (10⁹ examples, ×1000, all 9999, a ×10 sign flip of the honest mean update) it prints
‖A − H‖ / max_h ‖A_h − H‖: A the aggregate with the attacker, H the honest clients' own, A_h the aggregate with a
copy of honest client h added instead (0 where neither moves: server-only ignores the clients). At most 1 meets
the target. It also prints the largest share of the round's weight any reply keeps (the inflating attacker's).
Writes summary.md and results.json to outputs/bench/single-attacker/, or with ``--publish`` to
simulations/results/single-attacker/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord
from torch.utils.data import Dataset, TensorDataset

from federation.settings import AGGREGATIONS, DATA_AGGREGATIONS, RunSettings
from glmc.core.config import preset
from glmc.match.options import LearnConfig
from glmc.merging.robust import Robustness, cap_examples, distance
from glmc.train import TrainConfig
from server.strategy import SymmetryAwareFedAvg
from server.validation import ReplySchema
from simulations.bench.attack_clients import HONEST_EXAMPLES, MODEL, STEP, State, global_model, honest_clients, reply

OUT = Path("outputs/bench/single-attacker")  # --publish: simulations/results/single-attacker
RESULTS = Path("simulations/results/single-attacker")
OLD = Robustness(peer_examples_ratio=0.0, max_examples_share=0.0, center_clip_ratio=0.0)  # before the peer and share
DEFENCES = {  # caps and the centred clipping
    "defaults (cap 5, peer cap 1.6, share 0.49, clip 5, centred clip 1 × the example allowance)": Robustness(),
    "peer cap 1 (and the other defaults)": Robustness(peer_examples_ratio=1.0),
    "centred clip 1.2 (and the other defaults)": Robustness(center_clip_ratio=1.2),
    "one centred bound for all (no example allowance)": Robustness(center_clip_by_examples=False),
    "old defaults (cap 5, clip 5)": OLD,
    "fedmedian": dataclasses.replace(OLD, average="fedmedian"),
    "fedtrimmedavg 0.25": dataclasses.replace(OLD, average="fedtrimmedavg", trim_beta=0.25),
    "cap 2, clip 2": dataclasses.replace(OLD, max_examples_ratio=2.0, clip_ratio=2.0),
    "cap 1, clip 1": dataclasses.replace(OLD, max_examples_ratio=1.0, clip_ratio=1.0),
}


def server_data(aggregation: str) -> Dataset | None:
    """64 seeded random images (labels 0) for an aggregation that reads server data, else None."""
    if aggregation not in DATA_AGGREGATIONS:
        return None
    cfg = preset(MODEL)
    images = torch.randn(64, cfg.in_chans, cfg.img_size, cfg.img_size, generator=torch.Generator().manual_seed(3))
    return TensorDataset(images, torch.zeros(64, dtype=torch.long))


def _aggregate(aggregation: str, robust: Robustness, g: State, states: Sequence[State],
               examples: Sequence[int]) -> State:
    """The strategy's global model after one round of these replies (the old one if it kept it); the learned
    refinement and the fine-tuning of the controls take a few steps on :func:`server_data`."""
    schema = ReplySchema({1.0: {k: tuple(v.shape) for k, v in g.items()}})
    options = dataclasses.replace(RunSettings(server_device="cpu").merge_options, robustness=robust, min_gain=0.0)
    options = dataclasses.replace(options, match=dataclasses.replace(
        options.match, learn=LearnConfig(steps=4, batch_size=32, val_max=16, eval_every=2)))
    strategy = SymmetryAwareFedAvg(aggregation, schema, preset(MODEL), options=options, min_train_nodes=2,
                                   server_data=server_data(aggregation),
                                   tune=TrainConfig(epochs=1, batch_size=32, lr=1e-3, seed=5, threads=1))
    strategy.global_arrays = ArrayRecord(g)  # type: ignore[arg-type]
    replies = [reply(s, n, i + 1) for i, (s, n) in enumerate(zip(states, examples, strict=True))]
    arrays, _ = strategy.aggregate_train(1, replies)
    return arrays.to_torch_state_dict() if arrays is not None else g


def attacks(g: State, honest: Sequence[State]) -> dict[str, tuple[State, int]]:
    """Each attacker's reply and claimed example count."""
    torch.manual_seed(1)
    noise = {k: STEP * torch.randn_like(v) for k, v in g.items()}
    mean = {k: sum(h[k] for h in honest) / len(honest) for k in g}
    flipped = {k: g[k] - 10 * (mean[k] - g[k]) for k in g}
    return {"10^9 examples": ({k: g[k] + noise[k] for k in g}, 10**9),
            "x1000": ({k: 1000 * (g[k] + noise[k]) for k in g}, HONEST_EXAMPLES),
            "all 9999": ({k: torch.full_like(v, 9999.0) for k, v in g.items()}, HONEST_EXAMPLES),
            "sign flip x10": (flipped, HONEST_EXAMPLES),
            "sign flip x10, 10^9 examples": (flipped, 10**9)}


def influence(aggregation: str, robust: Robustness) -> dict[str, float]:
    """Every attack's displacement of the aggregate over the farthest honest client's (the target: ≤ 1)."""
    g = global_model(0)
    honest = honest_clients(g)
    counts = [HONEST_EXAMPLES] * len(honest)
    alone = _aggregate(aggregation, robust, g, honest, counts)
    reference = max(distance(_aggregate(aggregation, robust, g, [*honest, h], [*counts, HONEST_EXAMPLES]), alone)
                    for h in honest)
    moved = {name: distance(_aggregate(aggregation, robust, g, [*honest, attacker], [*counts, n]), alone)
             for name, (attacker, n) in attacks(g, honest).items()}
    return {name: d / reference if reference else (0.0 if d == 0 else math.inf) for name, d in moved.items()}


def largest_share(robust: Robustness, replies: int = 4) -> float:
    """The largest share of a round's weight one reply keeps when it claims 10⁹ examples beside ``replies`` − 1
    honest ones of HONEST_EXAMPLES (:func:`glmc.merging.robust.cap_examples`, as the strategy caps them)."""
    weights = cap_examples([HONEST_EXAMPLES] * (replies - 1) + [10**9], robust)
    return max(weights) / sum(weights)


def table(rows: dict[str, dict[str, float]]) -> list[str]:
    """The markdown table of :func:`main`'s rows: ``"aggregation | defence"`` → figure → value."""
    names = list(next(iter(rows.values())))
    return ["| aggregation | defence | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names),
            *(f"| {row} | " + " | ".join(f"{values[n]:.2f}" for n in names) + " |" for row, values in rows.items())]


def markdown(data: dict[str, Any]) -> list[str]:
    """summary.md's body from results.json (also docs/results.md's section)."""
    meta = data["meta"]
    return [f"Command: `{meta['command']}`. Machine: {meta['machine']}; wall time {meta['seconds']:.0f} s. Model "
            f"{MODEL}; seeds 0 (global), 2 (honest), 1 (attacker), 3 (server images); three honest clients of "
            f"{HONEST_EXAMPLES} examples and one attacker, one round through SymmetryAwareFedAvg.aggregate_train.",
            "Each attack column: ‖A − H‖ / max_h ‖A_h − H‖ (the target: at most 1); largest weight share: the "
            "inflating attacker's share of the round's weight after the caps (the target: below 0.5).", "",
            *table(data["rows"])]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations.bench.single_attacker", description=__doc__)
    parser.add_argument("--aggregations", nargs="+", default=list(AGGREGATIONS), choices=AGGREGATIONS)
    parser.add_argument("--defences", nargs="+", default=list(DEFENCES), choices=DEFENCES, metavar="LABEL")
    parser.add_argument("--publish", action="store_true", help=f"write to {RESULTS}/ instead of {OUT}/")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = {f"{aggregation} | {label}": influence(aggregation, DEFENCES[label]) | {
        "largest weight share": largest_share(DEFENCES[label])}
        for aggregation in args.aggregations for label in args.defences}
    meta = {"command": "python -m " + shlex.join(["simulations.bench.single_attacker", *(argv or sys.argv[1:])]),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, torch "
                       f"{torch.__version__}", "seconds": time.perf_counter() - start}
    data = {"rows": rows, "meta": meta}
    text = "\n".join(["# One attacker among three honest clients, per aggregation and defence", "", *markdown(data)])
    print(text)
    out = RESULTS if args.publish else OUT
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
