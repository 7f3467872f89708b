"""Refitting a merge layer by layer: every refitted layer is the least-squares fit, on the merged model's own inputs,
of the inputs' weighted mean output (across widths, of the models that hold each output); identical inputs give back
their function; bad data is refused in one line."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from glmc.archs import get_arch
from glmc.core.config import ModelConfig, scale_width
from glmc.core.state import mix
from glmc.errors import ConfigError
from glmc.merging.activations import hooked_passes
from glmc.merging.refit import RIDGE, layer_rows, mean_outputs, refit, stages
from glmc.merging.widths import axis_mask, embed, embedding_config, lstsq_merge, place
from glmc.symmetry.canonical import to_model
from tests.symmetry_models import MERGE_CONFIGS, canonical, merge_data


def _inputs_at(state: dict[str, torch.Tensor], cfg: ModelConfig, site: tuple[str, int | None],
               x: torch.Tensor) -> torch.Tensor:
    """The layer's inputs at ``site`` in ``state``'s model, every token a row, with a ones column."""
    got = []
    hooked_passes(cfg, to_model(state, cfg), {site: lambda m, args, out: got.append(args[0])}, [x])
    rows = got[0].reshape(-1, got[0].shape[-1]).double()
    return torch.cat([rows, rows.new_ones(len(rows), 1)], 1)


@pytest.mark.parametrize("ridge", [0.0, RIDGE])
@pytest.mark.parametrize("family", sorted(MERGE_CONFIGS))
def test_every_refitted_layer_is_the_least_squares_fit_on_its_own_inputs(family, ridge):
    """Each layer's gradient of ‖X Rᵀ − Ȳ‖² + ρ Σ_j ‖X_j‖² ‖R_j − R⁰_j‖² vanishes, with X the merged model's own
    inputs there, Ȳ the inputs' weighted mean output and R⁰ the merge's rows (the normal equations), in forward
    order: a fit on each input model's own inputs (RegMean) would not satisfy them."""
    cfg = MERGE_CONFIGS[family]
    inputs, weights = [canonical(cfg, 0), canonical(cfg, 1)], [3.0, 1.0]
    data = merge_data(cfg)
    merged = mix(inputs, [0.75, 0.25])
    fitted = refit(merged, inputs, cfg, data, weights=weights, ridge=ridge)
    models, x = [to_model(s, cfg) for s in inputs], data.tensors[0]
    for stage in stages(cfg):
        targets = mean_outputs(models, weights, cfg, x, stage)
        for site in stage:
            name = site[0].format(l=site[1])
            own = _inputs_at(fitted, cfg, site, x)
            own = own if f"{name}.b" in fitted else own[:, :-1]
            rows, start = layer_rows(fitted, name), layer_rows(merged, name)
            energy = ridge * (own * own).sum(0)
            gradient = own.T @ (own @ rows.T - targets[site]) + energy[:, None] * (rows - start).T
            assert gradient.abs().max() <= 1e-7 * (own.T @ targets[site]).abs().max(), site
            assert not torch.allclose(rows, start), site  # the layer did change


@pytest.mark.parametrize("family", sorted(MERGE_CONFIGS))
def test_a_refit_of_identical_models_computes_their_function(family):
    cfg = MERGE_CONFIGS[family]
    state = canonical(cfg, 0)
    data = merge_data(cfg)
    fitted = refit(mix([state, state], [0.5, 0.5]), [state, state], cfg, data)
    arch, x = get_arch(cfg.family), data.tensors[0]
    x = x.double() if x.is_floating_point() else x
    with torch.no_grad():
        want, got = (arch.logits(to_model(s, cfg), x) for s in (state, fitted))
    assert (want - got).abs().max() <= 1e-8


def test_no_inputs_or_inputs_of_the_wrong_shape_are_refused_in_one_line():
    cfg = MERGE_CONFIGS["vit"]
    state = canonical(cfg, 0)
    for empty in (None, TensorDataset(torch.zeros(0, 1, 8, 8), torch.zeros(0))):
        with pytest.raises(ConfigError, match="needs training inputs"):
            refit(state, [state], cfg, empty)
    with pytest.raises(ConfigError, match="does not fit the vit model"):
        refit(state, [state], cfg, TensorDataset(torch.zeros(4, 3, 32, 32), torch.zeros(4)))
    for ridge in (-1.0, float("nan")):
        with pytest.raises(ConfigError, match="ridge must be ≥ 0"):
            refit(state, [state], cfg, merge_data(cfg), ridge=ridge)


def test_across_widths_each_output_is_fitted_to_the_mean_of_the_models_that_hold_it():
    """A narrow model embedded in the universe counts for a unit only if it holds it, and for a residual output
    y only on its subspace: the target is (Σ n_i y_i P_i)(Σ n_i P_i)⁻¹, written out here by hand per axis kind."""
    wide = MERGE_CONFIGS["vit"]
    narrow = scale_width(wide, 0.5)
    spots = [place(wide, wide), place(narrow, wide)]
    inputs, n = [canonical(wide, 0), embed(canonical(narrow, 1), spots[1])], [3.0, 1.0]
    data = merge_data(wide)
    merged = lstsq_merge(inputs, spots, n)
    fitted = refit(merged, inputs, wide, data, weights=n, placements=spots, ridge=0.0)
    x, arch = data.tensors[0], get_arch(wide.family)
    models = [to_model(inputs[0], wide), to_model(inputs[1], embedding_config(spots[1]))]
    projector = spots[1].projector()
    for stage in stages(wide):
        for site in stage:
            ya, yb = (mean_outputs([m], [1.0], wide, x, [site])[site] for m in models)
            kind = arch.spec[f"{site[0]}.w"][0]
            if kind == "RES":
                target = (3 * ya + yb @ projector) @ torch.linalg.inv(3 * torch.eye(len(projector)) + projector)
            else:
                held = axis_mask(kind, spots[1], site[1]) if kind is not None else torch.ones(ya.shape[1])
                target = (3 * ya + yb * held) / (3 + held)
            own = _inputs_at(fitted, wide, site, x)
            gradient = own.T @ (own @ layer_rows(fitted, site[0].format(l=site[1])).T - target)
            assert gradient.abs().max() <= 1e-7 * (own.T @ target).abs().max(), site
