"""One end-to-end `flwr run . --stream` simulation: 3 SuperNodes, 2 rounds of weight-aligned merging of a
tiny ViT on Fashion-MNIST, with one client that replies NaN weights (the ``fault-partition`` test hook).

The faulty reply must be dropped with a reason in both rounds while the run completes, and the metrics
file must hold both rounds. :func:`simulations.engine.run_simulation` detects a failed run (flwr exits 0
then) and stops the SuperLink it started, by PID, in a ``finally``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glmc.checkpoint import load_checkpoint
from glmc.data.fashion_mnist import find_fashion_mnist
from simulations.engine import run_simulation

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_fashion_mnist() is None, reason="Fashion-MNIST is not installed (make data)"),
]


def test_two_rounds_with_a_faulty_client(tmp_path: Path) -> None:
    config = {"model": "vit-tiny", "num-server-rounds": 2, "local-steps": 3, "eval-limit": 200,
              "aggregation": "weight", "align-iters": 1, "fault-partition": 2, "fraction-evaluate": 1.0,
              "width-tiers": "1,0.5",
              "output-dir": str(tmp_path), "run-name": "sim"}
    result = run_simulation(config, num_supernodes=3)
    assert result.ok, f"{result.status}: {result.details}"
    metrics = json.loads((tmp_path / "sim" / "metrics.json").read_text())
    rounds = {r["round"]: r for r in metrics["records"]}
    assert sorted(rounds) == [0, 1, 2]
    for r in (rounds[1], rounds[2]):
        assert r["aggregated"] and r["replies"] == 3 and r["valid"] == 2
        assert len(r["dropped"]) == 1 and "NaN or Inf" in r["dropped"][0]
        assert 0.0 <= r["central_accuracy"] <= 1.0 and r["mean_client_accuracy"] is not None
        assert r["align_seconds"] > 0 and r["round_seconds"] >= r["aggregate_seconds"] >= r["align_seconds"]
    assert metrics["split"]["scheme"] == "dirichlet" and len(metrics["split"]["label_counts"]) == 3
    state, meta = load_checkpoint(tmp_path / "sim" / "checkpoints" / "round-002.safetensors")
    assert meta.metrics["round"] == 2 and all(v.isfinite().all() for v in state.values())
    assert (tmp_path / "sim" / "accuracy.png").is_file() and (tmp_path / "sim" / "metrics.csv").is_file()
