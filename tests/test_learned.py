"""Learned matching (paper Algorithm 1) and its soft, dual and multi-model variants: exact endpoints, gradients
through the projections, lower midpoint loss than weight matching, and clear failures on bad input."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import torch
from conftest import synthetic_images, synthetic_text
from torch.utils.data import DataLoader, Dataset, TensorDataset

from glmc.archs import Arch, build_model, get_arch
from glmc.cli import build_parser, main
from glmc.cli.options import match_options
from glmc.core.config import ModelConfig
from glmc.core.state import State, interpolate
from glmc.data.fashion_mnist import find_fashion_mnist
from glmc.errors import ConfigError, SpecError
from glmc.io.checkpoint import load_model
from glmc.match.align import align_pair
from glmc.match.dual import dual_match, mixing_sampler, refine_universe
from glmc.match.learned import (
    Endpoint,
    Latents,
    Path,
    learned_match,
    pair_points,
    project,
    split,
    straight_through,
    validate,
)
from glmc.match.options import LearnConfig, MatchOptions, SymmetryOptions, WeightOptions, Within
from glmc.match.soft import soft_match
from glmc.match.weight import learned_start, weight_match
from glmc.symmetry import groups
from glmc.symmetry.canonical import canonicalize, to_model
from glmc.symmetry.transforms import Transform, apply
from glmc.train import TrainConfig, evaluate, seed_everything, token_loss, train
from tests.symmetry_models import CONFIGS, RMS_CONFIGS, canonical, dataset, inputs, logits_of, random_native

FAMILIES = ["vit-odd", "gpt2-odd"]
FAST = LearnConfig(steps=6, eval_every=2, batch_size=16, lr=0.05, dtype="float64")


def learning(learn: LearnConfig, **match: Any) -> MatchOptions:
    """MatchOptions of ``learn`` at glmc's defaults otherwise (``match``: the other sections or the form)."""
    return MatchOptions(learn=learn, **match)
# Odd sizes, and tasks two tiny models learn in a second, so that interpolating them has a loss to lower.
TASKS = {
    "vit": (CONFIGS["vit-odd"].replace(width=30, heads=3, mlp=37, img_size=8, patch=4, num_classes=3),
            lambda seed: synthetic_images(192, seed)),
    "gpt2": (CONFIGS["gpt2-odd"].replace(width=30, heads=3, mlp=37, vocab_size=7, context=12),
             lambda seed: synthetic_text(96, seed=seed)),
}


@dataclass
class Trained:
    cfg: ModelConfig
    arch: Arch
    data: TensorDataset
    natives: list[State]
    states: list[State]  # canonical, float64


@pytest.fixture(scope="module", params=list(TASKS))
def trained(request) -> Trained:
    """Two models of one family trained from different seeds on the same synthetic task."""
    cfg, make = TASKS[request.param]
    arch, data = get_arch(cfg.family), make(0)
    natives = []
    for seed in (1, 2):
        seed_everything(seed)
        model = build_model(cfg)
        train(model, arch, data, TrainConfig(epochs=2, batch_size=16, lr=3e-3, threads=1), progress=False)
        natives.append(model.state_dict())
    states = [canonicalize(arch, n, cfg, dtype=torch.float64) for n in natives]
    return Trained(cfg, arch, data, natives, states)


def _pair(cfg, seeds=(1, 2)):
    arch = get_arch(cfg.family)
    natives = [random_native(cfg, s) for s in seeds]
    return arch, natives, [canonicalize(arch, n, cfg) for n in natives]


def _gap(state, native, cfg) -> float:
    """Max |logit difference| between a canonical state and a native model, float64."""
    x = inputs(cfg)
    with torch.no_grad():
        moved = get_arch(cfg.family).logits(to_model(state, cfg), x)
    return float((moved - logits_of(native, cfg, x)).abs().max())


@pytest.mark.parametrize(("method", "within"), [("learned", "orthogonal"), ("learned-perm", "orthogonal"),
                                                ("dual", "orthogonal"), ("learned", "invertible"),
                                                ("dual", "invertible")])
