"""Weight matching, the alignment front-end and barriers: recovery of known transforms, exactness, endpoints."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest
import torch

from glmc.archs import get_arch
from glmc.cli import build_parser
from glmc.cli.options import match_options
from glmc.core.spec import RES, expand
from glmc.core.state import cast, interpolate
from glmc.errors import ConfigError, NonFiniteError, SpecError
from glmc.match import weight as weight_module
from glmc.match.align import align_pair
from glmc.match.common import sq_distance
from glmc.match.descent import Descent
from glmc.match.options import WeightOptions
from glmc.match.weight import (
    head_cost,
    l1_mlp_permutation,
    relaxed_residual,
    weight_match,
    without_stream_biases,
)
from glmc.merging.interpolation import barrier_curve
from glmc.symmetry import groups
from glmc.symmetry.canonical import canonicalize, to_model
from glmc.symmetry.transforms import MATCHABLE, apply, random_transform
from glmc.train import evaluate
from tests.symmetry_models import CONFIGS, dataset, inputs, logits_of, random_native

FAMILIES = ["vit-odd", "gpt2-odd"]


def _transformed_copy(cfg, classes, seed=7):
    arch = get_arch(cfg.family)
    a = canonicalize(arch, random_native(cfg, seed), cfg)
    g = torch.Generator().manual_seed(seed)
    t = random_transform(cfg, classes, g)
    return arch, a, apply(a, arch.spec, t, cfg.heads)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_weight_matching_names_the_tensor_that_is_not_finite(value):
    """A NaN or inf in either model is one named error, not a LAPACK failure deep in the first SVD."""
    cfg = CONFIGS["gpt2-odd"]
    arch, a, b = _transformed_copy(cfg, MATCHABLE)
    name = sorted(b)[len(b) // 2]
    b = dict(b) | {name: b[name].clone().index_put_((torch.tensor([0]),), torch.tensor(value, dtype=b[name].dtype))}
    with pytest.raises(NonFiniteError, match=rf"^model B: tensor '{name}' holds \d+ NaN or inf value\(s\) of \d+$"):
        weight_match(a, b, arch.spec, cfg.depth, cfg.heads)
    with pytest.raises(NonFiniteError, match=r"^model A: "):
        weight_match(b, a, arch.spec, cfg.depth, cfg.heads)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize(("dtype", "bound"), [(torch.float64, 1e-12), (torch.float32, 1e-8)])
def test_weight_matching_recovers_a_transformed_copy(name, dtype, bound):
    """Exact recovery when searching in float64; float32 (the default, half the cost) to its precision."""
    cfg = CONFIGS[name]
    arch, a, b = _transformed_copy(cfg, MATCHABLE)
    result = weight_match(a, b, arch.spec, cfg.depth, cfg.heads, dtype=dtype)
    aligned = apply(b, arch.spec, result.transform, cfg.heads)
    assert sq_distance(a, b) > 1.0
    assert sq_distance(a, aligned) < bound
    curve = barrier_curve(a, aligned, cfg, dataset(cfg), points=5)
    assert abs(curve.barrier) < 1e-8


# The official GLMC code's choices that are options here, one at a time and all together (WeightOptions documents
# each; the official matcher differs in more, docs/matching.md).
OFFICIAL = [{"head_cost": "norm"}, {"mlp_cost": "l1"}, {"stop": "fixed"}, {"biases": "skip"},
            {"head_cost": "norm", "mlp_cost": "l1", "stop": "fixed", "biases": "skip"}]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("options", OFFICIAL)
@pytest.mark.parametrize("start", ["relaxed", "embeddings"])
def test_weight_matching_with_the_official_choices_recovers_a_transformed_copy(name, options, start):
    cfg = CONFIGS[name]
    arch, a, b = _transformed_copy(cfg, MATCHABLE)
    result = weight_match(a, b, arch.spec, cfg.depth, cfg.heads, dtype=torch.float64,
                          options=WeightOptions(start=start, **options), max_sweeps=4)
    assert sq_distance(a, apply(b, arch.spec, result.transform, cfg.heads)) < 1e-12
    assert len(result.objective) == (4 if options.get("stop") == "fixed" else len(result.objective))
    if options.get("stop") == "fixed":  # every sweep runs and the last is kept, even with nothing left to gain
        assert result.info["sweeps"] == 4


@pytest.mark.parametrize("name", FAMILIES)
def test_skipping_the_biases_leaves_out_exactly_the_tensors_of_the_residual_axis_alone(name):
    cfg = CONFIGS[name]
    arch = get_arch(cfg.family)
    state = canonicalize(arch, random_native(cfg, 3), cfg)
    kept = without_stream_biases(state, arch.spec, cfg.depth)
    left = {n for n, (_, t) in expand(arch.spec, cfg.depth).items() if n in state and arch.spec[t] == (RES,)}
    assert left and set(kept) == set(state) - left and all(kept[n] is state[n] for n in kept)


def test_the_l1_mlp_cost_matches_units_by_their_normalised_rows():
    """The L1 cost compares rows after L2 normalisation, so rescaled units still match: a copy with its units
    permuted and rescaled by up to e^±4 (not a symmetry of GELU; here only a check of the cost) is matched
    exactly."""
    cfg = CONFIGS["vit-odd"]
    arch = get_arch(cfg.family)
    a = canonicalize(arch, random_native(cfg, 4), cfg, dtype=torch.float64)
    g = torch.Generator().manual_seed(4)
    perm = torch.randperm(cfg.mlp, generator=g)
    scale = torch.exp(2 * torch.randn(cfg.mlp, generator=g, dtype=torch.float64))
    b = dict(a)
    for name, axis in (("blocks.0.mlp.fc1.w", 0), ("blocks.0.mlp.fc1.b", 0), ("blocks.0.mlp.fc2.w", 1)):
        moved = a[name].index_select(axis, perm)
        b[name] = moved * (scale[:, None] if moved.dim() == 2 and axis == 0 else scale if axis == 0 else scale[None])
    found = l1_mlp_permutation(a, b, arch.spec, cfg.depth, 0)
    assert torch.equal(perm[found], torch.arange(cfg.mlp))


def test_the_cli_offers_every_weight_option_with_the_library_defaults():
    """Every field of WeightOptions is a flag of glmc align, read off its declaration: its choices are the field's,
    no flag given is the library's default, and a flag given reaches the options."""
    parser, hints = build_parser(), typing.get_type_hints(WeightOptions)
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    actions = {a.dest: a for a in sub.choices["align"]._actions}
    for field in dataclasses.fields(WeightOptions):
        assert list(actions[field.name].choices) == list(typing.get_args(hints[field.name])), field.name
    base = ["align", "a", "b", "--out", "o"]
    assert match_options(parser.parse_args(base)).weight == WeightOptions()
    given = match_options(parser.parse_args([*base, "--start", "identity", "--mlp-cost", "l1"])).weight
    assert given == WeightOptions(start="identity", mlp_cost="l1")
    with pytest.raises(ConfigError, match="unknown weight-matching mlp_cost 'l2'; known: inner, l1"):
        WeightOptions(mlp_cost="l2")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", FAMILIES)
