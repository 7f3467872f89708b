"""Every experiment's ``-smoke`` config through the comparison harness on the real simulation engine: each cell
finishes, records every round, and lands in results.json, summary.md and a plot (CI runs them)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from federation.settings import AGGREGATION_TABLE, INITS
from glmc.data.fashion_mnist import find_fashion_mnist
from harness.engine import PROJECT
from harness.tomlfile import read_toml
from simulations import compare

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
    sampled = max(int(exp.num_supernodes * float(exp.run.get("fraction-train", 1.0))),
                  int(exp.run.get("min-train-nodes", 2)))  # FedAvg's sample size
    for row in rows:
        assert row["status"] == "finished:completed", row["details"]
        records = {r["round"]: r for r in row["records"]}
        assert sorted(records) == list(range(rounds + 1)), row["cell"]  # round 0: the initial model
        server_step = not AGGREGATION_TABLE[exp.variants[row["aggregation"]]["aggregation"]].averages
        for r in (records[k] for k in range(1, rounds + 1)):
            assert r["aggregated"] and r["valid"] == sampled and not r["dropped"], row["cell"]
            assert len(set(r["partitions"])) == sampled, row["cell"]  # seeded sampling's roll call, through Ray
            assert math.isfinite(r["central_loss"]) and 0.0 <= r["central_accuracy"] <= 1.0
            assert (r["align_seconds"] > 0) == server_step, row["cell"]
            assert r["tier_metrics"]["accuracy@1"] == r["central_accuracy"], row["cell"]
    summary = (tmp_path / "summary.md").read_text()
    assert all(f"| {a} |" in summary for a in exp.aggregations)
    assert list(tmp_path.glob("accuracy-*.png"))
    for row in (r for r in rows if r["aggregation"] == "weight-guard"):  # min-alignment-gain 0.99
        assert all(r["unaligned"] for r in row["records"][1:]), row["cell"]
        _assert_same_final_model(tmp_path / "runs", row, next(r for r in rows if r["aggregation"] == "fedavg"
                                                                and r["seed"] == row["seed"]), rounds)


def _assert_same_final_model(runs: Path, row: dict[str, Any], fedavg: dict[str, Any], rounds: int) -> None:
    """A run that set every round's alignment aside ends on the bits of FedAvg's run of the same seed: the guard
    averages as flwr's FedAvg does, and two simulations of one seed agree exactly."""
    last = f"checkpoints/round-{rounds:03d}.safetensors"
    ours, theirs = load_file(runs / row["cell"] / last), load_file(runs / fedavg["cell"] / last)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), row["cell"]


