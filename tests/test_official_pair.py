"""The official GLMC GPT-2 pair, the benchmark fixture: intact, and read by glmc as the official code measured it.

Models this project did not make (trained by the official code, saved by transformers), measured against figures
it did not compute: the vanilla barrier of the official README (its 11-point curve peaks at λ = 0.5, so the 3 points
0, 0.5 and 1 give the same maximum) and each model's test loss at the path's ends.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from glmc.cli import main
from simulations.bench.official import PAIR, official_figures


def test_the_fixture_is_the_pair_as_received():
    for line in (PAIR / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ")
        assert hashlib.sha256((PAIR / name).read_bytes()).hexdigest() == digest, name


def test_the_official_figures_are_read_from_the_readme():
    figures = official_figures()
    assert figures.barrier("vanilla") == 1.2559 and figures.barrier("official weight") == 0.0851
    assert figures.test_losses == (5.1118, 5.1333)


def test_the_vanilla_barrier_and_the_endpoints_are_the_official_ones(tmp_path: Path, capsys: pytest.CaptureFixture):
    out = tmp_path / "vanilla.json"
    assert main(["barrier", str(PAIR / "seed0"), str(PAIR / "seed1"), "--method", "none", "--points", "3",
                 "--data-file", str(PAIR / "test.npy"), "--json", str(out), "--threads", "2"]) == 0
    curve, figures = json.loads(out.read_text()), official_figures()
    assert curve["barrier"] == pytest.approx(figures.barrier("vanilla"), abs=1e-3)
    assert (curve["losses"][0], curve["losses"][-1]) == pytest.approx(figures.test_losses, abs=1e-3)
    assert curve["barriers"][0] == curve["barriers"][-1] == 0.0  # B(0) and B(1) are the endpoints' own losses
