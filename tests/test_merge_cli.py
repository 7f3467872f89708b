"""`glmc merge` and `glmc barrier --simplex` end to end on tiny checkpoints, and their one-line errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from glmc.archs import build_model, get_arch
from glmc.cli import build_parser, main
from glmc.cli.merge import simplex_points
from glmc.core.config import preset, scale_width
from glmc.data.fashion_mnist import find_fashion_mnist
from glmc.errors import ConfigError
from glmc.io.checkpoint import CheckpointMeta, load_checkpoint, save_checkpoint
from glmc.io.formats import read
from glmc.match.options import MatchOptions, WeightOptions
from glmc.merging.evaluation import PredictionMixture, grid_steps, simplex_grid
from glmc.merging.interpolation import evaluate_mixtures
from glmc.merging.merge import MergeSetup, merge_models
from glmc.merging.options import MergeOptions
from glmc.merging.universe import members

HAS_FASHION = find_fashion_mnist() is not None
VIT = preset("vit-tiny").replace(num_classes=10, in_chans=1, img_size=28, depth=1)
needs_data = pytest.mark.skipif(not HAS_FASHION, reason="Fashion-MNIST not installed (make setup installs it)")


def _checkpoint(path, cfg, seed, mult=1.0, dataset="fashion-mnist"):
    """An untrained checkpoint of ``cfg`` (enough to exercise merging and evaluation)."""
    torch.manual_seed(seed)
    meta = CheckpointMeta(preset="vit-tiny", config=cfg, width_mult=mult, seed=seed, dataset=dataset)
    return save_checkpoint(path, build_model(cfg), meta)


@pytest.fixture
def trio(tmp_path):
    """Two full-width checkpoints and one at width multiplier 0.5."""
    return [_checkpoint(tmp_path / "a.safetensors", VIT, 0), _checkpoint(tmp_path / "b.safetensors", VIT, 1),
            _checkpoint(tmp_path / "c.safetensors", scale_width(VIT, 0.5), 2, mult=0.5)]


def test_simplex_grid_covers_the_simplex():
    grid = simplex_grid(3, 4)
    assert len(grid) == 15 and all(abs(sum(w) - 1) < 1e-12 for w in grid) and (1.0, 0.0, 0.0) in grid
    assert len(simplex_grid(5, grid_steps(5, 66))) <= 66 and grid_steps(10, 5) == 2


@needs_data
def test_prediction_mixture_is_the_weighted_mean_of_the_models_probabilities_at_their_own_widths():
    """The soft targets of distillation: Σ_i w_i softmax(f_i(x)) with the weights normalised, models of any width."""
    cfg = preset("vit-tiny")
    torch.manual_seed(0)
    models = [build_model(cfg).eval(), build_model(scale_width(cfg, 0.5)).eval()]
    arch, x = get_arch(cfg.family), torch.randn(4, cfg.in_chans, cfg.img_size, cfg.img_size)
    mixed = PredictionMixture(models, arch, [3.0, 1.0])(x)
    probs = [arch.logits(m, x).softmax(-1) for m in models]
    torch.testing.assert_close(mixed, 0.75 * probs[0] + 0.25 * probs[1])
    torch.testing.assert_close(mixed.sum(-1), torch.ones(4))
    assert not mixed.requires_grad
    for weights in ([1.0], [1.0, -1.0], [0.0, 0.0]):
        with pytest.raises(ConfigError, match="one non-negative weight per model"):
            PredictionMixture(models, arch, weights)


def test_a_pairs_merge_evaluates_eleven_points_by_default_and_grows_gently():
    """The default grid: a pair's 11 λ, as its barrier curve, and few more points for each model added."""
    args = build_parser().parse_args(["merge", "a.safetensors", "b.safetensors", "--out", "m.safetensors"])
    sizes = {n: len(simplex_grid(n, grid_steps(n, simplex_points(args, n)))) for n in (2, 3, 5, 10)}
    assert sizes == {2: 11, 3: 21, 5: 35, 10: 55}
    assert simplex_points(build_parser().parse_args(["merge", "a", "b", "--out", "m", "--simplex-points", "4"]), 2) == 4


