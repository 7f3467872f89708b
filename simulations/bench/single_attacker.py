"""One attacker among three honest clients, against the target a robust default must meet: it moves the aggregate no
further from the honest-only aggregate than the farthest honest client does when it is the one added.

    .venv/bin/python -m simulations.bench.single_attacker [--aggregations fedavg canonical weight]

The clients are :mod:`simulations.bench.hostile`'s (vit-tiny, seeded fine-tunes of one global model, 20,000
examples each), through the real strategy. For each defence (the defaults, FedMedian, FedTrimmedAvg, lower cap and
clip ratios) and attack (10⁹ examples, ×1000, all 9999, a ×10 sign flip of the honest mean update) it prints
‖A − H‖ / max_h ‖A_h − H‖: A the aggregate with the attacker, H the honest clients' own, A_h the aggregate with a
copy of honest client h added instead. At most 1 meets the target. Writes outputs/bench/single-attacker.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from flwr.app import ArrayRecord

from federation.settings import RunSettings
from glmc.archs import preset
from glmc.merging.robust import Robustness, distance
from server.strategy import SymmetryAwareFedAvg
from server.validation import ReplySchema
from simulations.bench.hostile import HONEST_EXAMPLES, MODEL, STEP, State, _honest, _model, _reply

OUT = Path("outputs/bench/single-attacker.json")
DEFENCES = {
    "defaults (cap 5, clip 5)": Robustness(),
    "fedmedian": Robustness(average="fedmedian"),
    "fedtrimmedavg 0.25": Robustness(average="fedtrimmedavg", trim_beta=0.25),
    "cap 2, clip 2": Robustness(max_examples_ratio=2.0, clip_ratio=2.0),
    "cap 1, clip 1": Robustness(max_examples_ratio=1.0, clip_ratio=1.0),
}


def _aggregate(aggregation: str, robust: Robustness, g: State, states: Sequence[State],
               examples: Sequence[int]) -> State:
    """The strategy's global model after one round of these replies (the old one if it kept it)."""
    schema = ReplySchema({1.0: {k: tuple(v.shape) for k, v in g.items()}})
    options = dataclasses.replace(RunSettings(server_device="cpu").merge_options, robustness=robust, min_gain=0.0)
    strategy = SymmetryAwareFedAvg(aggregation, schema, preset(MODEL), options=options, min_train_nodes=2)
    strategy.global_arrays = ArrayRecord(g)  # type: ignore[arg-type]
    replies = [_reply(s, n, i + 1) for i, (s, n) in enumerate(zip(states, examples, strict=True))]
    arrays, _ = strategy.aggregate_train(1, replies)
    return arrays.to_torch_state_dict() if arrays is not None else g


def attacks(g: State, honest: Sequence[State]) -> dict[str, tuple[State, int]]:
    """Each attacker's reply and claimed example count."""
    torch.manual_seed(1)
    noise = {k: STEP * torch.randn_like(v) for k, v in g.items()}
    mean = {k: sum(h[k] for h in honest) / len(honest) for k in g}
    return {"10^9 examples": ({k: g[k] + noise[k] for k in g}, 10**9),
            "x1000": ({k: 1000 * (g[k] + noise[k]) for k in g}, HONEST_EXAMPLES),
            "all 9999": ({k: torch.full_like(v, 9999.0) for k, v in g.items()}, HONEST_EXAMPLES),
            "sign flip x10": ({k: g[k] - 10 * (mean[k] - g[k]) for k in g}, HONEST_EXAMPLES)}


def influence(aggregation: str, robust: Robustness) -> dict[str, float]:
    """Every attack's displacement of the aggregate over the farthest honest client's (the target: ≤ 1)."""
    g = _model(0)
    honest = _honest(g)
    counts = [HONEST_EXAMPLES] * len(honest)
    alone = _aggregate(aggregation, robust, g, honest, counts)
    reference = max(distance(_aggregate(aggregation, robust, g, [*honest, h], [*counts, HONEST_EXAMPLES]), alone)
                    for h in honest)
    return {name: distance(_aggregate(aggregation, robust, g, [*honest, reply], [*counts, n]), alone) / reference
            for name, (reply, n) in attacks(g, honest).items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations.bench.single_attacker", description=__doc__)
    parser.add_argument("--aggregations", nargs="+", default=["fedavg", "canonical"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = {f"{aggregation} | {label}": influence(aggregation, robust)
            for aggregation in args.aggregations for label, robust in DEFENCES.items()}
    names = list(next(iter(rows.values())))
    print("| aggregation | defence | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for row, values in rows.items():
        print(f"| {row} | " + " | ".join(f"{values[n]:.2f}" for n in names) + " |")
    print(f"wall time {time.perf_counter() - start:.0f} s")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"rows": rows, "seconds": time.perf_counter() - start}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
