"""Width embeddings are exact, projection inverts them, and the least-squares merge reduces to its special cases."""

from __future__ import annotations

import contextlib

import pytest
import torch

from glmc.archs import get_arch
from glmc.core.config import PRESETS, ModelConfig, preset, scale_width
from glmc.core.spec import HEADS, MLP, MLP_IN, QKV, RES, expand
from glmc.errors import ConfigError
from glmc.merging.widths import (
    Placement,
    embed,
    embedding_config,
    lstsq_merge,
    move,
    place,
    principal_place,
    project,
    widen,
)
from glmc.symmetry.canonical import canonicalize, to_model
from tests.symmetry_models import VOCAB, inputs, logits_of, random_native

TIERS = (2.0, 1.0, 0.5, 0.25)
BASES = {
    "vit": preset("vit-bench").replace(depth=2, img_size=8, patch=4, num_classes=5),
    "gpt2": preset("gpt2-bench").replace(depth=2, vocab_size=VOCAB, context=6),
}
# Odd sizes, and a head size that differs between the two models (zero rows plus the q scale).
ODD = {
    "vit": (BASES["vit"].replace(width=15, heads=3, head_dim=5, mlp=19, activation="relu"),
            BASES["vit"].replace(width=45, heads=5, head_dim=7, mlp=70, activation="relu")),
    "gpt2": (BASES["gpt2"].replace(width=15, heads=3, head_dim=5, mlp=19),
             BASES["gpt2"].replace(width=45, heads=5, head_dim=7, mlp=70)),
}


def _placed(small: ModelConfig, big: ModelConfig) -> tuple[ModelConfig, ModelConfig]:
    """(small, big), or the ConfigError of a pair that cannot share a universe."""
    place(small, big)
    return small, big


def _tier_pairs() -> list[tuple[str, ModelConfig, ModelConfig]]:
    """(narrow, wide) for every preset (one block, tiny inputs) and every pair of its valid width tiers."""
    pairs = []
    for name, cfg in PRESETS.items():
        small_inputs = {"img_size": 8, "patch": 4} if cfg.family == "vit" else {"vocab_size": VOCAB, "context": 6}
        base = cfg.replace(depth=1, **small_inputs)
        tiers = {}
        for mult in TIERS:
            with contextlib.suppress(ConfigError):  # e.g. 0.25 of 2 heads is no tier
                tiers[mult] = scale_width(base, mult)
        for a, b in ((a, b) for a in tiers for b in tiers if a <= b):
            with contextlib.suppress(ConfigError):  # e.g. a post-LayerNorm GELU model keeps its width
                pairs.append((f"{name}-{a}-in-{b}", *_placed(tiers[a], tiers[b])))
    return pairs


PAIRS = _tier_pairs() + [(f"{fam}-odd", *ODD[fam]) for fam in ODD]


