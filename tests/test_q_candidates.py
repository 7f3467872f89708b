"""The Q-candidates bench's maps: the stream cross-moment recovers a planted residual map, the extrapolated
correction turns each plane by the given multiple, and synthetic inputs fit the model."""

from __future__ import annotations

import pytest
import torch

from glmc.archs import get_arch
from glmc.symmetry import groups
from glmc.symmetry.transforms import MATCHABLE, apply, invert, random_transform
from simulations.analyses.learned_gap import angles
from simulations.analyses.q_candidates import cross_moment, extrapolated, synthetic
from tests.symmetry_models import CONFIGS, canonical, inputs, planted


@pytest.mark.parametrize("name", ["vit-odd", "gpt2-odd"])
def test_the_stream_cross_moment_recovers_a_planted_residual_map(name: str) -> None:
    cfg = CONFIGS[name]
    a = canonical(cfg, 4)
    t = random_transform(cfg, MATCHABLE, torch.Generator().manual_seed(5))
    b = apply(a, get_arch(cfg.family).spec, t, cfg.heads)  # A's function, its stream turned by t's residual map
    q = groups.procrustes(cross_moment(a, b, cfg, inputs(cfg, 16, 6)), True)
    expected = invert(t).residual
    assert expected is not None and (q - expected).abs().max().item() <= 1e-8  # maps B's stream back onto A's


def test_the_extrapolated_correction_turns_each_plane_by_the_multiple() -> None:
    q_w, _ = planted([25.0, 60.0], 9, 7)
    r, _ = planted([10.0, 40.0, 80.0], 9, 8)
    q_l = q_w @ r
    assert torch.allclose(extrapolated(q_w, q_l, 1.0), q_l, atol=1e-10)
    assert torch.allclose(extrapolated(q_w, q_l, 0.0), q_w, atol=1e-12)
    beyond = extrapolated(q_w, q_l, 1.5)
    assert torch.allclose(beyond.T @ beyond, torch.eye(9, dtype=torch.float64), atol=1e-10)
    turned = sorted(angles(q_w.T @ beyond).tolist())[-6:]
    assert turned == pytest.approx([15.0, 15.0, 60.0, 60.0, 120.0, 120.0], abs=1e-6)


@pytest.mark.parametrize("name", ["vit-odd", "gpt2-odd"])
def test_synthetic_inputs_fit_the_model_and_owe_nothing_to_the_data(name: str) -> None:
    cfg = CONFIGS[name]
    real = inputs(cfg, 8, 3)
    fake = synthetic(real, cfg)
    assert fake.shape == real.shape and fake.dtype == real.dtype and not torch.equal(fake, real)
    assert torch.equal(fake, synthetic(real, cfg))  # seeded
    if not real.is_floating_point():
        assert int(fake.min()) >= 0 and int(fake.max()) < cfg.vocab_size
