"""Invariants of the symmetry core over every registered family: exact transforms, folding, group algebra."""

from __future__ import annotations

import pytest
import torch

from glmc.archs import ARCHS, get_arch
from glmc.cli.pair import FORM_NAMES
from glmc.core.spec import check_coverage, check_same_shapes, expand
from glmc.errors import NonFiniteError, SpecError
from glmc.symmetry.canonical import FORMS, canonicalize, forms_for, residual_group, to_circuit, to_model
from glmc.symmetry.exactness import invariance_errors
from glmc.symmetry.transforms import SYMMETRY_CLASSES, Transform, apply, compose, invert, random_transform
from tests.symmetry_models import ALL_CONFIGS, CONFIGS, inputs, logits_of, random_native

TOL = 1e-5  # the project's bar for "same function", in float64; we observe ~1e-15


def _classes(cfg):
    """MLP scales hold for ReLU and for SwiGLU's linear ``up`` only."""
    return tuple(c for c in SYMMETRY_CLASSES if c != "mlp-scale" or cfg.activation in ("relu", "silu"))


def _cases(forms=("standard", "rmsnorm")):
    """(config name, form) for every config and each of ``forms`` that its family has."""
    return [(name, form) for name, cfg in ALL_CONFIGS.items() for form in forms
            if form in forms_for(get_arch(cfg.family))]


def _random(cfg, classes, seed, fix_ones=True):
    g = torch.Generator().manual_seed(seed)
    return random_transform(cfg, classes, g, fix_ones)


def _run(state, cfg, form, x):
    with torch.no_grad():
        return get_arch(cfg.family).logits(to_model(state, cfg, form), x)


def test_the_cli_offers_every_form_the_library_has():
    assert list(FORMS) == FORM_NAMES  # the CLI lists them without importing torch, so they are written twice


@pytest.mark.parametrize(("name", "form"), _cases())
def test_canonical_form_preserves_function(name, form):
    cfg = ALL_CONFIGS[name]
    native, x = random_native(cfg, 0), inputs(cfg)
    state = canonicalize(get_arch(cfg.family), native, cfg, form)
    err = (_run(state, cfg, form, x) - logits_of(native, cfg, x)).abs().max()
    assert err <= TOL


@pytest.mark.parametrize(("name", "form"), _cases())
def test_every_symmetry_class_preserves_function(name, form):
    cfg = ALL_CONFIGS[name]
    arch = get_arch(cfg.family)
    native, x = random_native(cfg, 1), inputs(cfg)
    state = canonicalize(arch, native, cfg, form)
    reference = logits_of(native, cfg, x)
    classes = _classes(cfg)
    for i, cls in enumerate([*((c,) for c in classes), classes]):
        t = _random(cfg, cls, seed=10 + i, fix_ones=residual_group(form, arch))
        moved = apply(state, arch.spec, t, cfg.heads)
        assert max((moved[k] - state[k]).abs().max() for k in state) > 1e-3, f"{cls} did not move anything"
        assert (_run(moved, cfg, form, x) - reference).abs().max() <= TOL, cls


@pytest.mark.parametrize("name", ["vit-odd", "gpt2-odd"])
def test_general_orthogonal_breaks_layernorm_models(name):
    """Only Q with Q·1 = 1 commutes with LayerNorm's centring; a general Q must change the function."""
    cfg = CONFIGS[name]
    arch = get_arch(cfg.family)
    native, x = random_native(cfg, 2), inputs(cfg)
    state = canonicalize(arch, native, cfg)
    general = apply(state, arch.spec, _random(cfg, ("residual",), 3, fix_ones=False), cfg.heads)
    assert (_run(general, cfg, "standard", x) - logits_of(native, cfg, x)).abs().max() > 1e-3


def test_rotating_an_unfolded_model_is_refused():
    cfg = CONFIGS["vit-odd"]
    arch = get_arch(cfg.family)
    raw = arch.to_canonical(random_native(cfg, 3), cfg)
    with pytest.raises(SpecError, match="not folded"):
        apply(raw, arch.spec, _random(cfg, ("residual",), 4), cfg.heads)


