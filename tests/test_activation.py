"""Activation matching (Verma & Elbayad §3): recovers permutation-class transforms, always preserves B's
function, and its LAPs beat the identity assignment on the correlations they maximise."""

import pytest
import torch
from torch import nn

from glmc.archs import build_model, get_arch
from glmc.core.config import ModelConfig, preset
from glmc.core.state import State
from glmc.errors import ConfigError
from glmc.match.activation import activation_match, correlations
from glmc.match.common import sq_distance
from glmc.symmetry.canonical import canonicalize, to_model
from glmc.symmetry.transforms import Transform, apply

# Odd sizes, so no accidental symmetry of shapes hides an orientation bug.
CONFIGS = {
    "vit": preset("vit-tiny").replace(width=45, heads=3, mlp=70, img_size=8, patch=4, in_chans=1, num_classes=3),
    "gpt2": preset("gpt2-tiny").replace(width=45, heads=3, mlp=70, vocab_size=50, context=12),
    # grouped queries: 3 KV heads of 2 queries each, rotary positions, a gated MLP
    "llama": preset("llama-tiny").replace(width=36, heads=6, kv_heads=3, mlp=70, vocab_size=50, context=12),
}


# Logit gaps of an exact transform: float64 round-off, except that HF's RMSNorm computes in float32 whatever the dtype.
GAP = {"vit": 1e-10, "gpt2": 1e-10, "llama": 1e-6}


def random_state(cfg: ModelConfig, seed: int) -> State:
    """A random float64 model with non-trivial LayerNorm affines, canonicalised (LNs folded)."""
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.copy_(1 + 0.3 * torch.randn_like(module.weight))
                module.bias.copy_(0.1 * torch.randn_like(module.bias))
    return canonicalize(get_arch(cfg.family), model.state_dict(), cfg, dtype=torch.float64)


def random_batch(cfg: ModelConfig, n: int = 24) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if cfg.family == "vit":
        return torch.randn(n, cfg.in_chans, cfg.img_size, cfg.img_size, generator=g, dtype=torch.float64)
    return torch.randint(0, cfg.vocab_size, (n, cfg.context), generator=g)


def permutation_transform(cfg: ModelConfig, seed: int) -> Transform:
    """Residual permutation matrix, KV-head and in-group query permutations, within-head value permutations (one per
    KV head), MLP permutations."""
    g = torch.Generator().manual_seed(seed)

    def perm_matrix(n: int) -> torch.Tensor:
        return torch.eye(n, dtype=torch.float64)[torch.randperm(n, generator=g)]

    t = Transform(cfg.depth, residual=perm_matrix(cfg.width))
    for layer in range(cfg.depth):
        t.heads[layer] = torch.randperm(cfg.kv_heads, generator=g)
        if cfg.group > 1:
            t.group[layer] = torch.stack([torch.randperm(cfg.group, generator=g) for _ in range(cfg.kv_heads)])
        t.ov[layer] = torch.stack([perm_matrix(cfg.head_dim) for _ in range(cfg.kv_heads)])
        t.mlp[layer] = torch.randperm(cfg.mlp, generator=g)
    return t


def logits_gap(x: State, y: State, cfg: ModelConfig, batch: torch.Tensor) -> float:
    arch = get_arch(cfg.family)
    with torch.no_grad():
        return float((arch.logits(to_model(x, cfg), batch) - arch.logits(to_model(y, cfg), batch)).abs().max())


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest) -> tuple[ModelConfig, State, State]:
    cfg = CONFIGS[request.param]
    return cfg, random_state(cfg, 0), random_state(cfg, 1)


def test_recovers_a_permutation_transform(pair: tuple[ModelConfig, State, State]) -> None:
    cfg, a, _ = pair
    spec, batch = get_arch(cfg.family).spec, random_batch(cfg)
    b = apply(a, spec, permutation_transform(cfg, seed=3), cfg.heads)
    assert sq_distance(a, b) > 1.0  # the transform really moved B away from A
    result = activation_match(a, b, cfg, batch, batch_size=10, residual=True)
    aligned = apply(b, spec, result.transform, cfg.heads)
    assert max(float((a[k] - aligned[k]).abs().max()) for k in a) < 1e-8
    assert logits_gap(aligned, b, cfg, batch) < GAP[cfg.family]
    assert result.objective[-1] < 1e-12
    assert min(result.info[k] for k in ("corr_residual", "corr_mlp", "corr_heads")) > 1 - 1e-9
    assert result.transform.qk == [None] * cfg.depth


