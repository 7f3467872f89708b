"""The benches' entry points refuse a missing or malformed config in one line, exit 2, before measuring anything."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from federation.settings import GUARDED, REFINED, RunSettings
from glmc.archs import get_arch
from glmc.cli.options import parse_match_flags
from glmc.data.fashion_mnist import find_fashion_mnist
from glmc.match.options import WeightOptions
from glmc.symmetry import groups
from glmc.symmetry.canonical import canonicalize
from glmc.symmetry.transforms import MATCHABLE, apply, random_transform
from simulations.analyses import (
    barrier_sites,
    forms,
    learned_gap,
    learning_budget,
    matching_time,
    q_candidates,
    repair_barriers,
    weight_starts,
)
from simulations.bench import accelerator, barriers, client_cost, merging, precision, scaling
from tests.symmetry_models import CONFIGS, dataset, random_native

BENCHES: dict[str, Callable[[list[str]], int]] = {
    "barriers": barriers.main, "matching_time": matching_time.main, "merging": merging.main,
    "weight_starts": weight_starts.main, "repair_barriers": repair_barriers.main,
    "learning_budget": learning_budget.main, "learned_gap": learned_gap.main, "forms": forms.main,
    "q_candidates": q_candidates.main,
    "barrier_sites": barrier_sites.main, "accelerator": accelerator.main, "scaling": scaling.main,
    "precision": precision.main}


@pytest.mark.parametrize("name", BENCHES)
@pytest.mark.parametrize(("text", "expect"), [(None, "cannot read"), ("run = = 1\n", "is not valid TOML")])
def test_a_missing_or_malformed_bench_config_fails_in_one_line(name: str, text: str | None, expect: str,
                                                               tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bench.toml"
    if text is not None:
        config.write_text(text)
    with pytest.raises(SystemExit) as exit_info:  # each once ended in a FileNotFoundError or TOMLDecodeError traceback
        BENCHES[name](["--config", str(config)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ": error: " in err[0] and expect in err[0] and str(config) in err[0], err


def test_the_merging_bench_refuses_an_unknown_merge_to_measure(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:  # before loading a checkpoint: nothing is measured or written
        merging.main(["--only", "no such merge"])
    assert exit_info.value.code == 2 and "no merge named 'no such merge'" in capsys.readouterr().err


def curve(method: str, barrier: float) -> dict[str, object]:
    return {"method": method, "barrier": barrier, "lambdas": [0.0, 0.5, 1.0],
            "accuracies": [0.9, barrier / 10, 0.9], "align_seconds": 0.0}


def test_the_repair_bench_divides_each_pair_by_its_own_plain_vanilla_barrier() -> None:
    pairs = [{"curves": [curve("none", 2.0), curve("weight+repair", 0.2)]},
             {"curves": [curve("none", 1.0), curve("weight+repair", 0.3)]}]
    rows = {r["method"]: r for r in barriers.summarise({"preset": "m", "dataset": "d"}, pairs,
                                                       ["none", "weight+repair"])}
    assert rows["none"]["ratio_to_vanilla"] == 1.0 and rows["none"]["ratio_se"] == 0.0
    assert rows["weight+repair"]["ratio_to_vanilla"] == pytest.approx(0.2)  # mean of 0.1 and 0.3, not 0.5 / 3
    assert rows["weight+repair"]["barrier"] == pytest.approx(0.25)
    assert rows["weight+repair"]["midpoint_accuracy"] == pytest.approx(0.025)


def test_a_budget_setting_on_fewer_pairs_is_divided_by_those_pairs_vanilla_barriers_only() -> None:
    short, long = (learning_budget.setting_label("learned", args) for args in ([], ["--steps", "600"]))
    pairs = [{"curves": [curve("none", 2.0), curve(short, 0.4), curve(long, 0.2)]},
             {"curves": [curve("none", 1.0), curve(short, 0.3)]}]
    rows = {r["method"]: r for r in barriers.summarise({"preset": "m", "dataset": "d"}, pairs, ["none", short, long])}
    assert rows[long]["pairs"] == 1 and rows[long]["ratio_to_vanilla"] == pytest.approx(0.1)  # 0.2 / 2.0, not / 1.5
    assert rows[short]["pairs"] == 2 and rows[short]["ratio_to_vanilla"] == pytest.approx(0.25)  # mean of 0.2, 0.3


def test_budget_settings_cache_under_names_of_their_own_flags() -> None:
    tags = {learning_budget.setting_tag("learned", args)
            for args in ([], ["--lr", "1e-2"], ["--steps", "600"], ["--steps", "600", "--lr", "1e-2"])}
    assert len(tags) == 4 and "_learned_steps_600_lr_1e-2" in tags  # a reordered config finds the same caches


def test_a_budget_run_whose_cache_is_gone_is_kept_from_the_published_results(tmp_path: Path) -> None:
    results, budget = tmp_path / "results", {"results": str(tmp_path / "results")}
    model, pair = {"preset": "m", "learn": ["--epochs", "1"]}, (Path("seed0.st"), Path("seed1.st"))
    name = learning_budget.setting_label("learned", ["--lr", "1e-2"])
    plain = curve("none", 2.0) | {"losses": [1.6, 3.5, 1.6]}
    entry = {"learn": ["--epochs", "1"], "pairs": [["seed0", "seed1"]], "curves": [[plain, curve(name, 0.15)]]}
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "results.json").write_text(json.dumps({"m": entry}))
    run = {"out": str(tmp_path / "out")}
    assert learning_budget.setting_curve(run, budget, model, pair, "learned", ["--lr", "1e-2"],
                                         plain)["barrier"] == 0.15
    # Other learning flags, another setting, another pair or other checkpoints (a retrained seed: another plain
    # curve) would need a run: none of them is taken from there.
    assert learning_budget.published_curve(results, model | {"learn": []}, pair, name, plain) is None
    assert learning_budget.published_curve(results, model, pair, learning_budget.setting_label("learned", []),
                                           plain) is None
    assert learning_budget.published_curve(results, model, (pair[1], pair[0]), name, plain) is None
    retrained = plain | {"losses": [1.6, 3.5, 1.6000001]}
    assert learning_budget.published_curve(results, model, pair, name, retrained) is None


def test_a_budget_setting_that_names_models_runs_on_those_only() -> None:
    budget = {"settings": [{"args": ["--epochs", "4"], "models": ["vit-bench"]}, {"args": ["--lr", "1e-2"]}]}
    assert [s["args"] for s in learning_budget.settings_of(budget, {"preset": "vit-bench"})] == [
        ["--epochs", "4"], ["--lr", "1e-2"]]
    assert [s["args"] for s in learning_budget.settings_of(budget, {"preset": "gpt2-bench"})] == [["--lr", "1e-2"]]
    assert learning_budget.settings_of(budget, {"preset": "vit-bench", "name": "vit-bench-e10"}) == [
        budget["settings"][1]]  # a named entry is its name, not its preset


def test_the_forms_bench_refuses_a_table_without_the_standard_form_before_measuring() -> None:
    with pytest.raises(SystemExit, match='must include "standard"'):  # no run or model is read: nothing is measured
        forms.measure_model({}, {"forms": ["rmsnorm", "circuit"], "methods": ["none"]}, {}, "")


@pytest.mark.parametrize("name", ["vit-odd", "gpt2-odd"])
def test_the_sites_split_every_moved_tensor_once_and_leave_out_the_unmoved(name: str) -> None:
    cfg = CONFIGS[name]
    arch = get_arch(cfg.family)
    a, b = (canonicalize(arch, random_native(cfg, seed), cfg) for seed in (0, 1))
    sites = barrier_sites.sites(arch.spec, cfg.depth, a, b)
    names = [n for group in sites.values() for n in group]
    assert len(names) == len(set(names))
    assert {n for n in a if not torch.equal(a[n], b[n])} <= set(names)
    assert all(any(not torch.equal(a[n], b[n]) for n in group) for group in sites.values())
    assert not any(site.endswith("other") for site in sites)  # the folded LayerNorms are equal in every model
    assert {f"layer {layer} {unit}" for layer in range(cfg.depth) for unit in ("heads", "MLP")} <= set(sites)
    assert barrier_sites.sites(arch.spec, cfg.depth, a, a) == {}


@pytest.mark.parametrize("name", ["vit-odd", "gpt2-odd"])
def test_a_model_and_its_transformed_copy_cost_nothing_at_any_site_once_weight_matched(name: str) -> None:
    cfg = CONFIGS[name]
    arch = get_arch(cfg.family)
    native = random_native(cfg, 7)
    moved = apply(canonicalize(arch, native, cfg), arch.spec,
                  random_transform(cfg, MATCHABLE, torch.Generator().manual_seed(7)), cfg.heads)
    copy = arch.to_native(moved, cfg)
    weight, none = (barrier_sites.pair_sites((native, copy), cfg, dataset(cfg), method, [])
                    for method in ("weight", "none"))
    assert weight["loss_a"] == pytest.approx(weight["loss_b"], abs=1e-5)
    assert abs(weight["midpoint"]) < 1e-5 and max(map(abs, weight["sites"].values())) < 1e-5
    assert len(none["sites"]) >= 2 * cfg.depth and max(map(abs, none["sites"].values())) > 1e-4


TINY_ACCELERATOR = """
[run]
results = "unused"
threads = 1
[train]
presets = ["vit-tiny", "gpt2-tiny"]
warmup = 1
steps = { cpu = 2, cuda = 2 }
precisions = { cpu = ["fp32"], cuda = ["fp32"] }
[big]
devices = ["cpu", "cuda"]
width = 30
depth = 2
heads = 3
mlp = 37
vocab = 41
context = 8
[svd]
devices = ["cpu", "cuda"]
presets = ["gpt2-tiny"]
cpu-svd-max = [0, 4096]
"""


def test_the_accelerator_bench_measures_what_it_names_and_keeps_earlier_sections(tmp_path: Path) -> None:
    """Two runs of one section each end in one results file; the planted transform is found; the table names every
    row with no speed-up while only one device was measured."""
    config = tmp_path / "accelerator.toml"
    config.write_text(TINY_ACCELERATOR)
    threshold = groups.CPU_SVD_MAX
    for section in ("train", "big", "svd"):
        assert accelerator.main(["--config", str(config), "--device", "cpu", "--sections", section,
                                 "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results-cpu.json").read_text())["rows"]
    assert [r["row"].split(" (")[0] for r in rows] == ["train step vit-tiny", "train step gpt2-tiny",
                                                       "weight matching, GPT-2 d30 × 2 layers, vocabulary 41",
                                                       "weight matching, gpt2-tiny pair, CPU_SVD_MAX 0",
                                                       "weight matching, gpt2-tiny pair, CPU_SVD_MAX 4096"]
    assert threshold == groups.CPU_SVD_MAX  # restored after the svd section's settings
    assert all(r["value"] > 0 for r in rows) and rows[2]["relative_distance_left"] < 1e-10
    summary = (tmp_path / "summary.md").read_text()
    table = [line.split(" | ") for line in summary.splitlines() if line.startswith("| ") and "---" not in line]
    assert [cells[0].lstrip("| ") for cells in table[1:]] == [r["row"] for r in rows]
    assert {cells[-2] for cells in table[1:]} == {"–"}  # the speed-up column: one device, no ratio


@pytest.mark.parametrize("config", ["barriers", "merging"])
def test_a_bench_whose_published_rows_predate_the_matchers_defaults_pins_the_matcher_they_ran_with(config: str) -> None:
    """The rows of these benches were measured with the identity start, the squared head cost and the stream's
    biases read; their configs name that matcher, so that their one command reproduces them under today's defaults."""
    run = tomllib.loads(Path(f"simulations/bench/configs/{config}.toml").read_text())["run"]
    pinned = WeightOptions(start="identity", head_cost="squared", mlp_cost="inner", biases="read")
    assert parse_match_flags(run["matcher"]).weight == pinned
    assert parse_match_flags(run["matcher"]).symmetry.group == "orthogonal"