@pytest.mark.parametrize("config", sorted((PROJECT / "simulations" / "configs").glob("*.toml")), ids=lambda p: p.stem)
def test_every_grid_that_gives_an_aggregation_server_data_runs_both_controls(
        config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fedavg-ft and server-only beside any row that reads the server-held samples, on the same seeds. A grid that
    starts from checkpoints a bench writes (git-ignored) is read against an empty stand-in folder of that name."""
    init = read_toml(config).get("run", {}).get("init", "shared")
    if init not in INITS and not (PROJECT / init).exists():
        (tmp_path / init).mkdir(parents=True)
        monkeypatch.chdir(tmp_path)
    exp = compare.Experiment.load(config)
    readers = [a for a in exp.aggregations if compare.server_data_read(exp, a) != "none"]
    kinds = {exp.variants[label]["aggregation"] for label in compare.controls(exp)}
    assert not readers or kinds == {"fedavg-ft", "server-only"}, readers


def test_a_run_whose_round_kept_the_global_model_is_not_a_finished_cell() -> None:
    """Clients killed for memory leave a round with no valid reply: the run finishes, but it is not the grid's
    experiment; only a run in which every trained round aggregated stays finished."""
    records = [{"round": 0, "aggregated": False, "dropped": []},
               {"round": 1, "aggregated": True, "dropped": ["node 3: timeout"]}]
    assert compare.rounds_status("finished:completed", "", records) == ("finished:completed", "")
    records.append({"round": 2, "aggregated": False, "dropped": ["node 7: client error: OutOfMemoryError"]})
    status, details = compare.rounds_status("finished:completed", "", records)
    assert status == "failed:not-aggregated" and details.startswith("rounds [2] kept") and "OutOfMemory" in details


def test_the_grid_runs_seed_by_seed() -> None:
    """Every aggregation of a seed runs before the next seed, so a grid stopped part-way is paired."""
    exp = compare.Experiment.load(PROJECT / "simulations" / "configs" / "drift.toml")
    seeds = [cell.seed for cell in compare.grid(exp)]
    assert seeds == sorted(seeds) and len(seeds) == len(exp.seeds) * len(exp.aggregations)


def test_finished_only_summarises_saved_cells_and_runs_nothing(tmp_path: Path) -> None:
    """--finished-only: finished cells in the table, the rest listed as pending; no simulation starts."""
    config = PROJECT / "simulations" / "configs" / "drift-smoke.toml"
    exp = compare.Experiment.load(config)
    done = compare.grid(exp)[0]
    records = [{"round": k, "central_accuracy": 0.25 * k, "central_loss": 1.0, "mean_client_accuracy": 0.5,
                "align_seconds": 0.0, "round_seconds": 1.0, "distance_before": 2.0, "distance_after": 2.0}
               for k in range(3)]
    row = compare.pending(done) | {"status": "finished:completed", "records": records}
    (tmp_path / "cells").mkdir()
    (tmp_path / "cells" / f"{done.name}.json").write_text(json.dumps(row))
    assert compare.main(["--config", str(config), "--out", str(tmp_path), "--finished-only"]) == 0
    summary = (tmp_path / "summary.md").read_text()
    others = [c.name for c in compare.grid(exp) if c != done]
    assert f"**Partial:** 1 of {len(others) + 1} cells finished" in summary and all(c in summary for c in others)
    assert f"| {done.aggregation} | no | 1/1 | 50.0 ± 0.0 |" in summary
    assert not (tmp_path / "runs").exists()


def test_seeds_and_only_run_their_cells_and_summarise_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--seeds, --only and --splits: this process runs just those cells; the others are taken from their saved rows
    (even with --force) or listed as pending, so several processes can share one --out; unknown ones fail in one
    line."""
    config = PROJECT / "simulations" / "configs" / "drift-smoke.toml"
    exp = compare.Experiment.load(config)
    first, *others = compare.grid(exp)
    saved = next(c for c in others if c.seed != first.seed or c.aggregation != first.aggregation)
    (tmp_path / "cells").mkdir()
    (tmp_path / "cells" / f"{saved.name}.json").write_text(json.dumps(_finished_rows(exp)[1] | {"cell": saved.name}))
    ran: list[str] = []
    monkeypatch.setattr(compare, "run_cell", lambda exp, cell, *_, **__: ran.append(cell.name) or compare.pending(cell))
    only = compare.selection(exp, [first.seed], [first.aggregation])
    rows = compare.run_grid(exp, tmp_path, force=True, selected=only)
    assert ran == [c.name for c in compare.grid(exp) if only(c)] and first.name in ran and saved.name not in ran
    assert {r["cell"]: r["status"] for r in rows}[saved.name] == "finished:completed"
    with pytest.raises(compare.ConfigError, match="not seeds of"):
        compare.selection(exp, [99], None)
    with pytest.raises(compare.ConfigError, match="not aggregations of"):
        compare.selection(exp, None, ["nope"])
    with pytest.raises(compare.ConfigError, match="not splits of"):
        compare.selection(exp, None, None, ["nope"])
    split = first.split["label"]
    assert [c.name for c in compare.grid(exp) if compare.selection(exp, None, None, [split])(c)] == \
        [c.name for c in compare.grid(exp) if c.split["label"] == split]
    assert compare.main(["--config", str(config), "--out", str(tmp_path), "--seeds", "99"]) == 2
    assert compare.main(["--config", str(config), "--out", str(tmp_path), "--only", first.aggregation,
                         "--finished-only"]) == 2
    assert "run none" in capsys.readouterr().err


def test_a_saved_cell_shorter_than_the_grid_is_extended_from_its_checkpoint_or_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """num-server-rounds raised over saved cells: compare refuses to summarise their shorter runs as the grid's and
    names --extend; --extend continues each from its saved row (resume), --finished-only lists it as pending."""
    config = PROJECT / "simulations" / "configs" / "drift-smoke.toml"
    longer = tmp_path / "longer.toml"
    longer.write_text(config.read_text().replace("num-server-rounds = 2", "num-server-rounds = 3"))
    exp = compare.Experiment.load(longer)
    (tmp_path / "cells").mkdir()
    rows = _finished_rows(exp)  # rounds 0-2: the smoke grid's 2 trained rounds
    for row in rows:
        (tmp_path / "cells" / f"{row['cell']}.json").write_text(json.dumps(row))
    assert compare.short_cells(exp, tmp_path) == [c.name for c in compare.grid(exp)]
    assert compare.main(["--config", str(longer), "--out", str(tmp_path)]) == 2
    assert "--extend continues them" in capsys.readouterr().err
    assert compare.main(["--config", str(longer), "--out", str(tmp_path), "--finished-only"]) == 0
    assert "**Partial:** 0 of" in (tmp_path / "summary.md").read_text()
    given: dict[str, object] = {}
    monkeypatch.setattr(compare, "run_cell", lambda exp, cell, out, env, gpus, earlier=None:
                        given.setdefault(cell.name, earlier) and compare.pending(cell))
    compare.run_grid(exp, tmp_path, force=False)
    assert given == {row["cell"]: row for row in rows}
    (tmp_path / "cells" / f"{rows[0]['cell']}.json").write_text(json.dumps(
        rows[0] | {"records": [*rows[0]["records"], {"round": 3}]}))
    assert compare.short_cells(exp, tmp_path) == [row["cell"] for row in rows[1:]]


def _finished_rows(exp: compare.Experiment) -> list[dict[str, object]]:
    """A finished row for every cell of ``exp``, with made-up records and the load at its end."""
    return [compare.pending(cell) | {
        "status": "finished:completed", "seconds": 60.0, "load": [0.5 + i, 1.0, 1.0],
        "records": [{"round": k, "central_accuracy": 0.1 * (k + i), "central_loss": 1.0, "mean_client_accuracy": 0.5,
                     "align_seconds": 0.0, "round_seconds": 1.0, "distance_before": 2.0, "distance_after": 2.0}
                    for k in range(3)]} for i, cell in enumerate(compare.grid(exp))]


def test_from_results_summarises_an_earlier_results_json_again_and_runs_nothing(tmp_path: Path) -> None:
    """--from-results rebuilds the same table from results.json alone; the load comes from the rows, not from now."""
    config = PROJECT / "simulations" / "configs" / "drift-smoke.toml"
    exp = compare.Experiment.load(config)
    first, again = tmp_path / "first", tmp_path / "again"
    (first / "cells").mkdir(parents=True)
    for row in _finished_rows(exp):
        (first / "cells" / f"{row['cell']}.json").write_text(json.dumps(row))
    assert compare.main(["--config", str(config), "--out", str(first), "--finished-only"]) == 0
    results = first / "results.json"
    assert compare.main(["--config", str(config), "--out", str(again), "--from-results", str(results)]) == 0
    summary = (again / "summary.md").read_text()
    assert summary == (first / "summary.md").read_text()
    cells = len(compare.grid(exp))
    assert f"load average at the end of each run 0.5–{cells - 0.5:.1f}" in summary
    assert json.loads((again / "results.json").read_text()) == json.loads(results.read_text())
    assert not (again / "runs").exists() and not (again / "cells").exists()


def _summary_line(summary: str, aggregation: str) -> list[str]:
    """The cells of ``aggregation``'s row of a summary table."""
    line = next(x for x in summary.splitlines() if f"| {aggregation} |" in x)
    return [c.strip() for c in line.strip("|").split("|")]


@pytest.mark.parametrize("best", ["server-only", "fedavg-ft"])
def test_summary_marks_what_each_row_reads_and_its_delta_against_the_strongest_control(best: str,
                                                                                      tmp_path: Path) -> None:
    """Every row says what it reads of the server-held data; each is compared, paired by seed, with the grid's
    stronger control (by mean accuracy), which is named; the JSON says the same."""
    config = PROJECT / "simulations" / "configs" / "oneshot.toml"
    exp = compare.Experiment.load(config)
    final = {"fedavg": 0.2, "weight": 0.3, "learned": 0.4, "weight-norms": 0.35, "activation-unguarded": 0.45,
             "fedavg-ft": 0.5, "server-only": 0.6, "learned-endpoints": 0.42, "fedavg-ft-endpoints": 0.52,
             "server-only-endpoints": 0.62}
    final[best] = 0.9
    (tmp_path / "cells").mkdir()
    for row in _finished_rows(exp):
        row["records"][-1]["central_accuracy"] = final[row["aggregation"]]
        (tmp_path / "cells" / f"{row['cell']}.json").write_text(json.dumps(row))
    assert compare.main(["--config", str(config), "--out", str(tmp_path), "--finished-only"]) == 0
    summary = (tmp_path / "summary.md").read_text()
    head = _summary_line(summary, "aggregation")
    reads = head.index("server data read")
    against = head.index("Δ vs strongest control (pts)")
    expect = {"fedavg": "no", "weight": "no", "learned": "inputs + labels", "weight-norms": "no",
              "activation-unguarded": "inputs", "fedavg-ft": "inputs + labels", "server-only": "inputs + labels",
              "learned-endpoints": "inputs", "fedavg-ft-endpoints": "inputs", "server-only-endpoints": "inputs"}
    for agg, accuracy in final.items():
        cells = _summary_line(summary, agg)
        assert cells[reads] == expect[agg], agg
        delta = f"{100 * (accuracy - 0.9):.1f} ± 0.0 (vs {best})"
        assert cells[against] == ("–" if agg == best else delta), agg
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["controls"] == ["fedavg-ft", "server-only", "fedavg-ft-endpoints", "server-only-endpoints"]
    assert saved["server_data_read"] == {k: v.replace("inputs + labels", "labels").replace("no", "none")
                                         for k, v in expect.items()}


def test_a_grid_without_controls_has_no_control_column() -> None:
    exp = compare.Experiment.load(PROJECT / "simulations" / "configs" / "drift-smoke.toml")
    table = compare.summary_rows(_finished_rows(exp), exp)
    assert compare.controls(exp) == [] and all("Δ vs strongest control (pts)" not in row for row in table)
    assert {row["server data read"] for row in table} == {"no"}


def test_the_distance_column_averages_every_trained_round_not_only_the_last() -> None:
    """From independent inits matching acts in round 1 only: the last round alone showed no gain at all."""
    exp = compare.Experiment.load(PROJECT / "simulations" / "configs" / "drift-smoke.toml")
    rows = _finished_rows(exp)
    for row in rows:
        for record, before, after in zip(row["records"], (None, 10.0, 4.0), (None, 5.0, 4.0), strict=True):
            record["distance_before"], record["distance_after"] = before, after
    assert {r[compare.DISTANCE] for r in compare.summary_rows(rows, exp)} == {"7.00 ± 0.00 → 4.50 ± 0.00"}


def test_a_table_rebuilt_from_rows_alone_takes_the_marks_it_is_given() -> None:
    """docs/results.md rebuilds a table from results.json rows, labels standing for aggregations: a variant's label
    is no aggregation, so its mark is unknown ("–") unless the JSON's server_data_read is passed."""
    exp = compare.Experiment.load(PROJECT / "simulations" / "configs" / "apart.toml")
    rows = _finished_rows(exp)
    rebuilt = dataclasses.replace(exp, variants={a: {"aggregation": a} for a in exp.aggregations})
    marks = {r["aggregation"]: r["server data read"] for r in compare.summary_rows(rows, rebuilt)}
    assert marks["weight-repair"] == "–" and marks["learned"] == "inputs + labels"
    given = {label: compare.server_data_read(exp, label) for label in exp.aggregations}
    marks = {r["aggregation"]: r["server data read"] for r in compare.summary_rows(rows, rebuilt, given)}
    assert marks["weight-repair"] == "inputs"


def test_from_results_lists_the_cells_the_grid_gained_as_not_run(tmp_path: Path) -> None:
    """A grid that gained an aggregation after its results.json: summarised again, the new cells pending."""
    config = PROJECT / "simulations" / "configs" / "oneshot-smoke.toml"
    exp = compare.Experiment.load(config)
    rows = [r for r in _finished_rows(exp) if r["aggregation"] != "server-only"]
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"experiment": exp.name, "config": exp.run, "rows": rows}))
    assert compare.main(["--config", str(config), "--out", str(tmp_path / "out"), "--from-results",
                         str(results)]) == 0
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert f"**Partial:** {len(rows)} of {len(rows) + 1} cells finished; not run yet: server-only_" in summary
    cells, head = _summary_line(summary, "server-only"), _summary_line(summary, "aggregation")
    assert cells[4:6] == ["0/1", "–"] and cells[head.index("Δ vs strongest control (pts)")] == "–"


