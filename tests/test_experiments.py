"""Every experiment's ``-smoke`` config through the comparison harness on the real simulation engine: each cell
finishes, records every round, and lands in results.json, summary.md and a plot (issue 6: CI runs them)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from glmc.data.fashion_mnist import find_fashion_mnist
from simulations import compare
from simulations.engine import PROJECT

SMOKE = sorted((PROJECT / "simulations" / "configs").glob("*-smoke.toml"))


def test_every_experiment_has_a_smoke_variant() -> None:
    names = {p.stem.removesuffix("-smoke") for p in SMOKE}
    assert {"oneshot", "drift", "widths", "shakespeare"} <= names


@pytest.mark.slow
@pytest.mark.skipif(find_fashion_mnist() is None, reason="Fashion-MNIST is not installed (make data)")
@pytest.mark.parametrize("config", SMOKE, ids=lambda p: p.stem)
def test_smoke_experiment_finishes_every_cell(config: Path, tmp_path: Path) -> None:
    exp = compare.Experiment.load(config)
    assert compare.main(["--config", str(config), "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert sorted(r["aggregation"] for r in rows) == sorted(a for a in exp.aggregations for _ in exp.seeds)
    rounds = int(exp.run["num-server-rounds"])
    for row in rows:
        assert row["status"] == "finished:completed", row["details"]
        records = {r["round"]: r for r in row["records"]}
        assert sorted(records) == list(range(rounds + 1)), row["cell"]  # round 0: the initial model
        for r in (records[k] for k in range(1, rounds + 1)):
            assert r["aggregated"] and r["valid"] == exp.num_supernodes and not r["dropped"], row["cell"]
            assert math.isfinite(r["central_loss"]) and 0.0 <= r["central_accuracy"] <= 1.0
            assert (r["align_seconds"] > 0) == (row["aggregation"] != "fedavg"), row["cell"]
    summary = (tmp_path / "summary.md").read_text()
    assert all(f"| {a} |" in summary for a in exp.aggregations)
    assert list(tmp_path.glob("accuracy-*.png"))
