"""Universe matching: transformed copies merge back to the original, the merge ignores input order, and the
vanilla path is FedAvg / least squares; also across widths and through the process pool."""

from __future__ import annotations

import pytest
import torch

from glmc.archs import get_arch
from glmc.errors import ConfigError
from glmc.match.common import sq_distance
from glmc.match.options import MatchOptions, WeightOptions
from glmc.merging.options import MergeOptions
from glmc.merging.universe import HOST_MATCH_MAX_PARAMS, Member, matching_device, members, universe_match
from glmc.merging.widths import FILLS, embed, embedding_config, place, widen
from glmc.symmetry.canonical import canonicalize, to_model
from glmc.symmetry.transforms import MATCHABLE, apply, maps_to, random_transform
from tests.symmetry_models import CONFIGS, inputs, logits_of, random_native


def _copies(cfg, state, n, seed=0):
    """n random symmetry transforms of one canonical state (the first is the state itself)."""
    arch, g = get_arch(cfg.family), torch.Generator().manual_seed(seed)
    copies = [state]
    for _ in range(n - 1):
        t = random_transform(cfg, MATCHABLE, g)
        copies.append(apply(state, arch.spec, t, cfg.heads))
    return copies


def _logits(state, cfg, x):
    with torch.no_grad():
        return get_arch(cfg.family).logits(to_model(state, cfg), x)


@pytest.mark.parametrize(("name", "workers"), [("vit-odd", 1), ("gpt2-odd", 1), ("vit-relu", 2)])
def test_merging_transformed_copies_gives_back_the_model(name, workers):
    cfg = CONFIGS[name]
    native, x = random_native(cfg, 1), inputs(cfg, n=3)
    copies = _copies(cfg, canonicalize(get_arch(cfg.family), native, cfg), 4)
    result = universe_match(members(copies[::-1], [cfg] * 4, [1, 2, 3, 4]), cfg, MergeOptions(workers=workers),
                            reference=3)
    assert sq_distance(result.merged, copies[0]) < 1e-9  # weight matching searches in float32
    assert (_logits(result.merged, cfg, x) - logits_of(native, cfg, x)).abs().max() <= 1e-6
    assert result.history[0].mean_distance < 1e-5 and len(result.history) <= 2


def test_merging_copies_across_widths_gives_back_the_narrow_model():
    wide = CONFIGS["gpt2-odd"]
    narrow = wide.replace(width=28, heads=2, head_dim=15, mlp=40)
    native, x = random_native(narrow, 2), inputs(narrow, n=3)
    state = canonicalize(get_arch(narrow.family), native, narrow)
    p = place(narrow, wide)
    copies = _copies(wide, embed(state, p), 3, seed=5)
    result = universe_match(members([state, *copies[1:]], [narrow, wide, wide]), wide)
    assert sq_distance(result.merged, copies[0]) < 1e-10
    assert (_logits(result.merged, embedding_config(p), x) - logits_of(native, narrow, x)).abs().max() <= 1e-6


def test_merging_copies_across_widths_with_net2net_fill_gives_back_the_narrow_model():
    """fill='copies': the narrow model enters widened to the universe's heads and units, and matching finds it."""
    wide = CONFIGS["vit-odd"]
    narrow = wide.replace(width=wide.width - 5, heads=wide.heads - 1, head_dim=wide.head_dim, mlp=wide.mlp // 2 + 1)
    native, x = random_native(narrow, 2), inputs(narrow, n=3)
    state = canonicalize(get_arch(narrow.family), native, narrow)
    widened, cfg = widen(state, narrow, wide)
    p = place(cfg, wide)
    copies = _copies(wide, embed(widened, p), 3, seed=5)
    result = universe_match(members([state, *copies[1:]], [narrow, wide, wide]), wide, MergeOptions(fill="copies"))
    assert sq_distance(result.merged, copies[0]) < 1e-10
    assert (_logits(result.merged, embedding_config(p), x) - logits_of(native, narrow, x)).abs().max() <= 1e-6
    assert result.placements[0].narrow == cfg


def test_fill_options_are_checked_in_one_line():
    from glmc.cli.merge import FILL_NAMES

    assert list(FILLS) == FILL_NAMES  # the CLI lists them without importing torch
    wide = CONFIGS["vit-odd"]
    narrow = wide.replace(width=wide.width - 5, head_dim=wide.head_dim)
    state = canonicalize(get_arch(wide.family), random_native(narrow, 2), narrow)
    with pytest.raises(ConfigError, match="unknown fill 'ones'") as err:
        MergeOptions("none", fill="ones")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="start placements") as err:
        universe_match([Member(state, narrow, placement=place(narrow, wide))], wide,
                       MergeOptions("none", fill="copies"))
    assert "\n" not in str(err.value)