@pytest.mark.parametrize(("edit", "expect"), [
    (lambda saved: saved | {"experiment": "other"}, "with other cells than"),
    (lambda saved: saved | {"rows": [saved["rows"][0] | {"cell": "weight_other_equal_s9"}]}, "with other cells than"),
    (lambda saved: saved | {"config": saved["config"] | {"num-server-rounds": 7}}, "another [run] config"),
    (lambda saved: {"rows": saved["rows"]}, "cannot read the rows"),
])
def test_from_results_refuses_rows_of_another_grid_in_one_line(edit: Callable[[dict[str, Any]], dict[str, Any]],
                                                               expect: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    config = PROJECT / "simulations" / "configs" / "drift-smoke.toml"
    exp = compare.Experiment.load(config)
    results = tmp_path / "results.json"
    results.write_text(json.dumps(edit({"experiment": exp.name, "config": exp.run, "rows": _finished_rows(exp)})))
    assert compare.main(["--config", str(config), "--out", str(tmp_path / "out"), "--from-results",
                         str(results)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("compare: error: ") and expect in err[0], err
    assert not (tmp_path / "out").exists()


def test_reuse_takes_the_finished_cells_of_an_earlier_results_json(tmp_path: Path) -> None:
    """--reuse: an earlier results.json of part of the grid (a grid that gained an aggregation) gives its finished
    cells; its failed cells and the cells it lacks are left to run (here, selecting none: pending)."""
    exp = compare.Experiment.load(PROJECT / "simulations" / "configs" / "drift-smoke.toml")
    finished, failed, *_ = _finished_rows(exp)
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"experiment": exp.name, "config": exp.run,
                                   "rows": [finished, failed | {"status": "failed"}]}))
    rows = compare.run_grid(exp, tmp_path, force=False, reused=compare.saved_rows(exp, results),
                            selected=lambda cell: False)
    assert [r["status"] for r in rows] == ["finished:completed"] + ["pending"] * (len(compare.grid(exp)) - 1)
    assert rows[0] == finished
    foreign = finished | {"cell": "weight_other_equal_s9"}
    results.write_text(json.dumps({"experiment": exp.name, "config": exp.run, "rows": [foreign]}))
    with pytest.raises(compare.ConfigError, match="other cells than"):
        compare.saved_rows(exp, results)


