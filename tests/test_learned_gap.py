"""The learned-gap bench's crossings of two matchings are symmetries, and its angles and unit counts are right."""

from __future__ import annotations

import pytest
import torch

from glmc.archs import get_arch
from glmc.symmetry.transforms import MATCHABLE, Transform, apply, random_transform
from simulations.analyses.learned_gap import (
    angles,
    changed_units,
    correction_planes,
    crossed,
    in_planes,
    learn_flags,
    stream_moment,
    variance_share,
)
from tests.symmetry_models import CONFIGS, canonical, dataset, inputs, logits_of, planted


@pytest.mark.parametrize("name", ["vit-odd", "gpt2-odd"])
def test_every_crossing_of_two_transforms_computes_the_same_function(name: str) -> None:
    cfg = CONFIGS[name]
    arch = get_arch(cfg.family)
    state = canonical(cfg, 3)
    g = torch.Generator().manual_seed(3)
    weight = random_transform(cfg, MATCHABLE, g)  # orthogonal within-head maps, as weight matching's
    learned = random_transform(cfg, (*MATCHABLE, "within-head-invertible"), g)  # learned --within invertible
    x = inputs(cfg, 4, 3)
    expected = logits_of(arch.to_native(state, cfg), cfg, x)
    for label, t in crossed(weight, learned).items():
        moved = apply(state, arch.spec, t, cfg.heads)
        assert any(not torch.allclose(moved[k], state[k]) for k in state), label  # the weights did move
        got = logits_of(arch.to_native(moved, cfg), cfg, x)
        assert (got - expected).abs().max().item() <= 1e-5, label


def test_the_crossings_swap_only_the_residual_map() -> None:
    g = torch.Generator().manual_seed(0)
    cfg = CONFIGS["gpt2-odd"]
    weight, learned = (random_transform(cfg, MATCHABLE, g) for _ in range(2))
    mixed = crossed(weight, learned)
    assert mixed["weight, learned Q"].residual is learned.residual and mixed["weight, learned Q"].mlp is weight.mlp
    assert mixed["learned, weight Q"].residual is weight.residual and mixed["learned, weight Q"].qk is learned.qk


def test_the_angles_of_a_rotation_are_the_angles_it_turns_its_planes_by() -> None:
    turns = [10.0, 45.0, 170.0]
    rotation, _ = planted(turns, 7, 1)
    assert sorted(angles(rotation).tolist()) == pytest.approx(sorted([0.0, *turns, *turns]), abs=1e-6)


def test_the_correction_applied_in_its_top_planes_turns_only_those() -> None:
    q_w, _ = planted([30.0, 80.0], 8, 2)  # any orthogonal Q_w: the correction is Q_wᵀ Q_l
    r, basis = planted([10.0, 45.0, 170.0], 8, 3)
    q_l = q_w @ r
    _, planes, turns = correction_planes(q_w, q_l)
    assert turns[:3] == pytest.approx([170.0, 45.0, 10.0], abs=1e-6) and max(turns[3:]) == pytest.approx(0, abs=1e-6)
    assert all(len(plane) == 2 for plane in planes[:3])
    top, span = in_planes(q_w, q_l, 1)
    assert sorted(angles(q_w.T @ top).tolist())[-2:] == pytest.approx([170.0, 170.0], abs=1e-6)
    plane = q_w @ basis[:, 4:6]  # the 170° plane, in A's coordinates
    assert torch.allclose(span @ span.T, plane @ plane.T, atol=1e-9)
    assert torch.allclose(in_planes(q_w, q_l, len(planes))[0], q_l, atol=1e-12)


def test_the_stream_variance_share_of_a_subspace() -> None:
    moment = torch.diag(torch.tensor([5.0, 1.0, 1.0, 1.0], dtype=torch.float64))
    assert variance_share(moment, torch.eye(4, dtype=torch.float64)[:, :1]) == pytest.approx(2.5)
    assert variance_share(moment, torch.eye(4, dtype=torch.float64)) == pytest.approx(1.0)


@pytest.mark.parametrize("name", ["vit-odd", "gpt2-odd"])
def test_the_stream_moment_is_of_the_normalised_stream(name: str) -> None:
    cfg = CONFIGS[name]
    moment = stream_moment(canonical(cfg, 1), cfg, dataset(cfg, 4))
    assert torch.allclose(moment, moment.T)
    assert torch.trace(moment).item() == pytest.approx(cfg.width, rel=1e-3)  # each token's ‖x̂‖² = d: a LayerNorm's


def test_changed_units_counts_the_heads_and_units_assigned_elsewhere() -> None:
    weight = Transform(2, heads=[torch.tensor([0, 1, 2]), torch.tensor([2, 0, 1])],
                       mlp=[torch.tensor([0, 1, 2, 3]), None])
    learned = Transform(2, heads=[torch.tensor([1, 0, 2]), torch.tensor([2, 0, 1])],
                        mlp=[torch.tensor([0, 1, 3, 2]), None])
    assert changed_units(weight, learned) == (4, 10)


def test_learning_flags_read_as_glmc_barrier_reads_them() -> None:
    options, batch = learn_flags(["--batch", "20000", "--epochs", "1", "--within", "invertible", "--lr", "6e-3"])
    learn = options.learn
    assert (batch, learn.epochs, learn.within, learn.lr, learn.progress) == (20000, 1, "invertible", 6e-3, False)
    defaults, none = learn_flags([])
    assert none is None and defaults.learn.epochs == 2