def test_every_published_federated_grid_pins_the_group_it_ran_with() -> None:
    """Every published grid names the part of the group it ran with, so its command reproduces it whatever the
    default becomes: those published before the whole group became the default ran over its orthogonal part (a
    smoke config and a grid without results run today's defaults)."""
    unpinned = [path.name for path in Path("simulations/configs").glob("*.toml")
                if Path("simulations/results", path.stem).is_dir()
                and tomllib.loads(path.read_text())["run"].get("group") not in ("orthogonal", "whole")]
    assert not unpinned, unpinned


def test_every_published_grid_of_partial_participation_names_the_sampler_it_ran_with() -> None:
    """Seeded sampling became the default on 2026-12-07: a published grid that samples a share of its nodes names its
    sampler, so that its command (and --extend) samples as its cells did."""
    unnamed = [path.name for path in Path("simulations/configs").glob("*.toml")
               if Path("simulations/results", path.stem).is_dir()
               and float(tomllib.loads(path.read_text())["run"].get("fraction-train", 1.0)) < 1
               and "sampling" not in tomllib.loads(path.read_text())["run"]]
    assert not unnamed, unnamed


def test_every_published_grid_names_the_guard_its_aligned_rows_ran_with() -> None:
    """min-alignment-gain guards mixed widths since 2026-12-06, and learned at every width since 2026-12-07: every
    published grid names it for each aggregation it came to since (in [run] or the variant), so that its command
    reproduces its rows."""
    unnamed = []
    for path in Path("simulations/configs").glob("*.toml"):
        config = tomllib.loads(path.read_text())
        run, entries = config["run"], config["experiment"]["aggregations"]
        tiers = [w.get("width-tiers", run.get("width-tiers", "1")) for w in config.get("widths", [{}])]
        if not Path("simulations/results", path.stem).is_dir():
            continue
        mixed = any(t not in ("1", "1.0") for t in tiers)
        variants = [e if isinstance(e, dict) else {"label": e, "aggregation": e} for e in entries]
        unnamed += [f"{path.stem}: {v['label']}" for v in variants if v["aggregation"] in GUARDED
                    and (mixed or v["aggregation"] in REFINED) and "min-alignment-gain" not in run | v]
    assert not unnamed, unnamed