def test_an_evaluation_shows_its_progress_and_the_time_left(capsys):
    """evaluate_mixtures' bar (on a terminal by default): points done of the grid, and the time left."""
    cfg = preset("vit-tiny")
    torch.manual_seed(0)
    states = [get_arch(cfg.family).to_canonical(build_model(cfg).state_dict(), cfg) for _ in range(2)]
    data = torch.utils.data.TensorDataset(torch.randn(8, cfg.in_chans, cfg.img_size, cfg.img_size),
                                          torch.zeros(8, dtype=torch.long))
    evaluate_mixtures(states, simplex_grid(2, 3), cfg, data, progress=True)
    bar = capsys.readouterr().err
    assert "evaluate" in bar and "4/4" in bar and "<00:00" in bar  # done/total [elapsed<left]
    evaluate_mixtures(states, simplex_grid(2, 1), cfg, data, progress=False)
    assert capsys.readouterr().err == ""


def test_merge_of_mixed_widths_writes_a_standard_checkpoint_and_a_report(trio, tmp_path, capsys):
    out, report = tmp_path / "merged.safetensors", tmp_path / "merge.json"
    argv = ["merge", *map(str, trio), "--method", "weight", "--weights", "2,1,1", "--out", str(out),
            "--json", str(report), "--limit", "64", "--simplex-points", "10", "--iters", "2", "--quiet"]
    assert main(argv) == 0
    headline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    state, meta = load_checkpoint(out)
    full = json.loads(report.read_text())
    assert meta.config == VIT and state["blocks.0.mlp.fc1.weight"].dtype == torch.float32
    assert len(full["inputs"]) == 3 and len(full["simplex"]["weights"]) == 10 and len(full["width_barriers"]) == 1
    assert 1 <= len(full["universe"]) <= 2 and headline["merged_accuracy"] == full["merged"]["accuracy"]
    assert full["simplex"]["barrier"] >= -1e-6  # the vertices are in the grid, where B = 0
    assert full["matcher"] == dataclasses.asdict(WeightOptions())


def test_merge_takes_the_weight_matchers_flags_and_reports_them(trio, tmp_path, capsys):
    """A merge is reproducible only with the matcher it ran: the flags reach the matching, and the report names
    them (the same merge through the library, with the same options, gives the same bits)."""
    out, report = tmp_path / "merged.safetensors", tmp_path / "merge.json"
    flags = ["--start", "identity", "--head-cost", "squared", "--stop", "fixed", "--biases", "read"]
    argv = ["merge", *map(str, trio[:2]), "--method", "weight", "--out", str(out), "--json", str(report),
            "--limit", "16", "--iters", "1", "--quiet", *flags]
    assert main(argv) == 0
    assert json.loads(report.read_text())["matcher"] == {"start": "identity", "head_cost": "squared",
                                                          "mlp_cost": "inner", "stop": "fixed", "biases": "read",
                                                          "ov_maps": "orthogonal"}
    natives, metas = zip(*(read(p) for p in trio[:2]), strict=True)
    weight = WeightOptions(start="identity", head_cost="squared", stop="fixed", biases="read")
    setup = MergeSetup(metas[0].config, MergeOptions("weight", MatchOptions(weight=weight), max_iters=1))
    merged = merge_models(members(natives, [m.config for m in metas]), setup).universe.merged
    expect = get_arch(VIT.family).to_native(merged, VIT)
    state, _ = load_checkpoint(out)
    assert all(torch.equal(state[k], v.float()) for k, v in expect.items())