def test_merge_is_invariant_to_input_order_given_the_reference():
    cfg = CONFIGS["vit-odd"]
    arch = get_arch(cfg.family)
    states = [canonicalize(arch, random_native(cfg, s), cfg) for s in range(3)]
    weights, order = [3.0, 1.0, 2.0], [2, 0, 1]
    first = universe_match(members(states, [cfg] * 3, weights), cfg, MergeOptions(max_iters=3), reference=0)
    second = universe_match(members([states[i] for i in order], [cfg] * 3, [weights[i] for i in order]), cfg,
                            MergeOptions(max_iters=3), reference=order.index(0))
    assert sq_distance(first.merged, second.merged) < 1e-20
    assert [r.iteration for r in first.history] == [1, 2, 3]


def test_vanilla_merge_is_fedavg_by_hand():
    cfg = CONFIGS["gpt2-relu"]
    arch = get_arch(cfg.family)
    states = [canonicalize(arch, random_native(cfg, s), cfg) for s in range(3)]
    result = universe_match(members(states, [cfg] * 3, [1.0, 1.0, 2.0]), cfg, MergeOptions("none"))
    for k, v in result.merged.items():
        assert torch.allclose(v, (states[0][k] + states[1][k] + 2 * states[2][k]) / 4, atol=1e-12)
    assert len(result.history) == 1 and result.transforms[0].residual is None


def test_learned_refinement_keeps_every_model_exact():
    from glmc.match.options import LearnConfig
    from tests.symmetry_models import dataset

    cfg = CONFIGS["vit-odd"]
    arch, x = get_arch(cfg.family), inputs(cfg, n=3)
    natives = [random_native(cfg, s) for s in range(3)]
    states = [canonicalize(arch, n, cfg) for n in natives]
    options = LearnConfig(steps=2, eval_every=1, batch_size=8, val_max=8)
    result = universe_match(members(states, [cfg] * 3), cfg,
                            MergeOptions("learned", MatchOptions(learn=options), max_iters=1), data=dataset(cfg, n=24))
    assert [r.method for r in result.history] == ["weight", "refine"]
    for native, aligned in zip(natives, result.aligned, strict=True):
        assert (_logits(aligned, cfg, x) - logits_of(native, cfg, x)).abs().max() <= 1e-6


def test_the_weight_matchers_choices_reach_every_pairwise_matching():
    """universe_match hands its MatchOptions to each weight matching (the FL keys weight-start, -head-cost and
    -mlp-cost travel this way): the old matcher still merges copies back, and the run config's keys reach it, an
    unknown value refused in one line naming the key and its choices."""
    from federation.settings import RunSettings

    cfg = CONFIGS["vit-odd"]
    copies = _copies(cfg, canonicalize(get_arch(cfg.family), random_native(cfg, 1), cfg), 3)
    old = WeightOptions(start="identity", head_cost="squared", mlp_cost="inner")
    result = universe_match(members(copies, [cfg] * 3), cfg, MergeOptions(match=MatchOptions(weight=old)))
    assert sq_distance(result.merged, copies[0]) < 1e-9
    keys = {"weight-start": "identity", "weight-head-cost": "squared", "weight-mlp-cost": "inner",
            "weight-biases": "read", "weight-ov-maps": "path"}
    assert RunSettings.from_run_config(keys).merge_options.match.weight == WeightOptions(
        start="identity", head_cost="squared", biases="read", ov_maps="path")
    for key, bad in (("weight-start", "nowhere"), ("weight-mlp-cost", "l2"), ("weight-biases", "some")):
        with pytest.raises(ConfigError, match=f"run-config key '{key}' must be one of .*; got '{bad}'"):
            RunSettings.from_run_config({key: bad})
    with pytest.raises(ConfigError, match="unknown weight-matching start 'nowhere'"):
        RunSettings(weight=WeightOptions(start="nowhere"))  # type: ignore[arg-type]


