"""The audit's figures of hostile but well-formed replies, measured with the robust defences off and at the defaults.

    .venv/bin/python -m simulations.analyses.hostile

Three honest clients of 20,000 examples each (:mod:`simulations.bench.attack_clients`: vit-tiny, seeded fine-tunes,
the global model plus Gaussian steps of 0.02) and one attacker, through the real strategy on real flwr replies:

- inflation: the attacker's share of the weights when it claims 10⁹ examples;
- scaling: the global model's norm after a reply of the attacker's weights × 1000;
- model replacement: the global model's distance from the attacker's target t after a reply g + 4·(t − g);
- a reply of all 9999 under weight aggregation (it crashed the ServerApp) and under canonical (it reached 4e8);

each with the defences off, at the old defaults (cap 5, clip 5), at the defaults, and with FedMedian (the old
defaults and ``robust-average=fedmedian``).

Writes simulations/results/hostile/summary.md and results.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord

from federation.settings import RunSettings
from glmc.core.config import preset
from glmc.merging.robust import Robustness, cap_examples, distance
from server.strategy import SymmetryAwareFedAvg
from server.validation import ReplySchema
from simulations.bench.attack_clients import HONEST_EXAMPLES, MODEL, STEP, State, global_model, honest_clients, reply

RESULTS = Path("simulations/results/hostile")


def _round(aggregation: str, robust: Robustness, attacker: State, examples: int) -> dict[str, Any]:
    """One round: three honest clients and the attacker; the global model's norm and the record."""
    g = global_model(0)
    honest = honest_clients(g)
    schema = ReplySchema({1.0: {k: tuple(v.shape) for k, v in g.items()}})
    options = dataclasses.replace(RunSettings(server_device="cpu").merge_options, robustness=robust, min_gain=0.0)
    s = SymmetryAwareFedAvg(aggregation, schema, preset(MODEL), options=options, min_train_nodes=2)
    s.global_arrays = ArrayRecord(g)  # type: ignore[arg-type]
    replies = [reply(h, HONEST_EXAMPLES, i + 1) for i, h in enumerate(honest)] + [reply(attacker, examples, 9)]
    arrays, _ = s.aggregate_train(1, replies)
    merged = arrays.to_torch_state_dict() if arrays is not None else g
    honest_mean = {k: torch.stack([h[k] for h in honest]).mean(0) for k in g}
    record = s.current
    return {"kept_global_model": arrays is None, "failure": record.failure, "capped": record.capped,
            "clipped": record.clipped, "clipped_before": record.clipped_before,
            "norm": distance(merged, {k: torch.zeros_like(v) for k, v in g.items()}),
            "max_abs": max(float(v.abs().max()) for v in merged.values()),
            "distance_from_honest_mean": distance(merged, honest_mean), "merged": merged}


def _radius() -> float:
    """R: the largest distance of an honest client from the global model."""
    g = global_model(0)
    return max(distance(h, g) for h in honest_clients(g))


def inflation(robust: Robustness) -> dict[str, Any]:
    torch.manual_seed(1)
    result = _round("fedavg", robust, {k: v + STEP * torch.randn_like(v) for k, v in global_model(0).items()}, 10**9)
    weights = cap_examples([HONEST_EXAMPLES] * 3 + [10**9], robust)  # as the strategy caps them
    return {"attacker_weight_share": weights[-1] / sum(weights)} | result


def scaling(robust: Robustness) -> dict[str, Any]:
    torch.manual_seed(1)
    g = global_model(0)
    result = _round("fedavg", robust, {k: 1000 * (v + STEP * torch.randn_like(v)) for k, v in g.items()},
                    HONEST_EXAMPLES)
    return result | {"global_norm_before": distance(g, {k: 0 * v for k, v in g.items()})}


def replacement(robust: Robustness) -> dict[str, Any]:
    g, target = global_model(0), global_model(123)
    result = _round("fedavg", robust, {k: g[k] + 4 * (target[k] - g[k]) for k in g}, HONEST_EXAMPLES)
    return {"distance_to_target_before": distance(g, target),
            "distance_to_target_after": distance(result["merged"], target)} | result


def constant(aggregation: str) -> Callable[[Robustness], dict[str, Any]]:
    def measure(robust: Robustness) -> dict[str, Any]:
        return _round(aggregation, robust, {k: torch.full_like(v, 9999.0) for k, v in global_model(0).items()},
                      HONEST_EXAMPLES)
    return measure


CASES = {"inflation (10^9 examples)": inflation, "scaling (x1000)": scaling, "model replacement (boost 4)": replacement,
         "all 9999, weight": constant("weight"), "all 9999, canonical": constant("canonical")}


def main() -> int:
    torch.set_num_threads(1)
    start = time.perf_counter()
    old = Robustness(peer_examples_ratio=0.0, max_examples_share=0.0, center_clip_ratio=0.0)
    settings = (("off", Robustness.off()), ("old defaults", old), ("defaults", Robustness()),
                ("fedmedian", dataclasses.replace(old, average="fedmedian")))
    results = {name: {label: {k: v for k, v in measure(robust).items() if k != "merged"} for label, robust in settings}
               for name, measure in CASES.items()}
    radius = _radius()
    lines = ["# Hostile replies: the audit's figures, defences off and at the defaults", "",
             f"Command: `python -m simulations.analyses.hostile`. Machine: {platform.machine()}, {os.cpu_count()} "
             f"cores, python {platform.python_version()}, torch {torch.__version__}; wall time "
             f"{time.perf_counter() - start:.0f} s. Model {MODEL}; seeds 0 (global), 2 (honest), 1 (attacker), "
             f"123 (target); three honest clients of {HONEST_EXAMPLES} examples, one attacker.",
             "'off': every defence 0 (the merged-model check stays on); 'old defaults': max-examples-ratio 5, "
             "clip-ratio 5; 'defaults': those and peer-examples-ratio 1.6, max-examples-share 0.49, "
             "center-clip-ratio 1; 'fedmedian': the old defaults and robust-average fedmedian.",
             f"R, the largest honest distance from the global model: {radius:.2f}; the bound of the defaults "
             f"(robust.py): (clip-ratio + 1) R = {6 * radius:.2f} from the honest clients' own aggregate.", "",
             "| attack | defences | kept global model (why) | capped | clipped (before matching) | global norm | "
             "max abs | distance from honest mean | figure |", "|---|---|---|---|---|---|---|---|---|"]
    for name, by in results.items():
        for label, r in by.items():
            figure = (f"attacker weight share {r['attacker_weight_share']:.5f}" if "attacker_weight_share" in r else
                      f"distance to target {r['distance_to_target_before']:.2f} → {r['distance_to_target_after']:.2f}"
                      if "distance_to_target_after" in r else
                      f"norm {r['global_norm_before']:.1f} → {r['norm']:.1f}" if "global_norm_before" in r else "")
            kept = f"yes ({r['failure']})" if r["kept_global_model"] else "no"
            clipped = f"{r['clipped']} ({r['clipped_before']})"
            lines.append(f"| {name} | {label} | {kept} | {r['capped']} | {clipped} | {r['norm']:.2f} | "
                         f"{r['max_abs']:.3g} | {r['distance_from_honest_mean']:.3f} | {figure} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "summary.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
