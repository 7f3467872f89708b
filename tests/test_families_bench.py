"""The families benchmark's table: per-pair ratios to the same pair's vanilla, refusals kept as rows."""

from __future__ import annotations

import pytest

from simulations.bench import families


def test_the_table_averages_pairs_and_divides_each_by_its_own_vanilla() -> None:
    rows = [{"model": "m", "pair": [0, 1], "method": "none", "barrier": 0.4, "align_seconds": 0.0},
            {"model": "m", "pair": [2, 3], "method": "none", "barrier": 0.2, "align_seconds": 0.0},
            {"model": "m", "pair": [0, 1], "method": "weight", "barrier": 0.04, "align_seconds": 1.0},
            {"model": "m", "pair": [2, 3], "method": "weight", "barrier": 0.04, "align_seconds": 3.0},
            {"model": "m", "pair": [0, 1], "method": "activation", "refused": "glmc: error: not covered"}]
    none, weight, activation = families.table(rows, ["none", "weight", "activation", "dual"])
    assert none["barrier"] == pytest.approx(0.3) and none["ratio"] == pytest.approx(1.0)
    assert weight["ratio"] == pytest.approx((0.1 + 0.2) / 2)  # not 0.04 / 0.3: each pair by its own vanilla
    assert weight["align_seconds"] == pytest.approx(2.0) and weight["pairs"] == 2
    assert activation == {"model": "m", "method": "activation", "refused": "glmc: error: not covered"}