@pytest.mark.parametrize("name", ["vit-odd", "gpt2-odd"])
def test_a_layer_mixing_orthogonal_and_invertible_head_maps_keeps_the_function(name):
    """Each head's M⁻ᵀ is chosen on its own (M itself when orthogonal, the inverse otherwise): a layer whose heads
    carry both kinds still computes the same function."""
    cfg = CONFIGS[name]
    arch = get_arch(cfg.family)
    native, x = random_native(cfg, 5), inputs(cfg)
    state = canonicalize(arch, native, cfg)
    t = _random(cfg, ("within-head-invertible",), 6)
    orthogonal = _random(cfg, ("within-head-orthogonal",), 7)
    for maps, rotations in ((t.qk, orthogonal.qk), (t.ov, orthogonal.ov)):
        for layer, rotation in zip(maps, rotations, strict=True):
            layer[0] = rotation[0]  # head 0 orthogonal, the others invertible
    moved = apply(state, arch.spec, t, cfg.heads)
    assert (_run(moved, cfg, "standard", x) - logits_of(native, cfg, x)).abs().max() <= TOL


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_compose_and_invert(name):
    cfg = ALL_CONFIGS[name]
    arch = get_arch(cfg.family)
    state = canonicalize(arch, random_native(cfg, 4), cfg)
    t1, t2 = _random(cfg, _classes(cfg), 5), _random(cfg, _classes(cfg), 6)
    twice = apply(apply(state, arch.spec, t1, cfg.heads), arch.spec, t2, cfg.heads)
    once = apply(state, arch.spec, compose(t2, t1), cfg.heads)
    back = apply(apply(state, arch.spec, t1, cfg.heads), arch.spec, invert(t1), cfg.heads)
    for k in state:
        torch.testing.assert_close(twice[k], once[k], rtol=0, atol=1e-10)
        torch.testing.assert_close(back[k], state[k], rtol=0, atol=1e-10)
    identity = apply(state, arch.spec, Transform.identity(cfg.depth), cfg.heads)
    assert all(torch.equal(identity[k], state[k]) for k in state)


@pytest.mark.parametrize("family", ARCHS)
def test_spec_covers_every_parameter_exactly_once(family):
    cfg = next(c for c in ALL_CONFIGS.values() if c.family == family)
    arch = get_arch(family)
    state = arch.to_canonical(random_native(cfg, 5), cfg)
    check_coverage(arch.spec, state, cfg.depth, arch.optional)
    present = {name for name, (_, template) in expand(arch.spec, cfg.depth).items() if template not in arch.optional}
    assert present <= set(state) <= set(expand(arch.spec, cfg.depth))
    with pytest.raises(SpecError, match=r"'blocks\.0\.extra\.w'"):
        check_coverage(arch.spec, {**state, "blocks.0.extra.w": torch.zeros(1)}, cfg.depth, arch.optional)
    missing = dict(state)
    missing.pop("blocks.1.mlp.fc2.w")
    with pytest.raises(SpecError, match=r"'blocks\.1\.mlp\.fc2\.w'"):
        check_coverage(arch.spec, missing, cfg.depth, arch.optional)


def test_shape_mismatch_names_the_first_offending_key():
    a = random_native(CONFIGS["vit-odd"], 0)
    b = random_native(CONFIGS["vit-odd"].replace(mlp=71), 0)
    with pytest.raises(SpecError, match=r"mlp\.fc1\.weight"):
        check_same_shapes(a, b)


@pytest.mark.parametrize(("name", "form"), _cases(("standard", "rmsnorm", "circuit")))
def test_self_check_passes_in_every_form(name, form):
    errors = invariance_errors(ALL_CONFIGS[name], form, seed=3)
    assert set(errors) >= {"canonical-form", "residual", "head-perm", "mlp-perm", "all"}
    assert max(errors.values()) <= TOL, errors


@pytest.mark.parametrize("name", ["vit-odd", "gpt2-odd"])
def test_circuit_form_absorbs_within_head_maps(name):
    """QK and OV circuits are invariant under within-head invertible maps (paper §3.2.2)."""
    cfg = CONFIGS[name]
    arch = get_arch(cfg.family)
    state = canonicalize(arch, random_native(cfg, 6), cfg)
    circuit, circuit_cfg = to_circuit(state, cfg)
    assert circuit_cfg.head_dim == cfg.width + 1
    moved = apply(state, arch.spec, _random(cfg, ("within-head-invertible",), 7), cfg.heads)
    moved_circuit, _ = to_circuit(moved, cfg)
    for k in circuit:
        torch.testing.assert_close(moved_circuit[k], circuit[k], rtol=0, atol=1e-10)


def test_a_zero_layernorm_gain_before_a_bias_free_reader_is_refused_or_folded_exactly():
    """GPT-2's ln_f feeds lm_head, which has no bias: where γ = 0 a nonzero β is a constant no folded form can
    hold (it used to become inf / NaN by β/γ), so it is refused in one line; where β is 0 too it is folded exactly."""
    cfg = CONFIGS["gpt2-odd"]
    arch, x = get_arch(cfg.family), inputs(cfg, 3)
    native = {k: v.double() for k, v in random_native(cfg, 0).items()}
    native["transformer.ln_f.weight"][[0, 7]] = 0.0
    native["transformer.ln_f.bias"][[0, 7]] = 0.0
    folded = canonicalize(arch, native, cfg)
    assert all(bool(torch.isfinite(v).all()) for v in folded.values())
    back = arch.to_native(folded, cfg)
    assert (logits_of(back, cfg, x) - logits_of(native, cfg, x)).abs().max() <= 1e-5
    native["transformer.ln_f.bias"][7] = 0.5
    with pytest.raises(NonFiniteError, match=r"^norm: 2 LayerNorm gain\(s\) are exactly 0") as err:
        canonicalize(arch, native, cfg)
    assert "\n" not in str(err.value)
