"""Mixed widths in every family: separate q, k, v with grouped queries, RMSNorm, rotary positions, SwiGLU, GPT-NeoX's
partial rotary and parallel residual, BERT's post-LayerNorm. A narrow model embedded in a wider one computes its own
function, HeteroFL's slices take whole KV groups, a mixed-width merge runs, and what cannot change width is refused in
one line."""

from __future__ import annotations

import pytest
import torch

from glmc.archs import get_arch
from glmc.core.config import ModelConfig, preset, scale_width
from glmc.core.spec import NORM, RES, expand
from glmc.errors import ConfigError
from glmc.match.common import sq_distance
from glmc.merging import heterofl
from glmc.merging.merge import MergeSetup, merge_models
from glmc.merging.options import MergeOptions
from glmc.merging.universe import Member, members, universe_match
from glmc.merging.widths import Placement, axis_mask, embed, embedding_config, place, project, widen
from glmc.symmetry.canonical import canonicalize, to_model
from glmc.symmetry.transforms import MATCHABLE, apply, random_transform
from tests.symmetry_models import ALL_CONFIGS, VOCAB, inputs, logits_of, random_native

# A narrower model of each family variant (tests/symmetry_models.py): fewer KV groups (Llama), the one KV head kept
# with a narrower stream and MLP (Mistral), biased q/k/v (Qwen2), parallel and sequential residuals with partial and
# full rotary (GPT-NeoX), and a post-LayerNorm ReLU BERT at a fifth of the width (its stream repeats each coordinate).
NARROW: dict[str, dict[str, int]] = {
    "llama-gqa": {"width": 20, "heads": 2, "kv_heads": 1, "mlp": 33},
    "mistral-mqa": {"width": 30, "mlp": 20},
    "qwen2-bias": {"width": 17, "heads": 2, "kv_heads": 2, "mlp": 19},
    "neox-parallel": {"width": 32, "heads": 2, "mlp": 41},
    "neox-sequential": {"width": 18, "heads": 3, "mlp": 20},
    "neox-nobias": {"width": 12, "heads": 1, "mlp": 20},
    "bert-relu": {"width": 6, "heads": 1, "mlp": 20},
}
LLAMA = preset("llama-tiny").replace(vocab_size=VOCAB, context=12)
PAIRS = [(name, ALL_CONFIGS[name].replace(head_dim=ALL_CONFIGS[name].head_dim, **sizes), ALL_CONFIGS[name])
         for name, sizes in NARROW.items()] + [("llama-tiny-half", scale_width(LLAMA, 0.5), LLAMA)]
IDS = [p[0] for p in PAIRS]