def test_the_summary_pairs_final_last_three_and_all_round_accuracy_by_seed() -> None:
    """Each Δ column is the mean over seeds of (aggregation − fedavg of the same seed), per metric, in points."""
    exp = compare.Experiment.load(PROJECT / "simulations" / "configs" / "drift-smoke.toml")
    curves = {("fedavg", 0): [0.1, 0.5, 0.6, 0.7, 0.6], ("fedavg", 1): [0.2, 0.4, 0.4, 0.5, 0.5],
              ("weight-guard", 0): [0.3, 0.6, 0.5, 0.7, 0.7], ("weight-guard", 1): [0.4, 0.5, 0.6, 0.6, 0.4]}
    rows = [{"split": "dirichlet0.1", "widths": "equal", "aggregation": agg, "seed": seed,
             "status": "finished:completed",
             "records": [{"round": k, "central_accuracy": 0.05 if k == 0 else acc[k - 1], "mean_client_accuracy": None,
                          "align_seconds": 0.0, "round_seconds": 1.0} for k in range(len(acc) + 1)]}
            for (agg, seed), acc in curves.items()]
    weight = next(r for r in compare.summary_rows(rows, exp) if r["aggregation"] == "weight-guard")
    # per seed, in points: final +10, −10; last 3 rounds 0, +20/3; all rounds +30/5, +50/5
    assert weight["Δ vs fedavg (pts)"] == "0.0 ± 10.0"
    assert weight["Δ, last 3 rounds"] == "3.3 ± 3.3"
    assert weight["Δ, all rounds"] == "8.0 ± 2.0"
    assert "rounds set aside %" not in weight  # no run set a round aside: the column stays out
    assert compare.TIME_SPLIT not in weight  # records from before the round's time was split: no column


