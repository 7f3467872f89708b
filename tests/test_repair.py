"""REPAIR after a merge: every repaired channel ends with its inputs' weighted mean statistics, channels an input
does not hold are left out of that mean, a merge of identical models is left as it is, and bad data is refused;
along a path, every point is REPAIRed and both ends stay the models themselves."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from glmc.archs import get_arch
from glmc.core.config import ModelConfig, scale_width
from glmc.core.state import mix
from glmc.errors import ConfigError
from glmc.merging.interpolation import barrier_curve
from glmc.merging.repair import channel_stats, repair, sites
from glmc.merging.widths import embed, place
from glmc.symmetry.canonical import to_model
from glmc.train import evaluate
from tests.symmetry_models import MERGE_CONFIGS, canonical, merge_data

SITES_OF = {family: sites(cfg) for family, cfg in MERGE_CONFIGS.items()}


def _stats(state: dict[str, torch.Tensor], cfg: ModelConfig, sites: list[tuple[str, int]]) -> dict:
    return channel_stats(to_model(state, cfg), cfg, merge_data(cfg).tensors[0], sites, 16)


@pytest.mark.parametrize("family", sorted(MERGE_CONFIGS))
def test_every_channel_ends_with_the_weighted_mean_statistics_of_the_inputs(family):
    cfg = MERGE_CONFIGS[family]
    inputs = [canonical(cfg, 0), canonical(cfg, 1)]
    merged = mix(inputs, [0.75, 0.25])
    repaired = repair(merged, inputs, cfg, merge_data(cfg), weights=[3.0, 1.0])
    before, after = (_stats(s, cfg, SITES_OF[family]) for s in (merged, repaired))
    a, b = (_stats(s, cfg, SITES_OF[family]) for s in inputs)
    for site in SITES_OF[family]:
        for i, what in enumerate(("mean", "std")):
            want = 0.75 * a[site][i] + 0.25 * b[site][i]
            assert torch.allclose(after[site][i], want, rtol=1e-6, atol=1e-9), (site, what)
        assert (before[site][1] < after[site][1]).float().mean() > 0.5, site  # averaging shrank most channels


def test_a_channel_an_input_does_not_hold_takes_the_other_inputs_statistics():
    wide = MERGE_CONFIGS["vit"]
    narrow = scale_width(wide, 0.5)
    a, b = canonical(wide, 0), embed(canonical(narrow, 1), place(narrow, wide))
    repaired = repair(mix([a, b], [0.5, 0.5]), [a, b], wide, merge_data(wide))
    site = [("blocks.{l}.mlp.fc1", 0)]
    (own_mean, own_std), (_, dead_std) = (_stats(s, wide, site)[site[0]] for s in (a, b))
    mean, std = _stats(repaired, wide, site)[site[0]]
    dead = dead_std == 0
    assert dead.any() and torch.allclose(std[dead], own_std[dead], rtol=1e-6)
    assert torch.allclose(mean[dead], own_mean[dead], rtol=1e-6, atol=1e-9)


def test_a_merge_of_identical_models_is_left_as_it_is():
    cfg = MERGE_CONFIGS["gpt2"]
    state = canonical(cfg, 0)
    repaired = repair(mix([state, state], [0.5, 0.5]), [state, state], cfg, merge_data(cfg))
    assert all(torch.allclose(repaired[k], state[k], rtol=1e-9, atol=1e-9) for k in state)


def test_no_inputs_or_inputs_of_the_wrong_shape_are_refused_in_one_line():
    cfg = MERGE_CONFIGS["vit"]
    state = canonical(cfg, 0)
    for empty in (None, TensorDataset(torch.zeros(0, 1, 8, 8), torch.zeros(0))):
        with pytest.raises(ConfigError, match="needs training inputs"):
            repair(state, [state], cfg, empty)
    with pytest.raises(ConfigError, match="does not fit the vit model"):
        repair(state, [state], cfg, TensorDataset(torch.zeros(4, 3, 32, 32), torch.zeros(4)))


@pytest.mark.parametrize("family", sorted(MERGE_CONFIGS))
def test_statistics_stop_the_forward_pass_at_the_last_site_and_match_a_full_pass(family):
    """Measuring the first block's sites runs no later block, and gives what a pass through every site gives."""
    cfg = MERGE_CONFIGS[family]
    state = canonical(cfg, 0)
    model = to_model(state, cfg)
    later = []
    get_arch(cfg.family).module(model, "blocks.{l}", cfg.depth - 1).register_forward_hook(
        lambda *_: later.append(1))
    first = [(s, layer) for s, layer in SITES_OF[family] if layer == 0]
    early = channel_stats(model, cfg, merge_data(cfg).tensors[0], first, 16)
    assert not later
    full = _stats(state, cfg, SITES_OF[family])
    for site in first:
        assert all(torch.equal(x, y) for x, y in zip(early[site], full[site], strict=True)), site


@pytest.mark.parametrize("family", sorted(MERGE_CONFIGS))
def test_a_repaired_path_keeps_both_ends_and_repairs_every_point_on_it(family):
    """With repair_data, θ(λ) is REPAIRed to the λ-mean statistics before it is evaluated: both ends keep the models'
    own losses (so the barrier keeps its definition), and each point is what repair() of that mixture gives."""
    cfg = MERGE_CONFIGS[family]
    a, b = canonical(cfg, 0), canonical(cfg, 1)
    data = merge_data(cfg)
    plain, repaired = (barrier_curve(a, b, cfg, data, points=5, repair_data=r) for r in (None, data))
    for end in (0, -1):
        assert repaired.losses[end] == pytest.approx(plain.losses[end], rel=1e-9), end
    for lam, loss in zip(repaired.lambdas, repaired.losses, strict=True):
        state = repair(mix([a, b], [lam, 1 - lam]), [a, b], cfg, data, weights=[lam, 1 - lam])
        assert loss == pytest.approx(evaluate(to_model(state, cfg), get_arch(cfg.family), data)["loss"], rel=1e-9)
    assert repaired.losses[2] != pytest.approx(plain.losses[2], rel=1e-3)  # the midpoint did change


def test_a_repaired_path_needs_the_standard_form():
    cfg = MERGE_CONFIGS["vit"]
    state = canonical(cfg, 0)
    with pytest.raises(ConfigError, match="REPAIR needs the standard form"):
        barrier_curve(state, state, cfg, merge_data(cfg), points=3, form="circuit", repair_data=merge_data(cfg))