@pytest.mark.skipif(find_fashion_mnist() is None, reason="Fashion-MNIST is not installed (make data)")
def test_the_client_cost_bench_times_training_and_the_test_score_of_a_grids_client(tmp_path: Path) -> None:
    """One repeat on vit-tiny: the client trains its partition's epochs, then scores the central subset; the
    summary names both."""
    settings = RunSettings(model="vit-tiny", partitioner="dirichlet", alpha=0.3, eval_limit=200, local_epochs=1)
    result = client_cost.measure(settings, partition=3, clients=100, repeats=1)
    [run] = result["runs"]
    assert run["steps"] > 0 and run["train_cpu_s"] > 0 and run["test_cpu_s"] > 0 and result["test_samples"] == 200
    assert run["test_share"] == pytest.approx(run["test_cpu_s"] / run["train_cpu_s"])
    text = client_cost.summary(result, "cmd")
    assert "`cmd`" in text and "| 0 | " in text and "Median test / training" in text


def test_the_server_cost_bench_fits_the_growth_it_measures() -> None:
    """Costs that grow as N² read as slope 2; a single row fits nothing."""
    from simulations.bench.server_cost import slope

    rows = [{"clients": n, "cpu_seconds": 0.5 * n * n} for n in (10, 30, 100)]
    assert slope(rows, "cpu_seconds") == pytest.approx(2.0)
    assert slope(rows[:1], "cpu_seconds") is None


def test_the_barrier_summary_shows_a_timing_table_only_when_timing_was_measured() -> None:
    """A run under --no-timing with no earlier timing printed an empty table and pointed to it."""
    meta = {"command": "c", "config": "f", "machine": "m", "threads": 1, "wall_minutes": 0.1, "points": 3,
            "limit": 10, "learn": ""}
    timing = {"a": {"models": "a / b", "threads": 1, "median_seconds": 0.5, "median_cpu_seconds": 0.9, "sweeps": 4}}
    without, with_timing = barriers.markdown([], {}, meta, []), barriers.markdown([], timing, meta, [])
    assert "| models | threads |" not in without and "the table below" not in without
    assert "| a / b | 1 | 0.50 | 0.90 | 4 |" in with_timing and "the table below" in with_timing