def test_the_summary_splits_the_round_time_over_rounds_and_runs() -> None:
    """The time-split column is each part's mean over every trained round of the row's runs (round 0 left out)."""
    exp = compare.Experiment.load(PROJECT / "simulations" / "configs" / "drift-smoke.toml")
    parts = {0: [(4.0, 6.0, 1.0, 0.5), (6.0, 8.0, 3.0, 0.5)], 1: [(2.0, 4.0, 2.0, 2.0)]}
    rows = [{"split": "dirichlet0.1", "widths": "equal", "aggregation": "fedavg", "seed": seed,
             "status": "finished:completed",
             "records": [{"round": 0, "central_accuracy": 0.1, "align_seconds": 0.0, "round_seconds": 0.0,
                          **dict.fromkeys(compare.TIME_KEYS, 99.0)}]
             + [{"round": k, "central_accuracy": 0.5, "align_seconds": 0.0, "round_seconds": 10.0,
                 **dict(zip(compare.TIME_KEYS, split, strict=True))} for k, split in enumerate(splits, start=1)]}
            for seed, splits in parts.items()]
    fedavg = next(r for r in compare.summary_rows(rows, exp) if r["aggregation"] == "fedavg")
    assert fedavg[compare.TIME_SPLIT] == "4.0 (6.0) / 2.0 / 1.0"


