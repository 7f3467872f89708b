"""The scaling bench's rows: each checks the planted transform is found, and its growth fit reads the slope."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glmc.archs import get_arch
from glmc.core.config import ModelConfig
from glmc.match.weight import weight_match
from glmc.symmetry.transforms import MATCHABLE, Transform
from simulations.bench import scaling

RUN = {"threads": 1, "seed": 0, "weight_start": "identity", "weight_classes": list(MATCHABLE),
       "activation_classes": ["head-perm", "mlp-perm"],
       "activation_samples": {"gpt2": 2, "vit": 2}}
MODELS = {"gpt2": {"name": "tiny-gpt2", "config": {"family": "gpt2", "width": 32, "depth": 2, "heads": 2, "mlp": 48,
                                                   "vocab_size": 40, "context": 8}},
          "llama": {"name": "tiny-llama", "plant": "hand",
                    "config": {"family": "llama", "width": 32, "depth": 2, "heads": 4, "kv_heads": 2, "mlp": 48,
                               "vocab_size": 40, "context": 8, "activation": "silu", "rotary_pct": 1.0,
                               "qkv_bias": False}},
          "neox": {"name": "tiny-neox", "plant": "hand",
                   "config": {"family": "neox", "width": 32, "depth": 2, "heads": 4, "mlp": 48, "vocab_size": 40,
                              "context": 8, "rotary_pct": 0.25}},
          "vit": {"name": "tiny-vit", "config": {"family": "vit", "width": 32, "depth": 2, "heads": 2, "mlp": 48,
                                                 "img_size": 16, "patch": 8, "in_chans": 3, "num_classes": 5}}}


@pytest.mark.parametrize("method", ["weight", "weight-relaxed", "activation"])
@pytest.mark.parametrize("family", ["gpt2", "vit"])
def test_a_row_finds_the_planted_transform_and_measures_the_matching(family, method):
    row = scaling.measure(MODELS[family], method, RUN)
    assert row["recovered"] and row["misplaced"] == 0 and row["relative_distance"] <= 1e-10
    assert row["peak_rss_mb"] >= row["added_rss_mb"] >= 0 and row["cpu_seconds"] > 0
    assert row["params"] > 0 and row["method"] == method


@pytest.mark.parametrize("family", ["llama", "neox"])
def test_a_transform_planted_on_the_native_names_is_recovered_and_its_pair_is_apart(family):
    """The Llama and NeoX rows' B is moved by simulations.bench.planting, not by glmc: far from A, and undone."""
    cfg = ModelConfig.from_dict(MODELS[family]["config"])
    a, b = scaling.hand_planted_pair(cfg, 0)
    assert scaling.relative_distance(a, b) > 0.05  # the norms' unit gains, unmoved, hold most of ‖A‖²
    row = scaling.measure(MODELS[family], "weight-relaxed", RUN)
    assert row["recovered"] and row["relative_distance"] <= 1e-10 and row["misplaced"] is None


def test_an_unrecovered_transform_is_reported_as_such():
    """The check reads the transform: the identity left in place of the answer is far from T⁻¹."""
    cfg = ModelConfig.from_dict(MODELS["gpt2"]["config"])
    a, b, planted = scaling.planted_pair(cfg, MATCHABLE, 0)
    error = scaling.transform_error(Transform(planted.depth), planted)
    assert error["misplaced"] > 0 and error["map_deviation"] > 0.1
    found = weight_match(a, b, get_arch("gpt2").spec, cfg.depth, cfg.heads).transform
    assert scaling.transform_error(found, planted) == {"misplaced": 0, "map_deviation": pytest.approx(0, abs=1e-3)}


def test_the_growth_exponent_is_the_log_log_slope():
    rows = [{"family": "gpt2", "method": "weight", "model": f"m{w}", "params": w ** 2, "width": w,
             "wall_seconds": 0.5 * w ** 3, "cpu_seconds": w ** 3, "added_rss_mb": 2.0 * w ** 2} for w in (64, 128, 256)]
    fits = scaling.growth(rows, [{"name": r["model"]} for r in rows])
    assert fits[0]["cpu_seconds_vs_width"] == pytest.approx(3.0)
    assert fits[0]["cpu_seconds_vs_params"] == pytest.approx(1.5)
    assert fits[0]["added_rss_mb_vs_params"] == pytest.approx(1.0)
    assert scaling.growth(rows, [{"name": "m64", "growth": False}, {"name": "m128"}])[0]["models"] == 1
    assert scaling.growth([r | {"threads": 2} for r in rows], [{"name": r["model"]} for r in rows]) == []


def test_the_committed_summary_is_its_results_and_marks_the_runs_no_row_keeps():
    out = Path(__file__).parents[1] / "simulations" / "results" / "scaling"
    data = json.loads((out / "results.json").read_text())
    text = (out / "summary.md").read_text()
    assert text == scaling.markdown(data["rows"], data["growth"], data["runs"])
    kept = {row["run"] for row in data["rows"]}
    runs = [line for line in text.splitlines() if line[:1].isdigit() and ". `python" in line]
    assert len(runs) == len(data["runs"]) and set(range(len(runs))) - kept  # some run was measured again
    for i, line in enumerate(runs):
        assert ("No row of it is kept" in line) == (i not in kept)


def test_the_precision_bench_aligns_a_bfloat16_pair_in_a_fresh_process(tmp_path: Path) -> None:
    from simulations.bench import precision

    run = {"stored": "bfloat16", "seed": 0, "threads": 1, "precisions": ["stored"], "flags": [], "tolerance": 1e-2}
    (row,) = list(precision.measure(MODELS["llama"], run, tmp_path))
    assert row["exit"] == 0 and row["recovered"] and row["distance"] <= 1e-2 < 0.1 < row["b_distance"]
    assert 0.1 < row["peak_rss_gb"] < 8 and row["report"]["dtype"] == "bfloat16"  # the child's own VmHWM
    assert "| tiny-llama | 0 | stored | 0 |" in precision.markdown([row | {"run": 0}], [
        {"command": "c", "machine": "m", "wall_minutes": 0.1, "load_before": "0"}], 1e-2)


@pytest.mark.parametrize(("family", "stored", "tolerance"), [("neox", "float32", 1e-4), ("llama", "bfloat16", 1e-2)])
def test_a_cli_row_times_glmc_align_on_a_saved_pair_and_checks_its_output(family: str, stored: str, tolerance: float,
                                                                         tmp_path: Path) -> None:
    """A ``through = "cli"`` row: the pair saved in the stored dtype, glmc align in a fresh process (its own peak
    RSS and CPU time), the output within tolerance of A and B far from it, and its line in the summary."""
    model = MODELS[family] | {"through": "cli", "stored": stored, "tolerance": tolerance, "target": "1 s"}
    row = scaling.measured(model, "weight", RUN | {"work": str(tmp_path)})
    assert row["exit"] == 0 and row["recovered"] and row["relative_error"] <= tolerance < 0.05 < row["b_error"]
    assert 0.1 < row["peak_rss_mb"] / 1024 < 8 and row["cpu_seconds"] > 0 and row["inputs_gb"] > 0
    assert row["load_at_start"] >= 0 and row["load_at_end"] >= 0 and row["sweeps"] >= 1
    run = {"command": "c", "config": "x", "machine": "m", "load_before": "0"}
    summary = scaling.markdown([row | {"run": 0}], [], [run])
    assert f"| {model['name']} | 0 | {stored} |" in summary