def test_a_gated_mlp_recovers_units_whose_signs_flipped() -> None:
    """A gated unit's up row and down column negated together is a symmetry that negates its feature: with signs
    searched, the permutation and the flips are undone exactly; without, the flipped units (correlated at −1) are
    matched elsewhere and B stays away from A."""
    cfg = CONFIGS["llama"]
    a, spec, batch = random_state(cfg, 0), get_arch(cfg.family).spec, random_batch(cfg)
    planted = permutation_transform(cfg, seed=3)
    g = torch.Generator().manual_seed(4)
    planted.mlp_scale = [torch.where(torch.rand(cfg.mlp, generator=g) < 0.5, -1.0, 1.0).double()
                         for _ in range(cfg.depth)]
    b = apply(a, spec, planted, cfg.heads)
    assert logits_gap(a, b, cfg, batch) < GAP["llama"]
    signed = activation_match(a, b, cfg, batch, batch_size=10, residual=True, signs=True)
    aligned = apply(b, spec, signed.transform, cfg.heads)
    assert max(float((a[k] - aligned[k]).abs().max()) for k in a) < 1e-8
    assert signed.info["corr_mlp"] > 1 - 1e-9
    unsigned = activation_match(a, b, cfg, batch, batch_size=10, residual=True)
    assert sq_distance(a, apply(b, spec, unsigned.transform, cfg.heads)) > 1.0


def test_independent_models_function_preserved_and_closer(pair: tuple[ModelConfig, State, State]) -> None:
    cfg, a, b = pair
    spec, batch = get_arch(cfg.family).spec, random_batch(cfg)
    result = activation_match(a, b, cfg, batch, residual=True)
    aligned = apply(b, spec, result.transform, cfg.heads)
    assert logits_gap(aligned, b, cfg, batch) <= GAP[cfg.family]
    assert result.objective[-1] <= sq_distance(a, b)
    assert result.seconds > 0
    corr = correlations(a, b, cfg, batch)
    identity = {
        "corr_residual": torch.diagonal(corr["residual", -1]).mean(),
        "corr_mlp": torch.cat([torch.diagonal(corr["mlp", i]) for i in range(cfg.depth)]).mean(),
        "corr_heads": torch.cat([torch.diagonal(corr["heads", i]) for i in range(cfg.depth)]).mean(),
    }
    for key, value in identity.items():
        assert result.info[key] >= float(value), key
    assert result.info["corr_mlp"] > float(identity["corr_mlp"]) + 0.05  # strictly better, not a tie


def test_chunked_statistics_match_one_pass(pair: tuple[ModelConfig, State, State]) -> None:
    cfg, a, b = pair
    batch = random_batch(cfg, n=13)
    whole, chunked = correlations(a, b, cfg, batch, batch_size=13), correlations(a, b, cfg, batch, batch_size=4)
    assert whole.keys() == chunked.keys()
    assert len(whole) == 2 * cfg.depth + 1
    for key in whole:
        assert torch.allclose(whole[key], chunked[key], atol=1e-10), key
        assert float(whole[key].abs().max()) <= 1 + 1e-9


def test_matches_a_model_to_itself_at_identity(pair: tuple[ModelConfig, State, State]) -> None:
    cfg, a, _ = pair
    t = activation_match(a, a, cfg, random_batch(cfg), residual=True).transform
    assert torch.equal(t.residual, torch.eye(cfg.width, dtype=torch.float64))
    for layer in range(cfg.depth):
        assert torch.equal(t.heads[layer], torch.arange(cfg.kv_heads))
        assert t.group[layer] is None or torch.equal(t.group[layer], torch.arange(cfg.group).repeat(cfg.kv_heads, 1))
        assert torch.equal(t.mlp[layer], torch.arange(cfg.mlp))


def test_a_language_model_keeps_its_residual_by_default(pair: tuple[ModelConfig, State, State]) -> None:
    """Verma & Elbayad permute the residual for classifiers and leave it for language models (§5.3)."""
    cfg, a, b = pair
    batch = random_batch(cfg)
    default, permuted = activation_match(a, b, cfg, batch), activation_match(a, b, cfg, batch, residual=True)
    assert (default.transform.residual is None) == (not get_arch(cfg.family).activation_residual)
    assert permuted.transform.residual is not None
    assert [torch.equal(x, y) for x, y in zip(default.transform.mlp, permuted.transform.mlp, strict=True)] == (
        [True] * cfg.depth)  # the MLP and head LAPs read the same correlations either way


BAD_BATCHES = {
    "vit": [torch.zeros(4, 3, 8, 8), torch.zeros(4, 1, 8), torch.zeros(4, 1, 9, 9), torch.zeros(0, 1, 8, 8)],
    "gpt2": [torch.zeros(4, 13, dtype=torch.long), torch.zeros(4, 12), torch.full((4, 5), 50),
             torch.zeros(4, 12, 1, dtype=torch.long), torch.zeros(12, dtype=torch.long)],
}


@pytest.mark.parametrize(("family", "index"), [(f, i) for f, bad in BAD_BATCHES.items() for i in range(len(bad))])
def test_wrongly_shaped_batch_raises(family: str, index: int) -> None:
    cfg = CONFIGS[family]
    state = random_state(cfg, 0)
    with pytest.raises(ConfigError, match="expected \\(N, "):
        activation_match(state, state, cfg, BAD_BATCHES[family][index])