def test_the_summary_counts_the_rounds_min_alignment_gain_set_aside() -> None:
    """With a guarded run in the grid, each row gains the share of trained rounds averaged unaligned."""
    exp = compare.Experiment.load(PROJECT / "simulations" / "configs" / "drift.toml")
    aside = {("fedavg", 0): [], ("weight", 0): [1, 2, 3], ("weight", 1): [1]}
    rows = [{"split": "dirichlet0.1", "widths": "equal", "aggregation": agg, "seed": seed,
             "status": "finished:completed",
             "records": [{"round": k, "central_accuracy": 0.5, "mean_client_accuracy": None, "align_seconds": 0.0,
                          "round_seconds": 1.0, "unaligned": k in rounds} for k in range(5)]}
            for (agg, seed), rounds in aside.items()]
    table = {r["aggregation"]: r["rounds set aside %"] for r in compare.summary_rows(rows, exp)}
    # 3 of 4 rounds and 1 of 4; no run of weight-guard
    assert table["fedavg"] == "0 ± 0" and table["weight"] == "50 ± 25" and table["weight-guard"] == "–"


def test_an_aggregation_variant_sets_its_own_run_config_keys(tmp_path: Path) -> None:
    """A table in ``aggregations`` is one more curve: its label names the cells, its keys reach the run config."""
    config = tmp_path / "variant.toml"
    config.write_text('[experiment]\nname = "v"\nnum-supernodes = 2\nseeds = [0]\naggregations = ["weight", '
                      '{ label = "weight-norms", aggregation = "weight", restore-norms = true }]\n')
    exp = compare.Experiment.load(config)
    plain, variant = compare.grid(exp)
    assert exp.aggregations == ("weight", "weight-norms") and variant.name.startswith("weight-norms_")
    assert "restore-norms" not in plain.run_config(exp, tmp_path)
    config = variant.run_config(exp, tmp_path)
    assert config["restore-norms"] is True and config["aggregation"] == "weight"