def test_aligned_endpoints_are_exactly_a_and_b(trained, method, within):
    cfg, (native_a, native_b) = trained.cfg, trained.natives
    learn = replace(FAST, within=within)  # invertible: dual composes π_A⁻¹ with a true inverse
    # from the identity start, which these few steps improve on (the relaxed start can already be the best point
    # dual learning validates at here, and then no learned map would be checked)
    aligned = align_pair(native_a, native_b, cfg, method, learning(learn, weight=WeightOptions(start="identity")),
                         data=trained.data)
    if method != "learned-perm":  # STE permutations need latent moves of order 1 before they change
        assert aligned.result.info["best_step"] > 0
    assert _gap(aligned.b, native_b, cfg) <= 1e-5
    assert _gap(aligned.a, native_a, cfg) <= 1e-5
    if within == "invertible":  # the maps did leave the orthogonal group, so the inverses were exercised
        assert max(_off_orthogonal(m) for m in aligned.result.transform.qk if m is not None) > 1e-6


def _off_orthogonal(maps: torch.Tensor) -> float:
    """max ‖MᵀM − I‖ over a stack of square maps."""
    eye = torch.eye(maps.shape[-1], dtype=maps.dtype)
    return float((maps.transpose(-1, -2) @ maps - eye).abs().max())


@pytest.mark.parametrize("method", ["learned", "dual"])
def test_circuit_form_learns_the_circuit_path_with_an_exact_transform(trained, method):
    cfg, (native_a, native_b), (a, b) = trained.cfg, trained.natives, trained.states
    aligned = align_pair(native_a, native_b, cfg, method, learning(FAST, form="circuit"), data=trained.data)
    assert aligned.result.info["best_step"] > 0
    assert _gap(aligned.b, native_b, cfg) <= 1e-5
    # The validation loss it reports is the circuit path's, not the standard path's, at the same transform.
    loader = DataLoader(split(trained.data, FAST, None)[1], batch_size=256)
    losses = {form: validate(Path([Endpoint(a), Endpoint(b)], cfg, form, torch.float64),
                             [None, aligned.result.transform], pair_points(FAST), loader)
              for form in ("circuit", "standard")}
    assert losses["circuit"] == pytest.approx(aligned.result.info["val_loss"], rel=1e-9)
    assert abs(losses["standard"] - losses["circuit"]) > 1e-6


def test_dual_moves_both_endpoints_exactly_and_keeps_the_path(trained):
    cfg, arch, (a, b) = trained.cfg, trained.arch, trained.states
    dual = dual_match(a, b, cfg, trained.data, learning(FAST))
    assert dual.result.info["best_step"] > 0
    moved_a, moved_b = (apply(s, arch.spec, t, cfg.heads) for s, t in ((a, dual.transform_a), (b, dual.transform_b)))
    assert _gap(moved_a, trained.natives[0], cfg) <= 1e-5 and _gap(moved_b, trained.natives[1], cfg) <= 1e-5
    # π_A⁻¹ maps the dual path onto A ↔ π_A⁻¹π_B(B): the same function at every λ.
    single = apply(b, arch.spec, dual.result.transform, cfg.heads)
    x = inputs(cfg)
    with torch.no_grad():
        dual_mid = arch.logits(to_model(interpolate(moved_a, moved_b, 0.45), cfg), x)
        single_mid = arch.logits(to_model(interpolate(a, single, 0.45), cfg), x)
    assert (dual_mid - single_mid).abs().max() <= 1e-8


def _latents_and_loss(trained: Trained, residual_perm: bool, soft: bool, within: Within = "fixed"):
    cfg, arch, (a, b) = trained.cfg, trained.arch, trained.states
    init = weight_match(a, b, arch.spec, cfg.depth, cfg.heads, permutations_only=residual_perm).transform
    options = LearnConfig(within=within)
    latents = Latents(init, cfg, options, fix_ones=True, residual_perm=residual_perm, soft=soft)
    path = Path([Endpoint(a), Endpoint(b, latents)], cfg, "standard", torch.float64)
    x, y = trained.data.tensors
    return latents, lambda: token_loss(path.logits(path.point([None, latents()], [0.5, 0.5]), x), y)