def _canonical(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    return canonicalize(get_arch(cfg.family), random_native(cfg, seed), cfg)


@pytest.mark.parametrize(("name", "small", "big"), PAIRS, ids=[p[0] for p in PAIRS])
def test_embedding_computes_the_same_function(name, small, big):
    native, x = random_native(small, 3), inputs(small, n=3)
    p = place(small, big)
    wide = embed(canonicalize(get_arch(small.family), native, small), p)
    with torch.no_grad():
        out = get_arch(big.family).logits(to_model(wide, embedding_config(p)), x)
    assert (out - logits_of(native, small, x)).abs().max() <= 1e-5
    assert all(wide[k].shape == v.shape for k, v in _canonical(big, 0).items())


@pytest.mark.parametrize(("name", "small", "big"), PAIRS, ids=[p[0] for p in PAIRS])
def test_widening_then_embedding_computes_the_same_function(name, small, big):
    """Net2Net copies fill every head and unit of the wide model (the counts need not divide) and change nothing."""
    native, x = random_native(small, 3), inputs(small, n=3)
    state, cfg = widen(canonicalize(get_arch(small.family), native, small), small, big)
    assert (cfg.heads, cfg.mlp, cfg.width, cfg.head_dim) == (big.heads, big.mlp, small.width, small.head_dim)
    p = place(cfg, big)
    with torch.no_grad():
        out = get_arch(big.family).logits(to_model(embed(state, p), embedding_config(p)), x)
    assert (out - logits_of(native, small, x)).abs().max() <= 1e-5
    if big.mlp > small.mlp:  # no dead neuron is left
        assert bool((state["blocks.0.mlp.fc1.w"].abs().sum(1) > 0).all())


@pytest.mark.parametrize("family", ["vit", "gpt2"])
def test_projection_inverts_the_embedding(family):
    small, big = ODD[family]
    state, p = _canonical(small, 4), place(small, big)
    back = project(embed(state, p), p)
    assert max(float((back[k] - v).abs().max()) for k, v in state.items()) < 1e-12


def test_embedding_matrix_keeps_the_ones_direction():
    p = place(ODD["vit"][0], ODD["vit"][1])
    e, (big, d) = p.residual, p.residual.shape
    assert torch.allclose(e.T @ e, torch.eye(d, dtype=e.dtype), atol=1e-12)
    assert torch.allclose(e @ torch.ones(d, dtype=e.dtype) / d**0.5, torch.ones(big, dtype=e.dtype) / big**0.5)


def test_least_squares_at_equal_widths_is_the_weighted_mean():
    cfg = ODD["gpt2"][1]
    states, weights = [_canonical(cfg, s) for s in range(3)], [5.0, 1.0, 2.0]
    merged = lstsq_merge(states, [place(cfg, cfg)] * 3, weights)
    for k in merged:
        mean = sum(w * s[k] for w, s in zip(weights, states, strict=True)) / sum(weights)
        assert torch.allclose(merged[k], mean, atol=1e-12, rtol=0), k


def _coordinate_placement(narrow: ModelConfig, wide: ModelConfig) -> Placement:
    """HeteroFL's sub-model: the first d residual coordinates, first H heads, first f units (no rotation)."""
    p = place(narrow, wide)
    return Placement(narrow, wide, torch.eye(wide.width, dtype=torch.float64)[:, : narrow.width], p.heads,
                     p.head_dim, p.mlp)


def _heterofl_mask(shape, axes, narrow: ModelConfig, wide: ModelConfig) -> torch.Tensor:
    """By hand: 1 on the entries HeteroFL's slicing gives the narrow client, per axis kind."""
    mask = torch.ones(shape, dtype=torch.float64)
    for axis, kind in enumerate(axes):
        keep = torch.zeros(shape[axis], dtype=torch.float64)
        if kind == RES:
            keep[: narrow.width] = 1
        elif kind in (QKV, HEADS):
            keep.view(-1, wide.heads, wide.head_dim)[:, : narrow.heads, : narrow.head_dim] = 1
        elif kind in (MLP, MLP_IN):
            keep[: narrow.mlp] = 1
        else:
            keep[:] = 1
        mask = mask * keep.reshape([-1 if i == axis else 1 for i in range(len(shape))])
    return mask


def test_least_squares_with_coordinate_masks_is_heterofl():
    wide = BASES["vit"].replace(width=12, heads=3, head_dim=4, mlp=10)
    tiers = [wide, wide.replace(width=8, heads=2, mlp=6, head_dim=4), wide.replace(width=4, heads=1, mlp=3,
                                                                                  head_dim=4)]
    states, weights = [_canonical(wide, s) for s in range(3)], [3.0, 2.0, 7.0]
    merged = lstsq_merge(states, [_coordinate_placement(t, wide) for t in tiers], weights)
    spec = get_arch(wide.family).spec
    for k, (_, template) in expand(spec, wide.depth).items():
        if k not in merged:  # a parameter of a variant these models are not (register tokens, LayerScale)
            continue
        masks = [_heterofl_mask(merged[k].shape, spec[template], t, wide) for t in tiers]
        num = sum(w * m * s[k] for w, m, s in zip(weights, masks, states, strict=True))
        den = sum(w * m for w, m in zip(weights, masks, strict=True))
        assert torch.allclose(merged[k], num / den, atol=1e-12, rtol=0), k


def test_what_no_narrow_model_covers_keeps_the_anchors_value_as_heterofl_keeps_the_global():
    """A round of narrow clients only: each entry some client holds is their count-weighted mean, every other entry
    the anchor's (the previous global model), not zero; at equal widths the anchor changes nothing, bit for bit."""
    wide = BASES["vit"].replace(width=12, heads=3, head_dim=4, mlp=10)
    tiers = [wide.replace(width=8, heads=2, mlp=6, head_dim=4), wide.replace(width=4, heads=1, mlp=3, head_dim=4)]
    states, weights, anchor = [_canonical(wide, s) for s in range(2)], [3.0, 2.0], _canonical(wide, 9)
    merged = lstsq_merge(states, [_coordinate_placement(t, wide) for t in tiers], weights, anchor)
    spec = get_arch(wide.family).spec
    for k, (_, template) in expand(spec, wide.depth).items():
        if k not in merged:
            continue
        masks = [_heterofl_mask(merged[k].shape, spec[template], t, wide) for t in tiers]
        num = sum(w * m * s[k] for w, m, s in zip(weights, masks, states, strict=True))
        den = sum(w * m for w, m in zip(weights, masks, strict=True))
        expected = torch.where(den > 0, num / den.clamp_min(1e-300), anchor[k])
        assert torch.allclose(merged[k], expected, atol=1e-12, rtol=0), k
    same = [_canonical(wide, s) for s in range(3)]
    plain = lstsq_merge(same, [place(wide, wide)] * 3, [1.0, 2.0, 3.0])
    anchored = lstsq_merge(same, [place(wide, wide)] * 3, [1.0, 2.0, 3.0], anchor)
    assert all(torch.equal(plain[k], anchored[k]) for k in plain)


def test_moved_placement_follows_the_transformed_model():
    """Projecting through the moved placement gives the narrow model back (up to its own within-head maps)."""
    from glmc.symmetry.transforms import MATCHABLE, apply, random_transform

    small, big = scale_width(BASES["gpt2"], 0.5), BASES["gpt2"]
    native, x = random_native(small, 5), inputs(small, n=3)
    p = place(small, big)
    g = torch.Generator().manual_seed(0)
    t = random_transform(big, MATCHABLE, g)
    state = canonicalize(get_arch(small.family), native, small)
    back = project(apply(embed(state, p), get_arch(big.family).spec, t, big.heads), move(p, t))
    with torch.no_grad():
        out = get_arch(small.family).logits(to_model(back, small), x)
    assert (out - logits_of(native, small, x)).abs().max() <= 1e-5
    fc1 = "blocks.1.mlp.fc1.w"  # unit order and residual basis come back exactly
    assert torch.allclose(back[fc1], state[fc1], atol=1e-10)


@pytest.mark.parametrize("family", ["vit", "gpt2"])
def test_principal_placement_finds_a_narrow_model_embedded_anywhere(family):
    """A wide model that is a narrow one embedded at a random place (heads, units and residual moved): the
    principal placement finds that place, keeps 1 on 1, and restricting to it gives the narrow function back."""
    from glmc.symmetry.transforms import apply, random_transform

    small, big = ODD[family]
    native, x = random_native(small, 6), inputs(small, n=3)
    t = random_transform(big, ("residual", "head-perm", "mlp-perm"), torch.Generator().manual_seed(1))
    p = place(small, big)
    wide = apply(embed(canonicalize(get_arch(family), native, small), p), get_arch(family).spec, t, big.heads)
    where, found = move(p, t), principal_place(wide, small, big)
    for layer in range(big.depth):
        assert torch.equal(found.heads[layer], torch.sort(where.heads[layer]).values)
        assert torch.equal(found.mlp[layer], torch.sort(where.mlp[layer]).values)
    e = found.residual
    assert torch.allclose(e.T @ e, torch.eye(small.width, dtype=e.dtype), atol=1e-10)
    assert torch.allclose(e.sum(1) / small.width**0.5, torch.full((big.width,), big.width**-0.5, dtype=e.dtype))
    assert torch.allclose(found.projector(), where.projector(), atol=1e-8)
    with torch.no_grad():
        out = get_arch(family).logits(to_model(project(wide, found), small), x)
    assert (out - logits_of(native, small, x)).abs().max() <= 1e-5


def test_width_multiplier_scales_heads_at_fixed_head_size():
    base = preset("gpt2-bench")
    wide, narrow = scale_width(base, 2), scale_width(base, 0.5)
    assert (wide.width, wide.heads, wide.mlp, wide.head_dim) == (256, 8, 1024, base.head_dim)
    assert (narrow.width, narrow.heads, narrow.mlp, narrow.head_dim) == (64, 2, 256, base.head_dim)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="positive and finite"):
            scale_width(base, bad)