@pytest.mark.parametrize(("text", "expect"), [
    ("[experiment]\nname = 'x'\n", "lacks 'num-supernodes'"),
    ("name = = 1\n", "is not valid TOML"),
    ("[experiment]\nname = 'x'\nnum-supernodes = 2\nseeds = [0, 1]\naggregations = ['fedavg', 'weight']\n"
     "[[splits]]\nlabel = 'bad'\npartitioner = 'dirichlet'\nalpha = -1.0\n",
     "cell fedavg_bad_default_s0: run config: alpha"),
    ("[experiment]\nname = 'x'\nnum-supernodes = 2\nseeds = [0]\naggregations = ['fedavg', { label = 'v' }]\n",
     "needs a label and an aggregation"),
])
def test_a_bad_config_fails_in_one_line_before_any_cell_runs(text: str, expect: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(text)
    out = tmp_path / "out"
    # a bad cell once failed only when its turn came, after the cells before it had run
    assert compare.main(["--config", str(config), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("compare: error: ") and expect in err[0], err
    assert not out.exists()


def test_the_width_grid_names_its_best_baseline_and_a_partial_table_keeps_every_column() -> None:
    """Each aggregation's paired Δ is against the best (by mean accuracy) of HeteroFL, FedRolex and the two
    homogeneous controls; with two cells still pending, their rows show "–" under the per-tier columns."""
    exp = compare.Experiment.load(PROJECT / "simulations" / "configs" / "width-baselines.toml")
    assert compare.width_baselines(exp) == ["fedavg", "fedrolex", "smallest-width", "full-width-only"]
    rows = _finished_rows(exp)  # made-up accuracies that rise with the cell's index: the later the cell, the better
    finals = {r["aggregation"]: r["records"][-1]["central_accuracy"] for r in rows if r["seed"] == 0}
    table = {r["aggregation"]: r for r in compare.summary_rows(rows, exp)}
    best = max(compare.width_baselines(exp), key=finals.__getitem__)
    assert table[best][compare.BEST_BASELINE] == "–"
    assert table["weight"][compare.BEST_BASELINE] == f"{100 * (finals['weight'] - finals[best]):.1f} ± 0.0 (vs {best})"
    for row in rows:
        row["records"][1]["tier_metrics"] = {"accuracy@1": 0.5, "accuracy@0.5": 0.4}
    rows[-1], rows[-2] = compare.pending(compare.grid(exp)[-1]), compare.pending(compare.grid(exp)[-2])
    lines = compare.markdown(compare.summary_rows(rows, exp)).splitlines()
    assert "accuracy@0.5 %" in lines[0] and all(line.count("|") == lines[0].count("|") for line in lines)
    drift = compare.Experiment.load(PROJECT / "simulations" / "configs" / "drift-smoke.toml")
    assert compare.width_baselines(drift) == []


def test_full_width_only_keeping_the_model_is_its_rule_and_a_finished_run_is_recovered(tmp_path: Path) -> None:
    """A round that left its narrow replies out keeps the model by design; one that dropped replies failed. A run
    whose server log says it finished is recovered from its folder with that judgement, a run that did not is not."""
    design = {"round": 1, "aggregated": False, "left_out": 9, "dropped": [], "failure": None}
    dropped = {"round": 2, "aggregated": False, "left_out": 0, "dropped": ["node 1: killed"], "failure": None}
    assert compare.rounds_status("finished:completed", "", [design]) == ("finished:completed", "")
    assert compare.rounds_status("finished:completed", "", [design, dropped])[0] == "failed:not-aggregated"
    exp = compare.Experiment.load(PROJECT / "simulations" / "configs" / "width-baselines.toml")
    cell = compare.grid(exp)[3]
    run = tmp_path / "runs" / cell.name
    run.mkdir(parents=True)
    (run / "metrics.json").write_text(json.dumps({"records": [dict(design, round_seconds=2.5)]}))
    (run / "server.log").write_text("round 1 ...\n")
    assert compare.recovered(cell, tmp_path) is None
    (run / "server.log").write_text("run finished: outputs in x\n")
    row = compare.recovered(cell, tmp_path)
    assert row is not None and row["status"] == "finished:completed" and row["recovered"] and row["seconds"] == 2.5


def test_publish_copies_this_grids_plots_not_every_plot_in_the_output_folder(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A plot an earlier design of the grid left in its output folder (a split it dropped) is not published."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("summary.md", "results.json", "accuracy-dirichlet0.3-1.png", "accuracy-shards2-1.png"):
        (out / name).write_text(name)
    monkeypatch.setattr(compare, "PROJECT", tmp_path)
    dest = compare.publish(out, "grid", [out / "accuracy-dirichlet0.3-1.png"])
    assert sorted(p.name for p in dest.iterdir()) == ["accuracy-dirichlet0.3-1.png", "results.json", "summary.md"]