@pytest.mark.parametrize(("residual_perm", "soft", "within"),
                         [(False, False, "fixed"), (True, False, "fixed"), (False, True, "fixed"),
                          (False, False, "orthogonal"), (False, False, "invertible")])
def test_gradient_reaches_every_latent(trained, residual_perm, soft, within):
    latents, loss = _latents_and_loss(trained, residual_perm, soft, within)
    assert len(list(latents.parameters())) == 1 + 2 * trained.cfg.depth * (1 if within == "fixed" else 2)
    loss().backward()
    for name, p in latents.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_straight_through_solves_every_latent_at_once_as_alone():
    """The latents of a step go to the host together: each forward matrix is its own Hungarian permutation, and
    each latent's gradient is the output's, as with one latent at a time."""
    g = torch.Generator().manual_seed(0)
    zs = [torch.randn(n, n, generator=g, dtype=torch.float64, requires_grad=True) for n in (3, 7, 5)]
    hard = straight_through(zs)
    for z, h in zip(zs, hard, strict=True):
        expected = torch.eye(len(z), dtype=z.dtype)[groups.assignment(z.detach())]
        torch.testing.assert_close(h.detach(), expected, rtol=0, atol=1e-12)  # hard + z − z: rounding of z
    weights = [torch.randn(len(z), len(z), generator=g, dtype=torch.float64) for z in zs]
    sum((h * w).sum() for h, w in zip(hard, weights, strict=True)).backward()
    assert all(torch.equal(z.grad, w) for z, w in zip(zs, weights, strict=True))


def test_a_path_refuses_to_move_an_unfolded_endpoint_once_not_at_every_step(trained):
    """The path checks its moved endpoints' LayerNorm gains when it is built (then applies transforms without the
    per-call check, a device sync on a GPU): an unfolded one is a one-line SpecError there."""
    cfg, (a, b) = trained.cfg, trained.states
    raw = trained.arch.to_canonical(random_native(cfg, 3), cfg)
    latents = Latents(Transform.identity(cfg.depth), cfg, LearnConfig(), fix_ones=True)
    Path([Endpoint(raw), Endpoint(b)], cfg, "standard", torch.float64)  # A stays put: no check needed
    with pytest.raises(SpecError, match="not folded"):
        Path([Endpoint(a), Endpoint(raw, latents)], cfg, "standard", torch.float64)


def test_the_within_head_maps_of_every_model_in_one_batched_svd_are_the_bits_of_one_svd_each(trained):
    """project() factors all models' and layers' latents at once; each map and each gradient is what the
    per-latent polar factor gives, so the batching changes no result."""
    cfg, arch, (a, b) = trained.cfg, trained.arch, trained.states
    init = weight_match(a, b, arch.spec, cfg.depth, cfg.heads).transform
    models = [Latents(init, cfg, replace(FAST, within=within, noise=0.1), fix_ones=True, seed=seed)
              for seed, within in enumerate(["orthogonal", "invertible", "orthogonal"])]
    batched = project(models)
    alone = [[groups.polar(z) for z in (*lat.qk, *lat.ov)] if lat.within == "orthogonal" else [] for lat in models]
    assert [len(maps) for maps in batched] == [2 * cfg.depth, 0, 2 * cfg.depth]
    assert all(torch.equal(x, y) for xs, ys in zip(batched, alone, strict=True) for x, y in zip(xs, ys, strict=True))
    first, second = (_latent_grads(models, maps) for maps in (batched, alone))
    assert len(first) == 4 * cfg.depth and all(torch.equal(x, y) for x, y in zip(first, second, strict=True))