@needs_data
def test_merge_with_circuit_heads_refits_the_heads_and_refuses_mixed_widths(trio, tmp_path, capsys):
    """--circuit-heads reaches the merge (the report says so, the heads change, nothing else does); with a
    narrower input it is refused in one line and writes nothing."""
    outs = {flag: tmp_path / f"m{len(flag)}.safetensors" for flag in ("", "--circuit-heads")}
    for flag, out in outs.items():
        argv = ["merge", *map(str, trio[:2]), "--method", "weight", "--out", str(out), "--limit", "16", "--iters",
                "1", "--simplex-points", "3", "--quiet", "--json", str(out.with_suffix(".json")), *filter(None, [flag])]
        assert main(argv) == 0
    (plain, _), (refitted, _) = (load_checkpoint(out) for out in outs.values())
    assert json.loads(outs["--circuit-heads"].with_suffix(".json").read_text())["circuit_heads"] is True
    heads = {k for k in plain if k.startswith("blocks.0.attn.") and k.endswith("weight")}
    assert heads and all(not torch.allclose(plain[k], refitted[k], atol=1e-4) for k in heads)
    assert all(torch.equal(plain[k], refitted[k]) for k in plain if not k.startswith("blocks.0.attn."))
    capsys.readouterr()
    never = tmp_path / "never.safetensors"
    assert main(["merge", *map(str, trio), "--circuit-heads", "--out", str(never), "--limit", "16", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "heads merged as circuits need inputs of one width" in err[0] and not never.exists()


@needs_data
def test_vanilla_merge_at_one_width_is_the_mean_of_the_inputs(trio, tmp_path):
    out = tmp_path / "mean.safetensors"
    argv = ["merge", *map(str, trio[:2]), "--method", "none", "--out", str(out), "--limit", "16",
            "--simplex-points", "3", "--quiet"]
    assert main(argv) == 0
    merged, (a, _), (b, _) = load_checkpoint(out)[0], load_checkpoint(trio[0]), load_checkpoint(trio[1])
    assert all(torch.allclose(merged[k], (a[k] + b[k]) / 2, atol=1e-7) for k in a)


@needs_data
def test_restore_norms_gives_the_merged_neurons_their_inputs_mean_norm(trio, tmp_path):
    out, report = tmp_path / "restored.safetensors", tmp_path / "restored.json"
    argv = ["merge", *map(str, trio[:2]), "--method", "none", "--restore-norms", "--out", str(out), "--json",
            str(report), "--limit", "16", "--simplex-points", "3", "--quiet"]
    assert main(argv) == 0
    rows = [torch.cat([s["blocks.0.mlp.fc1.weight"], s["blocks.0.mlp.fc1.bias"][:, None]], 1).norm(dim=1)
            for s in (load_checkpoint(p)[0] for p in (out, *trio[:2]))]
    assert json.loads(report.read_text())["restore_norms"] is True
    assert torch.allclose(rows[0], (rows[1] + rows[2]) / 2, rtol=1e-5)


@needs_data
def test_barrier_simplex_writes_a_heat_map(trio, tmp_path, capsys):
    report, plot = tmp_path / "simplex.json", tmp_path / "simplex.png"
    argv = ["barrier", "--simplex", str(trio[0]), str(trio[1]), str(trio[2]), "--method", "none", "--method",
            "weight", "--simplex-steps", "2", "--limit", "16", "--json", str(report), "--plot", str(plot), "--quiet"]
    assert main(argv) == 0
    panels = json.loads(report.read_text())["panels"]
    assert [p["method"] for p in panels] == ["none", "weight"] and len(panels[0]["weights"]) == 6
    assert plot.stat().st_size > 0 and set(json.loads(capsys.readouterr().out)) == {"none", "weight"}


def _fails_with_one_line(argv, capsys, expect):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("glmc: error: ") and expect in err[0], err


@pytest.mark.parametrize(("other", "expect"), [
    (preset("gpt2-tiny").replace(vocab_size=11, depth=1), "families differ"),
    (VIT.replace(depth=2), "depth-heterogeneous merging is out of scope"),
    (VIT.replace(num_classes=7), "class counts differ"),
])
def test_incompatible_inputs_fail_in_one_line(tmp_path, capsys, other, expect):
    a = _checkpoint(tmp_path / "a.safetensors", VIT, 0)
    b = _checkpoint(tmp_path / "b.safetensors", other, 1)
    _fails_with_one_line(["merge", str(a), str(b), "--out", str(tmp_path / "m.safetensors")], capsys, expect)


def test_target_narrower_than_an_input_fails_in_one_line(trio, tmp_path, capsys):
    argv = ["merge", *map(str, trio), "--width-of", str(trio[2]), "--out", str(tmp_path / "m.safetensors")]
    _fails_with_one_line(argv, capsys, "narrower than an input")
    argv = ["merge", *map(str, trio), "--width-mult", "0.5", "--out", str(tmp_path / "m.safetensors")]
    _fails_with_one_line(argv, capsys, "narrower than an input")


def test_bad_weights_and_methods_fail_in_one_line(trio, tmp_path, capsys):
    out = str(tmp_path / "m.safetensors")
    _fails_with_one_line(["merge", *map(str, trio), "--limit", "0", "--out", out], capsys, "limit must be at least 1")
    assert not (tmp_path / "m.safetensors").exists()  # refused before the merge: nothing written
    report = str(tmp_path / "b.json")
    _fails_with_one_line(["barrier", *map(str, trio[:2]), "--limit", "-3", "--json", report], capsys,
                         "limit must be at least 1")
    _fails_with_one_line(["barrier", *map(str, trio[:2]), "--method", "activation", "--batch", "0", "--json", report],
                         capsys, "--batch: must be at least 1, got 0")  # 0 once meant the default, 512
    _fails_with_one_line(["merge", *map(str, trio), "--weights", "1,2", "--out", out], capsys,
                         "need one positive weight per model")
    _fails_with_one_line(["merge", *map(str, trio), "--method", "magic", "--out", out], capsys, "unknown merge method")
    bad = {("--weights", "1,nan,2"): "need one positive weight per model",
           ("--width-mult", "nan"): "must be positive and finite, got nan",
           ("--iters", "0"): "--iters: must be at least 1, got 0", ("--tol", "nan"): "tol=nan (must be finite and ≥ 0)",
           ("--workers", "0"): "--workers: must be at least 1, got 0",
           ("--iters", "two"): "--iters: must be a whole number, got 'two'"}
    for flag, expect in bad.items():  # each once went through: a traceback, or a merge with a meaningless setting
        _fails_with_one_line(["merge", *map(str, trio), *flag, "--out", out], capsys, expect)
    assert not (tmp_path / "m.safetensors").exists()


@needs_data
def test_a_checkpoint_with_a_nan_fails_in_one_line_naming_the_tensor(trio, tmp_path, capsys):
    """A diverged model reaches weight matching as an SVD that does not converge; it is refused when read, by the
    file's path and its own tensor name."""
    state, meta = load_checkpoint(trio[1])
    state["blocks.0.mlp.fc1.weight"][3, 5] = float("nan")
    bad = save_checkpoint(tmp_path / "nan.safetensors", state, meta)
    out = tmp_path / "m.safetensors"
    named = f"model {bad}: tensor 'blocks.0.mlp.fc1.weight' holds 1 NaN or inf value(s)"  # the file's own names
    _fails_with_one_line(["barrier", str(trio[0]), str(bad), "--limit", "16", "--json", str(tmp_path / "b.json")],
                         capsys, named)
    _fails_with_one_line(["merge", str(trio[0]), str(bad), "--out", str(out)], capsys, named)
    assert not out.exists()


@needs_data
def test_repair_gives_the_merged_channels_their_inputs_mean_statistics(trio, tmp_path):
    from glmc.archs import get_arch
    from glmc.cli.data_options import train_subset
    from glmc.data.tasks import inputs_of
    from glmc.merging.repair import channel_stats
    from glmc.symmetry.canonical import canonicalize, to_model

    out, report = tmp_path / "repaired.safetensors", tmp_path / "repaired.json"
    argv = ["merge", *map(str, trio[:2]), "--method", "none", "--repair", "48", "--out", str(out), "--json",
            str(report), "--limit", "16", "--simplex-points", "3", "--quiet"]
    assert main(argv) == 0
    assert json.loads(report.read_text())["repair"] == 48
    loaded = [load_checkpoint(p) for p in (out, *trio[:2])]
    x = inputs_of(train_subset(loaded[0][1], None, 48), 48)  # the merge's own draw of the training split
    site = [("blocks.{l}.mlp.fc2", 0)]  # the last site repaired: every earlier site is already as it ends
    stats = [channel_stats(to_model(canonicalize(get_arch("vit"), s, VIT, dtype=torch.float64), VIT), VIT, x, site,
                           16)[site[0]]
             for s, _ in loaded]
    for i in range(2):  # mean, std
        assert torch.allclose(stats[0][i], (stats[1][i] + stats[2][i]) / 2, rtol=1e-4, atol=1e-5)


@needs_data
def test_barrier_repair_names_its_curves_and_keeps_both_ends(trio, tmp_path, capsys):
    """`glmc barrier --repair N`: one METHOD+repair curve per method, whose ends are the models' own losses."""
    plain, repaired = tmp_path / "plain.json", tmp_path / "repaired.json"
    common = [*map(str, trio[:2]), "--method", "none", "--method", "weight", "--points", "3", "--limit", "32",
              "--quiet"]
    assert main(["barrier", *common, "--json", str(plain)]) == 0
    assert main(["barrier", *common, "--repair", "48", "--json", str(repaired)]) == 0
    curves = [json.loads(p.read_text())["curves"] for p in (plain, repaired)]
    assert [c["method"] for c in curves[1]] == ["none+repair", "weight+repair"]
    for before, after in zip(*curves, strict=True):
        assert after["losses"][0] == pytest.approx(before["losses"][0], rel=1e-5)
        assert after["losses"][-1] == pytest.approx(before["losses"][-1], rel=1e-5)
        assert after["losses"][1] != pytest.approx(before["losses"][1], rel=1e-4)
    capsys.readouterr()
    _fails_with_one_line(["barrier", *common, "--repair", "0", "--json", str(repaired)], capsys,
                         "--repair: must be at least 1, got 0")
    _fails_with_one_line(["barrier", "--simplex", str(trio[0]), *map(str, trio[1:]), "--repair", "8", "--json",
                          str(repaired)], capsys, "--repair applies to the pairwise curves, not to --simplex")


@needs_data
def test_barrier_in_the_papers_forms_keeps_both_ends_and_moves_the_path(trio, tmp_path, capsys):
    """`glmc barrier --form rmsnorm|circuit`: the ends are still the models' own losses (each form is an exact
    reparameterisation), while the interior is another path: circuits interpolate products of A's and B's factors,
    and the rmsnorm form aligns the residual over the whole O(d)."""
    common = [*map(str, trio[:2]), "--method", "none", "--method", "weight", "--method", "activation",
              "--batch", "48", "--points", "3", "--limit", "32", "--quiet"]
    reports = {}
    for form in ("standard", "rmsnorm", "circuit"):
        out = tmp_path / f"{form}.json"
        assert main(["barrier", *common, "--form", form, "--json", str(out)]) == 0
        reports[form] = json.loads(out.read_text())
        assert reports[form]["form"] == form
    curves = {form: {c["method"]: c for c in report["curves"]} for form, report in reports.items()}
    for form in ("rmsnorm", "circuit"):
        for method, curve in curves[form].items():
            plain = curves["standard"][method]
            assert curve["losses"][0] == pytest.approx(plain["losses"][0], rel=1e-5), (form, method)
            assert curve["losses"][-1] == pytest.approx(plain["losses"][-1], rel=1e-5), (form, method)
    assert curves["circuit"]["none"]["losses"][1] != pytest.approx(curves["standard"]["none"]["losses"][1], rel=1e-4)
    assert curves["rmsnorm"]["weight"]["losses"][1] != pytest.approx(curves["standard"]["weight"]["losses"][1],
                                                                      rel=1e-4)
    capsys.readouterr()
    _fails_with_one_line(["barrier", *common, "--form", "circuit", "--repair", "8", "--json", str(tmp_path / "r")],
                         capsys, "--repair needs the standard form, not --form circuit")
    _fails_with_one_line(["barrier", "--simplex", str(trio[0]), *map(str, trio[1:]), "--form", "rmsnorm", "--json",
                          str(tmp_path / "s")], capsys, "--form applies to the pairwise curves, not to --simplex")


@needs_data
def test_barrier_across_widths_embeds_the_narrow_model_and_keeps_both_ends(trio, tmp_path, capsys):
    """`glmc barrier WIDE NARROW` (paper Fig. 3c from the command line): the narrow end of every curve is the
    narrow model's own loss (its embedding is exact, whatever the alignment), the wide end the wide model's."""
    from glmc.archs import get_arch
    from glmc.data.tasks import held_out
    from glmc.io.checkpoint import load_model
    from glmc.train import evaluate

    report = tmp_path / "widths.json"
    argv = ["barrier", str(trio[0]), str(trio[2]), "--method", "none", "--method", "weight", "--points", "3",
            "--limit", "32", "--json", str(report), "--quiet"]
    assert main(argv) == 0
    curves = json.loads(report.read_text())["curves"]
    assert [c["method"] for c in curves] == ["none", "weight"]
    test = held_out("fashion-mnist", VIT, None, 32)
    wide, narrow = (evaluate(load_model(p)[0], get_arch("vit"), test)["loss"] for p in (trio[0], trio[2]))
    for curve in curves:
        assert curve["losses"][-1] == pytest.approx(wide, rel=1e-5)  # λ = 1: A
        assert curve["losses"][0] == pytest.approx(narrow, rel=1e-5)  # λ = 0: B, embedded
    assert curves[0]["losses"][1] != pytest.approx(curves[1]["losses"][1], rel=1e-4)  # weight moved the midpoint
    assert set(json.loads(capsys.readouterr().out)) == {"none", "weight"}
    learned = ["barrier", str(trio[0]), str(trio[2]), "--method", "learned", "--batch", "64", "--steps", "2",
               "--fill", "copies", "--points", "3", "--limit", "32", "--json", str(report), "--quiet"]
    assert main(learned) == 0  # learned matching of the embedded pair, Net2Net fill: the ends stay the models'
    curve = json.loads(report.read_text())["curves"][0]
    assert curve["losses"] == pytest.approx([narrow, curve["losses"][1], wide], rel=1e-5)


@pytest.mark.parametrize("fill", ["zeros", "copies"])
def test_align_across_widths_writes_a_checkpoint_of_the_wide_config_computing_the_narrow_model(trio, tmp_path, fill,
                                                                                              capsys):
    """`glmc align WIDE NARROW`: the narrow model embedded into the wide one's width and aligned to it, saved as a
    checkpoint of the wide config that still computes the narrow function (float32 on disk), at the default matcher
    and at a pinned one."""
    from glmc.io.checkpoint import load_model

    out = tmp_path / "aligned.safetensors"
    matcher = ["--start", "identity", "--head-cost", "squared"] if fill == "copies" else []
    assert main(["align", str(trio[0]), str(trio[2]), "--method", "weight", "--fill", fill, "--out", str(out),
                 "--quiet", *matcher]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["method"] == "weight" and report["width"] == [VIT.width // 2, VIT.width]
    (narrow, _), (moved, meta) = load_model(trio[2]), load_model(out)
    assert meta.config == VIT.replace(norm_eps=VIT.norm_eps / 2)  # the exact embedding's LayerNorm eps: eps·d/D
    assert meta.width_mult == 1.0 and "aligned to a.safetensors by weight" in meta.split
    x = torch.randn(8, 1, 28, 28)
    with torch.no_grad():
        assert (narrow.double()(x.double()) - moved.double()(x.double())).abs().max() <= 1e-5


def test_align_across_widths_refuses_what_it_cannot_do_in_one_line(trio, tmp_path, capsys):
    out = str(tmp_path / "aligned.safetensors")
    _fails_with_one_line(["align", str(trio[2]), str(trio[0]), "--out", out], capsys,
                         "the target is narrower than an input")
    _fails_with_one_line(["align", str(trio[0]), str(trio[2]), "--method", "dual", "--out", out], capsys,
                         "across widths the methods are none, weight, weight-perm, weight-perm-stream, activation, "
                         "learned; not dual")
    assert not (tmp_path / "aligned.safetensors").exists()


def test_barrier_across_widths_refuses_what_it_cannot_do_in_one_line(trio, tmp_path, capsys):
    report = str(tmp_path / "b.json")
    _fails_with_one_line(["barrier", str(trio[2]), str(trio[0]), "--json", report], capsys,
                         "the target is narrower than an input")  # B is embedded into A: A must be the wider
    _fails_with_one_line(["barrier", str(trio[0]), str(trio[2]), "--method", "dual", "--json", report], capsys,
                         "across widths the methods are none, weight, weight-perm, weight-perm-stream, activation, "
                         "learned; not dual")
    _fails_with_one_line(["barrier", str(trio[0]), str(trio[2]), "--form", "circuit", "--json", report], capsys,
                         "--form applies to two models of one width")
    _fails_with_one_line(["barrier", str(trio[0]), str(trio[2]), "--repair", "8", "--json", report], capsys,
                         "--repair applies to two models of one width")
    assert not (tmp_path / "b.json").exists()