def test_permutation_only_matching_recovers_permutations(name):
    cfg = CONFIGS[name]
    arch, a, b = _transformed_copy(cfg, ("head-perm", "mlp-perm"))
    result = weight_match(a, b, arch.spec, cfg.depth, cfg.heads, permutations_only=True)
    assert result.transform.residual is None and all(m is None for m in result.transform.qk)
    assert sq_distance(a, apply(b, arch.spec, result.transform, cfg.heads)) < 1e-20
    with pytest.raises(ConfigError, match="takes no start map"):
        weight_match(a, b, arch.spec, cfg.depth, cfg.heads, permutations_only=True, start=torch.eye(cfg.width))


@pytest.mark.parametrize("name", FAMILIES)
def test_permutation_only_matching_finds_a_permuted_stream(name):
    """The residual, heads and MLP units permuted, no continuous map: all found, a given start projected onto the
    permutations first."""
    cfg = CONFIGS[name]
    arch, a, _ = _transformed_copy(cfg, ())
    g = torch.Generator().manual_seed(3)
    t = random_transform(cfg, ("head-perm", "mlp-perm"), g)
    t.residual = torch.eye(cfg.width, dtype=torch.float64)[torch.randperm(cfg.width, generator=g)]
    b = apply(a, arch.spec, t, cfg.heads)
    for start in (None, torch.eye(cfg.width) + 0.01):  # None: the relaxed start, glmc's default
        result = weight_match(a, b, arch.spec, cfg.depth, cfg.heads, permutations_only=True, start=start,
                              permute_stream=True)
        residual = result.transform.residual
        assert residual is not None and set(residual.unique().tolist()) <= {0.0, 1.0}
        assert all(m is None for m in result.transform.qk)
        assert sq_distance(a, apply(b, arch.spec, result.transform, cfg.heads)) < 1e-20


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("start", ["identity", "relaxed", 3])
def test_weight_matching_of_independent_models_is_exact_and_descends(name, start):
    """From the identity, the relaxed start and a random residual start (an int seeds a random Q with Q·1 = 1)."""
    cfg = CONFIGS[name]
    arch = get_arch(cfg.family)
    native_b, x = random_native(cfg, 9), inputs(cfg)
    a, b = (canonicalize(arch, s, cfg) for s in (random_native(cfg, 8), native_b))
    q = start if isinstance(start, str) else groups.random_orthogonal(cfg.width, torch.Generator().manual_seed(start))
    result = weight_match(a, b, arch.spec, cfg.depth, cfg.heads, start=q)
    aligned = apply(b, arch.spec, result.transform, cfg.heads)
    assert all(later <= earlier + 1e-9 for earlier, later in zip(result.objective, result.objective[1:], strict=False))
    assert sq_distance(a, aligned) < sq_distance(a, b)
    # the search's last objective (float32, T(B) reached in two stages) is the distance of the exact result over
    # what it reads: the weights, not the stream's biases (the default, WeightOptions.biases skip)
    read = (without_stream_biases(s, arch.spec, cfg.depth) for s in (a, aligned))
    assert result.objective[-1] == pytest.approx(sq_distance(*read), rel=1e-4)
    with torch.no_grad():
        moved = arch.logits(to_model(aligned, cfg), x)
    assert (moved - logits_of(native_b, cfg, x)).abs().max() <= 1e-5


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("fix_ones", [True, False])
def test_relaxed_start_recovers_the_residual_map_of_a_transformed_copy(name, fix_ones):
    """B = T(A): the relaxed start is T's residual map itself (the relaxation is tight at the truth), in either
    residual group, so weight matching from it recovers A at once."""
    cfg = CONFIGS[name]
    arch = get_arch(cfg.family)
    a = canonicalize(arch, random_native(cfg, 7), cfg, "standard" if fix_ones else "rmsnorm")
    t = random_transform(cfg, MATCHABLE, torch.Generator().manual_seed(7), fix_ones=fix_ones)
    b = apply(a, arch.spec, t, cfg.heads)
    q = relaxed_residual(a, b, arch.spec, cfg.depth, fix_ones)
    assert torch.allclose(q @ t.residual, torch.eye(cfg.width, dtype=q.dtype), atol=1e-9)  # Q undoes T's residual
    result = weight_match(a, b, arch.spec, cfg.depth, cfg.heads, fix_ones=fix_ones, dtype=torch.float64,
                          options=WeightOptions(start="relaxed"))
    assert sq_distance(a, apply(b, arch.spec, result.transform, cfg.heads)) < 1e-12
    assert result.objective[0] < 1e-12  # the first sweep already ends at A