def _latent_grads(models: list[Latents], maps: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The within-head latents' gradients of a fixed linear function of ``maps``."""
    for lat in models:
        lat.zero_grad()
    flat = torch.cat([m.reshape(-1) for ms in maps for m in ms])
    (flat * torch.arange(1.0, 1.0 + flat.numel(), dtype=flat.dtype)).sum().backward()
    return [p.grad.clone() for lat in models for p in (*lat.qk, *lat.ov) if p.grad is not None]


@pytest.mark.parametrize(("residual_perm", "within"),
                         [(False, "fixed"), (True, "fixed"), (False, "orthogonal"), (False, "invertible")])
def test_hardened_latents_are_exact_after_the_permutations_change(trained, residual_perm, within):
    latents, loss = _latents_and_loss(trained, residual_perm, soft=False, within=within)
    optimizer = torch.optim.Adam(latents.parameters(), lr=0.5)
    for _ in range(4):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    hard = latents.harden()
    assert any(not torch.equal(h, i) for h, i in zip(hard.mlp, latents.init.mlp, strict=True))
    cfg, arch = trained.cfg, trained.arch
    assert _gap(apply(trained.states[1], arch.spec, hard, cfg.heads), trained.natives[1], cfg) <= 1e-5
    if within == "invertible":  # learned off the orthogonal group, and harden() returns copies, not the latents
        assert _off_orthogonal(hard.qk[0]) > 1e-3
        kept = hard.qk[0].clone()
        loss().backward()
        optimizer.step()
        assert torch.equal(hard.qk[0], kept)


def test_a_few_steps_lower_the_held_out_midpoint_loss(trained):
    cfg, arch, (a, b) = trained.cfg, trained.arch, trained.states
    held_out = TASKS[cfg.family][1](5)
    x, y = held_out.tensors
    test = TensorDataset(x.double() if x.is_floating_point() else x, y)

    def midpoint(t: Transform) -> float:
        return evaluate(to_model(interpolate(a, apply(b, arch.spec, t, cfg.heads), 0.5), cfg), arch, test)["loss"]

    options = LearnConfig(steps=10, eval_every=5, batch_size=32, dtype="float64")
    learned = learned_match(a, b, cfg, trained.data, learning(options))
    weight = weight_match(a, b, arch.spec, cfg.depth, cfg.heads)
    assert learned.info["val_loss"] < learned.info["val_loss_init"]
    assert midpoint(learned.transform) < midpoint(weight.transform)


def test_endpoint_targets_read_no_labels_and_fit_the_endpoints_mixed_prediction(trained):
    """targets "endpoints": the same transform whatever the labels say, and a path that comes closer to the
    endpoints' mixed prediction than weight matching's (the validation loss falls)."""
    cfg, (a, b) = trained.cfg, trained.states
    x, y = trained.data.tensors
    shuffled = TensorDataset(x, y[torch.randperm(len(y), generator=torch.Generator().manual_seed(0))])
    options = LearnConfig(steps=10, eval_every=5, batch_size=32, dtype="float64", targets="endpoints")
    runs = [learned_match(a, b, cfg, data, learning(options)) for data in (trained.data, shuffled)]
    assert runs[0].objective == runs[1].objective
    assert all(torch.equal(p, q) for p, q in zip(runs[0].transform.mlp, runs[1].transform.mlp, strict=True))
    assert torch.equal(runs[0].transform.residual, runs[1].transform.residual)
    assert runs[0].info["val_loss"] < runs[0].info["val_loss_init"]


def test_soft_targets_that_are_one_hot_give_the_label_loss():
    logits = torch.randn(3, 5, 7, dtype=torch.float64)
    labels = torch.randint(0, 7, (3, 5))
    one_hot = torch.nn.functional.one_hot(labels, 7).double()
    for reduction in ("mean", "sum"):
        torch.testing.assert_close(token_loss(logits, one_hot, reduction), token_loss(logits, labels, reduction))


def test_dropout_acts_on_the_steps_alone_and_a_run_repeats(trained):
    cfg, (a, b) = trained.cfg, trained.states
    runs = [learned_match(a, b, cfg, trained.data, learning(replace(FAST, dropout=p))) for p in (0.5, 0.5, 0.0)]
    assert [r.info["val_loss_init"] for r in runs[1:]] == [runs[0].info["val_loss_init"]] * 2  # validation: none
    assert runs[0].objective == runs[1].objective  # the masks come from the run's seed
    assert runs[0].objective[1:] != runs[2].objective[1:]  # the steps ran with dropout


def test_a_learning_rate_too_small_to_move_a_latent_returns_weight_matching():
    """A learning rate of 0 is refused (it learns nothing); one below float64's resolution of the latents moves none
    of them, so the validation never improves on the start and the start is returned: weight matching's transform."""
    cfg = CONFIGS["vit-odd"]
    arch, _, (a, b) = _pair(cfg)
    with pytest.raises(ConfigError, match=r"lr=0\.0"):
        replace(FAST, lr=0.0)
    learned = learned_match(a, b, cfg, dataset(cfg, 40), learning(replace(FAST, lr=1e-300)))
    weight = weight_match(a, b, arch.spec, cfg.depth, cfg.heads).transform
    t = learned.transform
    assert learned.info["best_step"] == 0
    assert torch.equal(t.residual, weight.residual)
    for layer in range(cfg.depth):
        assert torch.equal(t.heads[layer], weight.heads[layer]) and torch.equal(t.mlp[layer], weight.mlp[layer])
        assert torch.equal(t.qk[layer], weight.qk[layer]) and torch.equal(t.ov[layer], weight.ov[layer])


def test_soft_permutations_report_their_endpoint_error():
    cfg = CONFIGS["vit-odd"]
    _, _, (a, b) = _pair(cfg)
    result = soft_match(a, b, cfg, dataset(cfg, 40), learning(FAST))
    assert result.info["best_step"] > 0 and result.info["midpoint_gain"] > 0
    mlp = result.transform.mlp[0]
    assert mlp.shape == (cfg.mlp, cfg.mlp)
    assert torch.allclose(mlp.sum(0), torch.ones(cfg.mlp, dtype=mlp.dtype), atol=1e-6)
    assert result.info["endpoint_max_logit_error"] > 1e-5  # a doubly stochastic mix is not a symmetry
    assert isinstance(result.info["endpoint_loss_change"], float)


@pytest.mark.parametrize("within", ["orthogonal", "invertible"])
def test_refine_universe_keeps_the_reference_and_every_function(trained, within):
    cfg, arch = trained.cfg, trained.arch
    third = canonicalize(arch, random_native(cfg, 3), cfg)
    states, natives = [*trained.states, third], [*trained.natives, random_native(cfg, 3)]
    options = replace(FAST, within=within)
    transforms = refine_universe(states, cfg, trained.data, weights=[3, 2, 1], options=options)
    assert transforms[0].residual is None and all(h is None for h in transforms[0].heads)
    assert transforms[1].residual is not None  # learned, not left at the identity
    for state, native, t in zip(states, natives, transforms, strict=True):
        assert _gap(apply(state, arch.spec, t, cfg.heads), native, cfg) <= 1e-5
    for bad in ([1, 1], [1, float("nan"), 1], [1, float("inf"), 1]):  # NaN and inf once passed `min(w) <= 0`
        with pytest.raises(ConfigError, match="positive weight"):
            refine_universe(states, cfg, trained.data, weights=bad, options=options)


def test_refinement_weights_centre_on_the_weighted_mean_by_default():
    weights = [0.5, 0.3, 0.2]
    for concentration, spread in ((LearnConfig().concentration, (0.0, 0.3)), (0.1, (0.8, 2.0))):
        sampler = mixing_sampler(weights, LearnConfig(concentration=concentration))
        draws = np.array([sampler() for _ in range(4000)])
        assert np.allclose(draws.sum(1), 1.0) and np.allclose(draws.mean(0), weights, atol=0.02)
        deviation = float(np.abs(draws - weights).sum(1).mean())  # L1 distance from the mean, per draw
        assert spread[0] <= deviation <= spread[1], (concentration, deviation)


def test_learned_flags_reach_learn_config_in_every_command():
    parser = build_parser()
    flags = ["--lr", "0.01", "--batch-size", "32", "--steps", "7", "--lam", "0.1", "0.9", "--val-points", "5",
             "--within", "invertible", "--patience", "0", "--weight-decay", "0.01", "--dropout", "0.1", "--quiet",
             "--targets", "endpoints", "--val-max", "16"]
    commands = {"align": ["a", "b", "--out", "o"], "barrier": ["a", "b", "--json", "o"], "merge": ["a", "--out", "o"]}
    for command, rest in commands.items():
        learn = match_options(parser.parse_args([command, *rest, *flags])).learn
        assert (learn.lr, learn.batch_size, learn.steps, learn.lam, learn.val_points, learn.within, learn.patience,
                learn.weight_decay, learn.dropout, learn.progress, learn.targets, learn.val_max) == (
            0.01, 32, 7, (0.1, 0.9), 5, "invertible", 0, 0.01, 0.1, False, "endpoints", 16), command
    default = match_options(parser.parse_args(["align", "a", "b", "--out", "o"])).learn
    assert (default.epochs, default.lam, default.val_points, default.within, default.patience, default.targets) == (
        LearnConfig().epochs, LearnConfig().lam, 1, "orthogonal", LearnConfig().patience, None)  # None: by the data
    with pytest.raises(ConfigError, match="λ range"):
        match_options(parser.parse_args(["align", "a", "b", "--out", "o", "--lam", "0.9", "0.1"]))
    merged = match_options(parser.parse_args(["merge", "a", "--out", "o", "--concentration", "0.1"])).learn
    assert (merged.epochs, merged.concentration) == (1, 0.1)  # merge's own default of one pass


def test_pair_validation_points_span_the_training_range():
    assert pair_points(LearnConfig()) == [(0.5, 0.5)]  # the paper's midpoint, for the default λ ~ U(0.4, 0.6)
    assert pair_points(LearnConfig(lam=(0.2, 0.4))) == [pytest.approx((0.3, 0.7))]
    points = pair_points(LearnConfig(lam=(0.1, 0.9), val_points=5))
    assert [lam for lam, _ in points] == pytest.approx([0.1, 0.3, 0.5, 0.7, 0.9])
    assert all(lam + rest == pytest.approx(1.0) for lam, rest in points)
    with pytest.raises(ConfigError, match="val_points"):
        LearnConfig(val_points=0)
    cfg = CONFIGS["vit-odd"]
    _, _, (a, b) = _pair(cfg)
    options = replace(FAST, steps=2, lam=(0.1, 0.9), val_points=3)
    learned = learned_match(a, b, cfg, dataset(cfg, 32, seed=0), learning(options))
    assert learned.info["val_points"] == [list(w) for w in pair_points(options)]  # what early stopping watched


class _PoisonedAfter(Dataset):
    """A dataset whose inputs turn into NaN once ``clean`` samples have been served."""

    def __init__(self, base: TensorDataset, clean: int) -> None:
        self.base, self.clean, self.served = base, clean, 0

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        self.served += 1
        x, y = self.base[i]
        return (x * float("nan"), y) if self.served > self.clean else (x, y)


def test_nan_loss_stops_and_keeps_the_best_transform(caplog):
    cfg = CONFIGS["vit-odd"]
    _, _, (a, b) = _pair(cfg)
    data, validation = dataset(cfg, 48, seed=0), dataset(cfg, 16, seed=3)
    options = LearnConfig(steps=2, eval_every=1, batch_size=16, lr=0.05, dtype="float64")
    clean = learned_match(a, b, cfg, data, learning(options), validation=validation)
    with caplog.at_level(logging.WARNING, logger="glmc.match.learned"):
        poisoned = learned_match(a, b, cfg, _PoisonedAfter(data, 32), validation=validation,
                                 options=learning(replace(options, steps=5)))
    assert "non-finite loss or gradient at step 3" in caplog.text and "kept the best transform" in caplog.text
    assert poisoned.info["stopped"] == "non-finite loss or gradient at step 3"
    assert poisoned.info["best_step"] == clean.info["best_step"] > 0
    assert torch.equal(poisoned.transform.residual, clean.transform.residual)


def test_bad_input_gives_one_line_errors():
    cfg = CONFIGS["vit-odd"]
    native_a, native_b = random_native(cfg, 1), random_native(cfg, 2)
    with pytest.raises(ConfigError, match="needs data"):
        align_pair(native_a, native_b, cfg, "learned")
    wrong = TensorDataset(torch.randn(20, 1, cfg.img_size + 4, cfg.img_size + 4, dtype=torch.float64),
                          torch.zeros(20, dtype=torch.long))
    with pytest.raises(ConfigError, match="does not fit"):
        align_pair(native_a, native_b, cfg, "dual", learning(FAST), data=wrong)
    with pytest.raises(ConfigError, match="at least 2"):
        align_pair(native_a, native_b, cfg, "learned", learning(FAST), data=dataset(cfg, 1))
    with pytest.raises(ConfigError, match="λ range"):
        LearnConfig(lam=(0.7, 0.3))
    with pytest.raises(ConfigError, match="unknown learned-matching within 'unitary'"):
        LearnConfig(within="unitary")  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.skipif(find_fashion_mnist() is None, reason="Fashion-MNIST not installed (make setup installs it)")
def test_cli_align_learned_writes_a_checkpoint_computing_b(tmp_path, capsys):
    ckpts = [tmp_path / f"seed{s}.safetensors" for s in (0, 1)]
    for seed, out in enumerate(ckpts):
        argv = ["train", "--model", "vit-tiny", "--dataset", "fashion-mnist", "--seed", str(seed), "--max-steps", "3"]
        assert main([*argv, "--batch-size", "32", "--out", str(out), "--quiet", "--threads", "1"]) == 0
    out = tmp_path / "aligned.safetensors"
    pair = [str(c) for c in ckpts]
    assert main(["align", *pair, "--method", "learned", "--epochs", "0", "--out", str(out), "--quiet"]) == 2
    assert "epochs" in capsys.readouterr().err and not out.exists()
    argv = ["align", *pair, "--method", "learned", "--steps", "4", "--batch", "96", "--lr", "0.01"]
    weight_objectives = []
    for start in ("identity", "relaxed"):  # the learning starts from weight matching, from either residual start
        assert main([*argv, "--start", start, "--out", str(out), "--quiet", "--force"]) == 0
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert report["method"] == "learned" and report["stopped"] == "completed 4 steps"
        weight_objectives.append(report["weight_objective"])
        (b, _), (moved, meta) = load_model(ckpts[1]), load_model(out)
        x = inputs(meta.config)
        with torch.no_grad():
            assert (b.double()(x) - moved.double()(x)).abs().max() <= 1e-4  # saved as float32
    assert weight_objectives[0] != weight_objectives[1]  # the start reached weight matching


@pytest.mark.parametrize("group", ["whole", "orthogonal"])
def test_the_learned_start_carries_a_gated_mlps_unit_signs_as_flips_of_b(group: str) -> None:
    """Over the whole group the start finds a planted permutation with flipped gated units, and the learned methods
    (whose latents hold no signs) start from B with those flips applied: the carried transform lands B on A. Over the
    orthogonal part no sign is searched, and B is left as given."""
    cfg = RMS_CONFIGS["llama-gqa"]
    spec, a = get_arch(cfg.family).spec, canonical(cfg, 0)
    g = torch.Generator().manual_seed(1)
    planted = Transform(cfg.depth, mlp=[torch.randperm(cfg.mlp, generator=g) for _ in range(cfg.depth)],
                        mlp_scale=[torch.where(torch.rand(cfg.mlp, generator=g) < 0.5, -1.0, 1.0).double()
                                   for _ in range(cfg.depth)])
    b = apply(a, spec, planted, cfg.heads)
    start = learned_start(a, b, cfg, MatchOptions(symmetry=SymmetryOptions(group)))  # type: ignore[arg-type]
    assert all(s is None for s in start.match.transform.mlp_scale)
    landed = apply(b, spec, start.carried(start.match.transform), cfg.heads)
    gap = max(float((a[k] - landed[k]).abs().max()) for k in a)
    if group == "whole":
        assert gap < 1e-5  # the residual map, searched in float32, is the identity to its rounding
        assert max(float((a[k] - apply(start.b, spec, start.match.transform, cfg.heads)[k]).abs().max())
                   for k in a) < 1e-5
    else:
        assert start.flips is None and start.b is b and gap > 1e-2