def test_small_weight_matchings_leave_the_gpu_for_the_cpu():
    """Where an iteration's matchings run, decided from the anchor (on the meta device: no GPU needed to ask):
    a small model's weight matching on the CPU, anything else where the anchor lives."""
    meta, cpu = torch.device("meta"), torch.device("cpu")
    small = {"w": torch.empty(HOST_MATCH_MAX_PARAMS, device=meta)}
    large = {"w": torch.empty(HOST_MATCH_MAX_PARAMS + 1, device=meta)}
    assert matching_device("weight", small) == cpu
    assert matching_device("weight", large) == meta
    assert matching_device("activation", small) == meta  # reads activations where the data and model run
    assert matching_device("weight", {"w": torch.zeros(3)}) == cpu


def test_maps_come_back_to_the_device_and_permutations_stay_on_the_host():
    """A transform found on the CPU for a model on a GPU: its continuous maps move (meta stands in for the GPU),
    its index permutations stay host tensors, as weight matching on a GPU leaves them."""
    cfg = CONFIGS["gpt2-odd"]
    t = random_transform(cfg, MATCHABLE, torch.Generator().manual_seed(0))
    moved = maps_to(t, torch.device("meta"))
    assert moved.residual is not None and moved.residual.device.type == "meta"
    assert all(m.device.type == "meta" for m in moved.qk + moved.ov if m is not None)
    assert all(p.device.type == "cpu" and torch.equal(p, q) for p, q in zip(moved.heads + moved.mlp,
                                                                            t.heads + t.mlp, strict=True)
               if p is not None)
    assert any(p is not None for p in moved.heads)


@pytest.mark.parametrize("views", ["merge", "members"])
def test_learned_refinement_across_widths_scores_the_merge_it_makes_and_leaves_narrow_models_in_place(views, caplog):
    """Across widths U is the coverage-weighted merge, not Σ w_i T_i(θ_i) (a narrow model's zeros would shrink what
    it lacks): the refinement's first validation loss is that merge's at its validation points (views "members":
    each model's share of the loss of its slice of it), from the aligned models weight matching gave; the narrow
    model keeps weight matching's transform, and every model its function."""
    from glmc.match.dual import _validation_points
    from glmc.match.learned import split
    from glmc.match.options import LearnConfig
    from glmc.merging.widths import lstsq_merge, project
    from glmc.train import token_loss
    from tests.symmetry_models import dataset

    wide = CONFIGS["vit-odd"]
    narrow = wide.replace(width=wide.width - 5, heads=wide.heads - 1, head_dim=wide.head_dim, mlp=wide.mlp // 2 + 1)
    arch, x, data = get_arch(wide.family), inputs(wide, n=3), dataset(wide, n=24)
    configs, weights = [wide, wide, narrow], [1.0, 2.0, 1.0]
    natives = [random_native(cfg, s) for s, cfg in enumerate(configs)]
    inputs_ = members([canonicalize(arch, n, c) for n, c in zip(natives, configs, strict=True)], configs, weights)
    learn = LearnConfig(steps=4, eval_every=1, batch_size=8, val_max=8, lr=0.05, dtype="float64", views=views)
    weight = universe_match(inputs_, wide, MergeOptions("weight", MatchOptions(learn=learn), max_iters=1))
    with caplog.at_level("INFO", logger="glmc.match.learned"):
        learned = universe_match(inputs_, wide, MergeOptions("learned", MatchOptions(learn=learn), max_iters=1),
                                 data=data)
    assert [r.method for r in learned.history] == ["weight", "refine"]
    started = next(r.args[0] for r in caplog.records if r.msg.startswith("learned matching: validation loss"))
    _, val = split(data, learn, None)
    vx, vy = (torch.stack(t) for t in zip(*val, strict=True))
    normalised = [w / sum(weights) for w in weights]
    shares = normalised if views == "members" else [1.0, 0.0, 0.0]
    kept = weight.placements[2]

    def scored(u):
        return (sum(shares[:2]) * float(token_loss(_logits(u, wide, vx), vy))
                + shares[2] * float(token_loss(_logits(project(u, kept), narrow, vx), vy)))

    losses = [scored(lstsq_merge(weight.aligned, weight.placements, p)) for p in _validation_points(normalised, 0)]
    assert started == pytest.approx(sum(losses) / len(losses), rel=1e-9)
    moved, before = learned.transforms[2], weight.transforms[2]
    assert torch.equal(moved.residual, before.residual)
    assert all(torch.equal(a, b) for a, b in zip([*moved.heads, *moved.mlp], [*before.heads, *before.mlp], strict=True))
    for native, cfg, aligned, p in zip(natives, configs, learned.aligned, learned.placements, strict=True):
        at = embedding_config(p) if cfg != wide else wide
        assert (_logits(aligned, at, x) - logits_of(native, cfg, x)).abs().max() <= 1e-6