@pytest.mark.parametrize(("change", "message"), [
    ({"family": "gpt2", "vocab_size": VOCAB, "context": 6}, "families differ"),
    ({"depth": 3}, "depth-heterogeneous merging is out of scope"),
    ({"num_classes": 7}, "class counts differ"),
    ({"width": 256, "heads": 8}, "narrower than an input"),
])
def test_bad_pairs_are_refused_in_one_line(change, message):
    with pytest.raises(ConfigError, match=message) as err:
        place(BASES["vit"].replace(**change), BASES["vit"])
    assert "\n" not in str(err.value)


def test_a_round_of_narrow_clients_alone_stays_near_the_model_they_were_cut_from():
    """Untrained restrictions of one model at tiers 0.5 and 0.25, weight-aligned and merged around it: the thin
    directions between their aligned subspaces, barely covered, keep the anchor's values instead of being divided by
    their tiny coverage (22 times the model's norm away before)."""
    from federation.restriction import principal_placement, restrict
    from glmc.archs import build_model
    from glmc.merging.merge import MergeSetup, merge_models
    from glmc.merging.options import MergeOptions
    from glmc.merging.universe import Member

    torch.manual_seed(0)
    full = preset("vit-fl")
    anchor = {k: v.double() for k, v in build_model(full).state_dict().items()}
    members = [Member(restrict(anchor, full, t, "weight", p := principal_placement(anchor, full, t)),
                      scale_width(full, t), 1.0, p) for t in (0.5, 0.25)]
    merged = merge_models(members, MergeSetup(full, MergeOptions("weight", fold_norms=True)), anchor=anchor)
    canonical = canonicalize(get_arch(full.family), anchor, full, dtype=torch.float64)
    gap = sum(float((merged.universe.merged[k] - v).square().sum()) for k, v in canonical.items())
    assert gap ** 0.5 <= 0.1 * sum(float(v.square().sum()) for v in canonical.values()) ** 0.5
