"""Restoring norms after a merge: each unit gets its inputs' weighted mean norm, units an input lacks are left out of
its mean, and a merge of identical models is left as it is."""

from __future__ import annotations

import pytest
import torch

from glmc.archs import get_arch
from glmc.core.config import ModelConfig, preset, scale_width
from glmc.core.state import mix
from glmc.merging.rescale import restore_norms
from glmc.merging.widths import embed, place
from glmc.symmetry.canonical import canonicalize
from tests.symmetry_models import VOCAB, random_native

CONFIGS = {
    "vit": preset("vit-bench").replace(depth=2, img_size=8, patch=4, num_classes=5),
    "gpt2": preset("gpt2-bench").replace(depth=2, vocab_size=VOCAB, context=6, width=48, heads=3, mlp=70),
}


def _canonical(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    return canonicalize(get_arch(cfg.family), random_native(cfg, seed), cfg, dtype=torch.float64)


def _unit_norms(state: dict[str, torch.Tensor], cfg: ModelConfig, layer: int) -> dict[str, torch.Tensor]:
    """Each unit's norm, computed from the definitions: fc1 rows [w|b], fc2 columns, QK and OV circuits over [x; 1]."""
    p = f"blocks.{layer}"
    fc1 = torch.cat([state[f"{p}.mlp.fc1.w"], state[f"{p}.mlp.fc1.b"][:, None]], 1)
    qkv = torch.cat([state[f"{p}.attn.qkv.w"], state[f"{p}.attn.qkv.b"][:, None]], 1)
    q, k, v = qkv.reshape(3, cfg.heads, cfg.head_dim, cfg.width + 1)
    proj = state[f"{p}.attn.proj.w"].reshape(cfg.width, cfg.heads, cfg.head_dim)
    return {"fc1": fc1.norm(dim=1), "fc2": state[f"{p}.mlp.fc2.w"].norm(dim=0),
            "qk": torch.stack([torch.linalg.matrix_norm(q[h].T @ k[h]) for h in range(cfg.heads)]),
            "ov": torch.stack([torch.linalg.matrix_norm(proj[:, h] @ v[h]) for h in range(cfg.heads)])}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_every_unit_gets_the_weighted_mean_norm_of_the_inputs(family):
    cfg = CONFIGS[family]
    inputs, weights = [_canonical(cfg, 0), _canonical(cfg, 1)], [3.0, 1.0]
    merged = mix(inputs, [0.75, 0.25])
    restored = restore_norms(merged, inputs, cfg, weights)
    for layer in range(cfg.depth):
        before, after = _unit_norms(merged, cfg, layer), _unit_norms(restored, cfg, layer)
        a, b = (_unit_norms(s, cfg, layer) for s in inputs)
        for unit, norms in after.items():
            assert torch.allclose(norms, 0.75 * a[unit] + 0.25 * b[unit], rtol=1e-9), unit
            assert (before[unit] < norms).all(), unit  # averaging two random models shrank every unit
    untouched = [k for k in merged if not any(s in k for s in ("fc1", "fc2.w", "qkv", "proj.w"))]
    assert untouched and all(torch.equal(restored[k], merged[k]) for k in untouched)


def test_a_merge_of_identical_models_is_left_as_it_is():
    cfg = CONFIGS["vit"]
    state = _canonical(cfg, 0)
    restored = restore_norms(mix([state, state], [0.5, 0.5]), [state, state], cfg)
    assert all(torch.allclose(restored[k], state[k], rtol=1e-12, atol=1e-12) for k in state)


def test_an_input_that_lacks_a_unit_is_left_out_of_its_mean():
    wide = CONFIGS["vit"]
    narrow = scale_width(wide, 0.5)
    a, b = _canonical(wide, 0), embed(_canonical(narrow, 1), place(narrow, wide))
    restored = restore_norms(mix([a, b], [0.5, 0.5]), [a, b], wide)
    own = _unit_norms(a, wide, 0)
    after = _unit_norms(restored, wide, 0)
    dead = _unit_norms(b, wide, 0)["fc1"] == 0
    assert dead.any() and torch.allclose(after["fc1"][dead], own["fc1"][dead], rtol=1e-9)