def test_weight_matching_is_the_same_side_by_side_and_the_threads_come_back():
    """On a multi-threaded CPU the relaxed start's polar factors and each sweep's layers run side by side (each on
    one thread): the maps are those the sequential loops find, and torch's thread count is restored."""
    cfg = CONFIGS["gpt2-odd"]
    arch = get_arch(cfg.family)
    a, b = (canonicalize(arch, random_native(cfg, seed), cfg) for seed in (3, 4))
    found = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            found.append((relaxed_residual(a, b, arch.spec, cfg.depth, True),
                          weight_match(a, b, arch.spec, cfg.depth, cfg.heads, dtype=torch.float64)))
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    (start_1, match_1), (start_2, match_2) = found
    assert torch.allclose(start_1, start_2, atol=1e-10)
    assert match_1.objective == pytest.approx(match_2.objective, rel=1e-9)
    assert all(torch.equal(x, y) for x, y in zip(match_1.transform.mlp + match_1.transform.heads,
                                                  match_2.transform.mlp + match_2.transform.heads, strict=True))


@pytest.mark.parametrize("name", FAMILIES)
def test_the_relaxed_start_reads_the_descents_fixed_products(name):
    """Weight matching hands the relaxed start the fixed tensors' products its sweeps compute anyway (a vocabulary
    multiplied once): the same start as the one the relaxed start computes alone."""
    cfg = CONFIGS[name]
    arch = get_arch(cfg.family)
    a, b = (canonicalize(arch, random_native(cfg, seed), cfg) for seed in (5, 6))
    given = Descent(a, b, arch.spec, cfg.depth, cfg.heads).fixed.scaled
    torch.testing.assert_close(relaxed_residual(a, b, arch.spec, cfg.depth, True, linear=given),
                               relaxed_residual(a, b, arch.spec, cfg.depth, True), rtol=0, atol=1e-10)


