"""The path's v/o maps (glmc.match.ov_path): an exact symmetry on every family, the deviation it minimises is the
one the factors' interpolation leaves, and on the official pair (trained and saved by others) it lowers it."""

from __future__ import annotations

import pytest
import torch

from glmc.archs import get_arch
from glmc.io.formats import read
from glmc.match.align import align_pair
from glmc.match.common import head_factors
from glmc.match.options import MatchOptions, WeightOptions
from glmc.match.ov_path import _deviation, _layer_map, grams_of, ov_path_maps
from glmc.symmetry.canonical import canonicalize, to_model
from glmc.symmetry.transforms import Transform, apply
from simulations.bench.official import PAIR
from tests.symmetry_models import ALL_CONFIGS, inputs, logits_of, random_native

PATH = WeightOptions(ov_maps="path")


def _ov_deviation(a, b, spec, depth, heads) -> float:
    """Σ over layers and query heads of ‖(O_A − O_B)(V_A − V_B)‖², from the factors themselves."""
    total = 0.0
    for layer in range(depth):
        (qkv_a, out_a, _), (qkv_b, out_b, _) = (head_factors(s, spec, depth, layer, heads) for s in (a, b))
        total += float(((out_a - out_b).double().mT @ (qkv_a[2] - qkv_b[2]).double()).pow(2).sum())
    return total


@pytest.mark.parametrize("name", sorted(ALL_CONFIGS))
def test_weight_matching_on_the_path_computes_the_same_function(name):
    """Independent models, every family (grouped KV heads and rotary included: v/o maps do not touch positions)."""
    cfg = ALL_CONFIGS[name]
    native_b, x = random_native(cfg, 9), inputs(cfg)
    aligned = align_pair(random_native(cfg, 8), native_b, cfg, "weight", MatchOptions(weight=PATH))
    assert aligned.result.info["ov_path_refused_layers"] < cfg.depth  # the maps are the path's, not the identity
    with torch.no_grad():
        moved = get_arch(cfg.family).logits(to_model(aligned.b, cfg), x)
    assert (moved - logits_of(native_b, cfg, x)).abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["gpt2-odd", "llama-gqa", "bert-odd"])
def test_the_gram_deviation_is_the_factors_own_and_the_maps_lower_it(name):
    """The (d_h, d_h) Gram form equals ‖ΔO ΔV‖² of B moved by a random invertible N (apply does the moving), and
    the maps found lower it below weight matching's orthogonal ones."""
    cfg = ALL_CONFIGS[name]
    arch = get_arch(cfg.family)
    a, b = (canonicalize(arch, random_native(cfg, s), cfg, dtype=torch.float64) for s in (3, 4))
    fa, fb = (head_factors(s, arch.spec, cfg.depth, 0, cfg.heads) for s in (a, b))
    kv, head_dim, g = fa[2], fa[1].shape[1], torch.Generator().manual_seed(5)
    n = torch.eye(head_dim, dtype=torch.float64) + 0.3 * torch.randn(kv, head_dim, head_dim, generator=g,
                                                                    dtype=torch.float64)
    moved = apply(b, arch.spec, Transform(cfg.depth, ov=[n, *[None] * (cfg.depth - 1)]), cfg.heads)
    qkv_a, out_a, _ = fa
    grams = grams_of(fa, fb)
    qkv_m, out_m, _ = head_factors(moved, arch.spec, cfg.depth, 0, cfg.heads)
    direct = float(((out_a - out_m).mT @ (qkv_a[2] - qkv_m[2])).pow(2).sum())
    assert float(_deviation(n, grams, cfg.heads // kv)) == pytest.approx(direct, rel=1e-9)
    found = _layer_map(fa, fb)
    assert found is not None
    identity = torch.eye(head_dim, dtype=torch.float64).expand(kv, -1, -1)
    assert float(_deviation(found, grams, cfg.heads // kv)) < float(_deviation(identity, grams, cfg.heads // kv))


def test_on_the_official_pair_the_maps_lower_the_deviation_and_keep_the_model():
    """Two GPT-2s the official code trained (saved by transformers): after weight matching, the path's maps lower
    the OV deviation of every layer and B still computes its own logits (float64, a few tokens)."""
    (na, meta), (nb, _) = read(PAIR / "seed0"), read(PAIR / "seed1")
    cfg, arch = meta.config, get_arch(meta.config.family)
    aligned = align_pair(na, nb, cfg, "weight")
    maps = ov_path_maps(aligned.a, aligned.b, arch.spec, cfg.depth, cfg.heads)
    assert all(m is not None for m in maps)
    on_path = apply(aligned.b, arch.spec, Transform(cfg.depth, ov=maps), cfg.heads)
    before, after = (_ov_deviation(aligned.a, s, arch.spec, cfg.depth, cfg.heads) for s in (aligned.b, on_path))
    assert after < 0.9 * before
    x = torch.arange(16).reshape(1, 16) * 7 % cfg.vocab_size
    with torch.no_grad():
        moved = arch.logits(to_model(on_path, cfg), x)
        own = arch.logits(to_model(canonicalize(arch, nb, cfg, dtype=torch.float64), cfg), x)
    assert (moved - own).abs().max() <= 1e-5