def _logits(state: dict[str, torch.Tensor], cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return get_arch(cfg.family).logits(to_model(state, cfg), x)


@pytest.mark.parametrize(("name", "small", "big"), PAIRS, ids=IDS)
def test_a_narrow_model_embedded_at_full_width_computes_its_own_function(name, small, big) -> None:
    """Float64 (the RMSNorm families' norms compute in float32); projection inverts the embedding."""
    native, x = random_native(small, 3), inputs(small, n=3)
    state, p = canonicalize(get_arch(small.family), native, small, dtype=torch.float64), place(small, big)
    wide = embed(state, p)
    assert all(wide[k].shape == v.shape for k, v in canonicalize(get_arch(big.family), random_native(big, 0),
                                                                 big).items())
    assert (_logits(wide, embedding_config(p), x) - logits_of(native, small, x)).abs().max() <= 1e-5
    assert max(float((project(wide, p)[k] - v).abs().max()) for k, v in state.items()) < 1e-12


@pytest.mark.parametrize(("name", "small", "big"), PAIRS, ids=IDS)
def test_net2net_copies_of_whole_kv_groups_and_gated_units_change_nothing(name, small, big) -> None:
    native, x = random_native(small, 3), inputs(small, n=3)
    widened, cfg = widen(canonicalize(get_arch(small.family), native, small), small, big)
    assert (cfg.heads, cfg.kv_heads, cfg.mlp, cfg.width) == (big.heads, big.kv_heads, big.mlp, small.width)
    p = place(cfg, big)
    assert (_logits(embed(widened, p), embedding_config(p), x) - logits_of(native, small, x)).abs().max() <= 1e-5


def _coordinates(narrow: ModelConfig, wide: ModelConfig) -> Placement:
    """HeteroFL's sub-model as a placement: the first d coordinates, the first KV heads and units."""
    p = place(narrow, wide)
    return Placement(narrow, wide, torch.eye(wide.width, dtype=torch.float64)[:, : narrow.width], p.heads,
                     p.head_dim, p.mlp)


def _covered(shape: torch.Size, axes, p: Placement, layer: int | None) -> torch.Tensor:
    """The entries a placement covers, per axis: its first residual coordinates (norm gains too), its heads' and
    units' masks."""
    mask = torch.ones(shape, dtype=torch.bool)
    for axis, kind in enumerate(axes):
        keep = torch.ones(shape[axis], dtype=torch.bool)
        if kind in (RES, NORM):
            keep[p.narrow.width:] = False
        elif kind is not None and (m := axis_mask(kind, p, layer)) is not None:
            keep = m.bool()
        mask &= keep.reshape([-1 if i == axis else 1 for i in range(len(shape))])
    return mask


@pytest.mark.parametrize(("name", "small", "big"), PAIRS, ids=IDS)
def test_the_heterofl_slice_of_a_narrow_model_put_in_the_global_one_is_that_model(name, small, big) -> None:
    """restrict(merge(x)) == x through the native keys (GPT-NeoX's per-head fused q|k|v joined at the narrow
    width), and the slice takes exactly the entries the coordinate placement covers: whole KV groups, gate rows."""
    arch = get_arch(big.family)
    narrow, wide = random_native(small, 1), random_native(big, 2)
    put = heterofl.merge([narrow], [small], [1.0], big, wide)
    back = heterofl.restrict(put, big, small)
    assert back.keys() == narrow.keys() and all(torch.equal(back[k], v) for k, v in narrow.items())
    canonical, p = arch.to_canonical(wide, big), _coordinates(small, big)
    for key, (layer, template) in expand(arch.spec, big.depth).items():
        if key in canonical:
            taken = torch.zeros(canonical[key].numel(), dtype=torch.bool)
            taken[heterofl.positions(canonical[key].shape, arch.spec[template], small, big).reshape(-1)] = True
            assert torch.equal(taken, _covered(canonical[key].shape, arch.spec[template], p, layer).reshape(-1)), key


def test_a_narrow_llama_and_transformed_copies_of_its_embedding_merge_back_to_it() -> None:
    """Universe matching across widths on grouped queries: KV heads and their queries move as the transforms do."""
    small, big = PAIRS[0][1], PAIRS[0][2]
    native, x = random_native(small, 2), inputs(small, n=3)
    state = canonicalize(get_arch(small.family), native, small, dtype=torch.float64)
    p, g = place(small, big), torch.Generator().manual_seed(5)
    wide = embed(state, p)
    copies = [apply(wide, get_arch(big.family).spec, random_transform(big, MATCHABLE, g), big.heads) for _ in range(2)]
    result = universe_match(members([state, *copies], [small, big, big]), big)
    assert sq_distance(result.merged, wide) < 1e-8
    assert (_logits(result.merged, embedding_config(p), x) - logits_of(native, small, x)).abs().max() <= 1e-5


def test_llama_tiny_at_two_widths_merges_through_the_public_path() -> None:
    """merge_models, weight matching, tiers 1 and 0.5: a standard llama-tiny of the full width comes out."""
    half = scale_width(LLAMA, 0.5)
    inputs_ = [Member(random_native(cfg, seed), cfg, 1.0) for seed, cfg in enumerate((LLAMA, LLAMA, half))]
    merged = merge_models(inputs_, MergeSetup(LLAMA, MergeOptions("weight", min_gain=0.0)))
    model = to_model(merged.universe.merged, LLAMA)
    assert not merged.set_aside and merged.universe.placements[2].narrow == half
    assert torch.isfinite(get_arch("llama").logits(model, inputs(LLAMA, n=2))).all()


@pytest.mark.parametrize(("narrow", "wide", "message"), [
    (LLAMA.replace(heads=2, kv_heads=2), LLAMA, r"query heads per KV head differ \(1 vs 2\)"),
    (LLAMA.replace(head_dim=4), LLAMA, "rotary positions fix a head's size"),
    (ALL_CONFIGS["bert-odd"].replace(width=30, heads=2, mlp=40, head_dim=15), ALL_CONFIGS["bert-odd"],
     "residual width 45 is not a multiple of 30"),
    (ALL_CONFIGS["bert-odd"].replace(width=15, heads=1, mlp=40, head_dim=15), ALL_CONFIGS["bert-odd"],
     "gelu at the stream's width"),
])
def test_what_cannot_change_width_is_refused_in_one_line(narrow, wide, message) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        place(narrow, wide)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="does not divide the 2 KV heads") as err:
        scale_width(LLAMA, 0.25)
    assert "\n" not in str(err.value)