def test_weight_matching_rotates_only_folded_models():
    """A residual map needs every LayerNorm gain folded: an unfolded B is refused by name (checked once, when the
    fixed products are first read), and so is one that permutes the stream; head and MLP permutations alone match it."""
    cfg = CONFIGS["vit-odd"]
    arch = get_arch(cfg.family)
    a = canonicalize(arch, random_native(cfg, 1), cfg)
    raw = arch.to_canonical(random_native(cfg, 2), cfg)
    for start in ("identity", "relaxed"):
        with pytest.raises(SpecError, match="not folded"):
            weight_match(a, raw, arch.spec, cfg.depth, cfg.heads, options=WeightOptions(start=start))
    assert weight_match(a, raw, arch.spec, cfg.depth, cfg.heads, permutations_only=True).transform.residual is None
    with pytest.raises(SpecError, match="not folded"):  # a permuted stream reads the fixed products
        weight_match(a, raw, arch.spec, cfg.depth, cfg.heads, permutations_only=True, permute_stream=True)


def test_weight_matching_refuses_an_unknown_start():
    with pytest.raises(ConfigError, match="unknown weight-matching start 'zero'; known: relaxed, identity, embeddings"):
        WeightOptions(start="zero")  # type: ignore[arg-type]


def test_head_cost_is_the_distance_between_circuits():
    g = torch.Generator().manual_seed(3)
    heads, d_h, m = 3, 4, 6
    fa, fb = ((torch.randn(3, heads, d_h, m, generator=g, dtype=torch.float64),
               torch.randn(heads, d_h, m, generator=g, dtype=torch.float64)) for _ in range(2))
    def circuits(f, i):  # QK_i = W_Q,iᵀ W_K,i and OV_i = (W_O,iᵀ)ᵀ W_V,i, each (m, m)
        return f[0][0, i].T @ f[0][1, i], f[1][i].T @ f[0][2, i]
    def distance(i, j):
        return sum(float(((x - y) ** 2).sum()) for x, y in zip(circuits(fa, i), circuits(fb, j), strict=True))
    expected = torch.tensor([[distance(i, j) for j in range(heads)] for i in range(heads)], dtype=torch.float64)
    assert torch.allclose(head_cost(fa, fb), expected, rtol=1e-10, atol=1e-10)
    def unsquared(i, j):  # the official cost: ‖ΔQK‖ + ‖ΔOV‖
        return sum(float(((x - y) ** 2).sum()) ** 0.5 for x, y in zip(circuits(fa, i), circuits(fb, j), strict=True))
    expected = torch.tensor([[unsquared(i, j) for j in range(heads)] for i in range(heads)], dtype=torch.float64)
    assert torch.allclose(head_cost(fa, fb, squared=False), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", FAMILIES)
def test_barrier_endpoints_equal_endpoint_losses(name):
    cfg = CONFIGS[name]
    arch, data = get_arch(cfg.family), dataset(cfg)
    aligned = align_pair(random_native(cfg, 1), random_native(cfg, 2), cfg, "weight")
    curve = barrier_curve(aligned.a, aligned.b, cfg, data, points=5)
    loss_a = evaluate(to_model(aligned.a, cfg), arch, data)["loss"]
    loss_b = evaluate(to_model(aligned.b, cfg), arch, data)["loss"]
    assert curve.lambdas[0] == 0.0 and curve.lambdas[-1] == 1.0
    assert curve.losses[0] == pytest.approx(loss_b, abs=1e-12)
    assert curve.losses[-1] == pytest.approx(loss_a, abs=1e-12)
    assert curve.barriers[0] == pytest.approx(0.0, abs=1e-12) and curve.barriers[-1] == pytest.approx(0.0, abs=1e-12)
    mid = evaluate(to_model(interpolate(aligned.a, aligned.b, 0.5), cfg), arch, data)["loss"]
    assert curve.barriers[2] == pytest.approx(mid - 0.5 * (loss_a + loss_b), abs=1e-12)
    assert curve.barrier == max(curve.barriers)
    # dtype=float32 evaluates the float64 states as the tools do: the same as casting them first
    single = barrier_curve(aligned.a, aligned.b, cfg, data, points=5, dtype=torch.float32)
    cast_first = barrier_curve(*(cast(s, torch.float32) for s in (aligned.a, aligned.b)), cfg, data, points=5)
    assert single.losses == cast_first.losses != curve.losses


def test_alignment_refuses_mismatched_models_and_missing_data():
    cfg = CONFIGS["vit-odd"]
    with pytest.raises(SpecError, match=r"mlp\.fc1\.weight"):
        align_pair(random_native(cfg, 1), random_native(cfg.replace(mlp=71), 1), cfg, "weight")
    with pytest.raises(ConfigError, match="needs data"):
        align_pair(random_native(cfg, 1), random_native(cfg, 2), cfg, "activation")
    with pytest.raises(ConfigError, match="unknown alignment method"):
        align_pair(random_native(cfg, 1), random_native(cfg, 2), cfg, "magic")


@pytest.mark.parametrize("deficient", [False, True])
def test_the_relaxed_groups_low_rank_core_gives_the_full_polar_gradient(deficient):
    """An MLP-like group (2 blocks of d rows, n > 2d units): the gradient from the (2d, 2d) core and its stored
    factors equals the one from the (n, n) polar factor, also when the stacked rows are rank-deficient."""
    g = torch.Generator().manual_seed(3)
    d, n = 5, 17
    xa, xb = (torch.randn(2, d, n, generator=g, dtype=torch.float64) for _ in range(2))
    if deficient:  # the second block of each model repeats its first: rank d of 2d
        xa, xb = torch.stack([xa[0], 2 * xa[0]]), torch.stack([xb[0], -xb[0]])
    blocks = [(xa[k], xb[k], (1 + k) / n) for k in range(2)]  # blocks weighted unequally
    q = groups.random_orthogonal(d, g, fix_ones=False).double()
    core, full = (weight_module._RelaxedGroup(blocks, factored) for factored in (True, False))
    assert core.factors is not None and full.factors is None
    torch.testing.assert_close(core.gradient(q), full.gradient(q), rtol=1e-9, atol=1e-9)
