"""The barrier bench on a given pair (simulations.bench.pair_rows, through simulations.bench.barriers): each row runs
``glmc barrier`` with its own flags on the pair's test split, is cached with those flags, and is printed beside the
official figure the pair's README states. ``glmc`` is replaced by a stub that writes a curve, so this takes no
model time; tests/test_official_pair.py runs the real command on the pair."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness.tomlfile import read_toml
from simulations.bench import barriers, pair_rows
from simulations.bench.official import PAIR, official_figures

CONFIG = Path("simulations/bench/configs/official-pair.toml")


def write_config(tmp_path: Path) -> Path:
    """The committed config with the run's folders moved under ``tmp_path`` (its rows and pair unchanged)."""
    text = CONFIG.read_text().replace('"outputs/bench/official-pair"', f'"{tmp_path / "out"}"')
    text = text.replace('"simulations/results/official-pair"', f'"{tmp_path / "results"}"')
    config = tmp_path / "official-pair.toml"
    config.write_text(text)
    return config


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Every ``glmc`` call the bench makes; each writes the report ``glmc barrier --json`` would, with barrier 1.0
    for vanilla and 0.05 for every other method."""
    made: list[list[str]] = []

    def stub(args: list[str]) -> int:
        made.append(args)
        method, form = args[args.index("--method") + 1], "standard"
        if "--form" in args:
            form = args[args.index("--form") + 1]
        barrier = 1.0 if method == "none" else 0.05
        curve = {"method": method, "barrier": barrier, "losses": [5.0, 5.0 + barrier, 5.0], "align_seconds": 1.5}
        Path(args[args.index("--json") + 1]).parent.mkdir(parents=True, exist_ok=True)
        Path(args[args.index("--json") + 1]).write_text(json.dumps({"form": form, "curves": [curve]}))
        return 0

    monkeypatch.setattr(pair_rows, "glmc", stub)
    return made


def test_every_row_runs_once_on_the_pairs_test_split_with_its_own_flags(tmp_path: Path, calls: list[list[str]]):
    config = write_config(tmp_path)
    assert barriers.main(["--config", str(config)]) == 0
    names = [row["name"] for row in read_toml(config)["rows"]]
    assert len(calls) == len(names)
    for args in calls:
        assert args[0] == "barrier" and [Path(p).resolve() for p in args[1:3]] == [PAIR / "seed0", PAIR / "seed1"]
        assert Path(args[args.index("--data-file") + 1]).resolve() == PAIR / "test.npy"
        assert args[args.index("--points") + 1] == "11"
    learned = [args for args in calls if args[args.index("--method") + 1] == "learned"]
    assert learned and all(Path(args[args.index("--train-file") + 1]).resolve() == PAIR / "train.npy"
                           for args in learned)
    assert barriers.main(["--config", str(config)]) == 0
    assert len(calls) == len(names)  # cached: the same flags are not measured twice


def test_the_summary_sets_the_official_figures_from_the_readme_beside_the_rows(tmp_path: Path,
                                                                              calls: list[list[str]]):
    assert barriers.main(["--config", str(write_config(tmp_path))]) == 0
    summary = (tmp_path / "results" / "summary.md").read_text()
    figures = official_figures()
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in summary.splitlines()
            if line.startswith("| ") and not line.startswith("| row")}
    assert rows["vanilla"][2:6] == ["1.0000", "100.0%", f"{figures.barrier('vanilla'):.4f}", "100.0%"]
    weight = rows["weight, circuit-rmsnorm form, biases skipped"]
    assert weight[1] == "circuit-rmsnorm" and weight[3] == "5.0%"
    assert weight[4] == f"{figures.barrier('official weight'):.4f}"
    assert rows["dual, 20 steps"][4] == "—"  # the official README has no dual figure
    stored = json.loads((tmp_path / "results" / "results.json").read_text())
    assert [r["name"] for r in stored["rows"]] == list(rows)


def test_a_pair_config_names_its_figures_from_the_fixture_readme_it_points_to(tmp_path: Path,
                                                                              calls: list[list[str]]):
    """A copy of the fixture with another README: the figures follow the README, not the code."""
    copy = tmp_path / "pair"
    shutil.copytree(PAIR, copy, ignore=shutil.ignore_patterns("*.npy", "*.safetensors"))
    (copy / "README.md").write_text((PAIR / "README.md").read_text().replace("| 0.0851 | 6.8% |", "| 0.0900 | 7.2% |"))
    config = write_config(tmp_path)
    config.write_text(config.read_text().replace('path = "simulations/fixtures/official-gpt2-pair01"',
                                                 f'path = "{copy}"'))
    assert barriers.main(["--config", str(config), "--rows", "vanilla", "weight, standard form, biases skipped"]) == 0
    summary = (tmp_path / "results" / "summary.md").read_text()
    assert "| weight, standard form, biases skipped | standard | 0.0500 | 5.0% | 0.0900 | 7.2% |" in summary
    assert len(calls) == 2
