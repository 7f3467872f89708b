"""Robust aggregation (glmc.merging.robust) on its own and through the strategy on real flwr replies: the cap on
num-examples, update-norm clipping measured after alignment, FedMedian and FedTrimmedAvg (checked against numpy and
scipy), and the defaults leaving an honest round bit for bit as it was without them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
import torch
from flwr.app import ArrayRecord
from test_strategy import CFG, _permuted, as_numpy, logits, merge_options, metrics, reply, schema, state, strategy
from torch.utils.data import TensorDataset

from client.attacks import attack
from federation.protocol import Client
from federation.settings import RunSettings
from glmc.errors import ConfigError
from glmc.match.options import LearnConfig, MatchOptions
from glmc.merging.options import MergeOptions
from glmc.merging.robust import (
    Robustness,
    cap_examples,
    clip,
    coordinatewise,
    distance,
    recentre,
    recentre_round,
    screen,
    unclipped,
)
from glmc.train import TrainConfig
from server.aggregation import merge
from server.validation import check_reply
from simulations.attack_table import table


def _tuned(base: dict[str, torch.Tensor], seed: int, scale: float = 0.01) -> dict[str, torch.Tensor]:
    """A fine-tune of ``base``: a small seeded step away from it."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in base.items()}


def test_num_examples_are_capped_at_a_multiple_of_the_lower_median_and_at_the_budget() -> None:
    claimed = [20_000, 20_000, 20_000, 10**9]
    median_only = Robustness(peer_examples_ratio=0.0, max_examples_share=0.0)
    assert cap_examples(claimed, median_only) == [20_000, 20_000, 20_000, 100_000]
    budget = Robustness(max_examples=30_000, peer_examples_ratio=0.0, max_examples_share=0.0)
    assert cap_examples(claimed, budget) == [20_000] * 3 + [30_000]
    assert cap_examples(claimed, Robustness.off()) == claimed
    assert cap_examples([10**9, 5], median_only) == [25, 5]  # the lower median: one of two cannot set its own cap


def test_no_node_outweighs_the_heaviest_other_by_more_than_the_peer_ratio() -> None:
    """The peer cap (1.6, the default): an inflated claim weighs at most 1.6 × the heaviest honest node; the
    published splits' heaviest node holds at most 1.54 × the second's, so they pass untouched."""
    assert cap_examples([20_000, 20_000, 20_000, 10**9], Robustness()) == [20_000] * 3 + [32_000]
    assert cap_examples([1_296, 2_000, 4_980, 3_000], Robustness()) == [1_296, 2_000, 4_800, 3_000]
    assert cap_examples([10, 40, 20], Robustness(peer_examples_ratio=1.5, max_examples_share=0.0)) == [10, 30, 20]
    assert cap_examples([30, 10], Robustness()) == [30, 10]  # a pair: one node is no peer to judge the other by
    split = [2_966, 3_965, 7_174, 18_064, 27_831]  # drift's Dirichlet 0.1 over 5 nodes: 1.54 ×, 0.46 of the round
    assert cap_examples(split, Robustness()) == split


def test_no_node_keeps_half_of_a_round_of_four_or_more() -> None:
    """The share cap (0.49, the default): with four or more replies, a common level under which no node keeps more
    than 0.49 of the round, whatever the others claim (the peer and median caps alone let 1.6 × the second heaviest
    outweigh a round whose other nodes are light)."""
    only = Robustness(max_examples_ratio=0.0, peer_examples_ratio=0.0)
    capped = cap_examples([100, 1, 1, 1], only)
    assert capped[1:] == [1, 1, 1] and max(capped) / sum(capped) == pytest.approx(0.49, abs=1e-9)
    assert max(capped) / sum(capped) <= 0.49
    for weights in ([1, 5, 5, 10**9], [3, 1, 1, 1, 10**9], [100, 100, 1, 1], [10**9, 10**9, 1, 1]):
        shares = cap_examples(weights, Robustness())
        assert max(shares) / sum(shares) < 0.5, weights
    assert cap_examples([10, 20, 30], only) == [10, 20, 30]  # three replies: an honest half is left alone


def test_clipping_pulls_a_far_client_back_along_its_update_to_the_bound() -> None:
    center = state(0)
    states = [_tuned(center, i) for i in range(3)] + [_tuned(center, 9, scale=3.0)]
    result = clip(states, [center] * 4, ratio=2.0)
    median = sorted(distance(s, center) for s in states)[1]
    assert result.clipped == 1 and result.states[:3] == states[:3]  # the same objects: untouched
    assert all(a is b for a, b in zip(result.states[:3], states[:3], strict=True))
    assert distance(result.states[3], center) == pytest.approx(2.0 * median, rel=1e-5)
    update = torch.cat([(states[3][k] - center[k]).reshape(-1) for k in center])
    moved = torch.cat([(result.states[3][k] - center[k]).reshape(-1) for k in center])
    assert torch.nn.functional.cosine_similarity(update, moved, dim=0) > 1 - 1e-6
    assert result.spread == pytest.approx(distance(states[3], center) / median)


def test_one_attacker_cannot_raise_the_clipping_bound_past_the_largest_honest_distance() -> None:
    center = state(0)
    honest = [_tuned(center, i, scale=0.01 * (i + 1)) for i in range(3)]
    for scale in (10.0, 1e3):
        result = clip([*honest, _tuned(center, 9, scale=scale)], [center] * 4, ratio=1.0)
        assert distance(result.states[3], center) <= max(distance(h, center) for h in honest) * (1 + 1e-6)


def test_recentring_pulls_a_client_beyond_the_median_distance_back_toward_the_coordinatewise_median() -> None:
    center = state(0)
    states = [_tuned(center, i, scale=0.01 * (i + 1)) for i in range(3)] + [_tuned(center, 9, scale=1.0)]
    result = recentre(unclipped(states), ratio=1.0)
    median = coordinatewise(states, "fedmedian", 0.0)
    distances = [distance(s, median) for s in states]
    bound = sorted(distances)[1]  # the lower median
    assert result.recentred == sum(d > bound * (1 + 1e-9) for d in distances) >= 1
    for before, after, d in zip(states, result.states, distances, strict=True):
        assert after is before if d <= bound else distance(after, median) == pytest.approx(bound, rel=1e-5)
    assert recentre(unclipped(states), ratio=0.0).states == states  # off
    assert recentre(unclipped(states[:2]), ratio=1.0).recentred == 0  # two clients: nothing to take a median of


def test_recentring_leaves_free_riders_out_of_the_center_and_the_scale() -> None:
    center = state(0)
    trained = [_tuned(center, i, scale=0.01 * (i + 1)) for i in range(3)]
    clipping = clip([*trained, center, center, center], [center] * 6, ratio=5.0)
    result = recentre(clipping, ratio=1.0)
    assert all(s is center for s in result.states[3:]) and result.unmoved == 3 and result.recentred >= 1
    alone = recentre(unclipped(trained), ratio=1.0).states
    assert all(torch.equal(a[k], b[k]) for a, b in zip(result.states[:3], alone, strict=True) for k in center)


def test_one_attacker_cannot_raise_the_recentring_bound_past_the_farthest_honest_client() -> None:
    """Among three honest clients, an attacker of any size ends no farther from the round's median than the farthest
    honest client sits from it: the lower median of four distances is at most the second largest."""
    center = state(0)
    honest = [_tuned(center, i, scale=0.02) for i in range(3)]
    for scale in (0.03, 1.0, 1e3):
        states = [*honest, _tuned(center, 9, scale=scale)]
        median = coordinatewise(states, "fedmedian", 0.0)
        result = recentre(unclipped(states), ratio=1.0)
        assert distance(result.states[3], median) <= max(distance(h, median) for h in honest) * (1 + 1e-6)


def test_a_client_with_k_times_the_lower_median_examples_may_sit_k_times_as_far_from_the_median() -> None:
    """Trained by whole epochs, a heavier node takes more steps and sits farther out: its recentring bound grows
    with its weight over the lower median weight, up to the largest other weight (its own claim cannot raise it),
    never below the common bound; off, it is pulled to that bound."""
    center = state(0)
    states = [_tuned(center, i, scale=0.01 * (i + 1)) for i in range(3)] + [_tuned(center, 9, scale=0.2)]
    median = coordinatewise(states, "fedmedian", 0.0)
    distances = [distance(s, median) for s in states]
    scale = sorted(distances)[1]
    k = distances[3] / scale
    assert k > 2
    covered = [10, 10, 10 * k * 1.01, 10 * k * 1.01]  # a peer as heavy: the allowance reaches k × 1.01
    assert recentre(unclipped(states), 1.0, covered).states[3] is states[3]
    for weights, allowed in (([10, 10, 10 * k / 2, 10 * k], k / 2),  # capped at the heaviest other's
                             ([10, 10, 10, 10 * k], 1.0),  # alone in its weight: no allowance
                             ([40, 40, 40, 1], 1.0)):  # a light node keeps the common bound
        held = recentre(unclipped(states), 1.0, weights).states[3]
        assert distance(held, median) == pytest.approx(scale * allowed, rel=1e-5)
    off = recentre_round(unclipped(states), Robustness(center_clip_by_examples=False), covered).states[3]
    assert distance(off, median) == pytest.approx(scale, rel=1e-5)


def test_an_attacker_claiming_every_example_gets_no_allowance_over_equal_honest_clients() -> None:
    """Its capped weight (1.6 × the heaviest honest node's) is above every other, so its allowance is the heaviest
    honest node's, 1: it ends no farther from the median than the farthest honest client."""
    center = state(0)
    honest = [_tuned(center, i, scale=0.02) for i in range(3)]
    weights = cap_examples([20, 20, 20, 10**9], Robustness())
    assert weights[3] > 20
    for scale in (1.0, 1e3):
        states = [*honest, _tuned(center, 9, scale=scale)]
        median = coordinatewise(states, "fedmedian", 0.0)
        result = recentre_round(unclipped(states), Robustness(), weights)
        assert distance(result.states[3], median) <= max(distance(h, median) for h in honest) * (1 + 1e-6)


def test_screen_leaves_a_client_in_another_basis_alone_and_clips_a_runaway() -> None:
    center = state(0)
    moved = _permuted(_tuned(center, 1), seed=3)  # far from the center in this basis, not in norm
    runaway = {k: torch.full_like(v, 9999.0) for k, v in center.items()}
    result = screen([_tuned(center, 2), _tuned(center, 3), moved, runaway], [center] * 4, ratio=5.0)
    assert result.factors[:3] == [1.0, 1.0, 1.0] and result.states[2] is moved
    assert result.factors[3] < 1e-4


@pytest.mark.parametrize("n", [3, 4, 5, 7])
def test_fedmedian_and_fedtrimmedavg_are_numpys_median_and_scipys_trimmed_mean(n: int) -> None:
    states = [_tuned(state(0), i, scale=1.0) for i in range(n)]
    median = coordinatewise(states, "fedmedian", 0.2)
    trimmed = coordinatewise(states, "fedtrimmedavg", 0.2)
    for key in states[0]:
        stacked = np.stack([s[key].double().numpy() for s in states])
        np.testing.assert_allclose(median[key].numpy(), np.median(stacked, axis=0), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(trimmed[key].numpy(), scipy.stats.trim_mean(stacked, 0.2, axis=0),
                                   rtol=1e-6, atol=1e-7)


def _round(aggregation: str, replies: list, robust: Robustness, anchor: dict[str, torch.Tensor]) -> tuple:
    s = strategy(aggregation, options=merge_options(robustness=robust, min_gain=0.0))
    s.global_arrays = ArrayRecord(anchor)  # type: ignore[arg-type]
    arrays, _ = s.aggregate_train(1, replies)
    assert arrays is not None, s.current.failure
    return as_numpy(arrays), s.current


@pytest.mark.parametrize("aggregation", ["fedavg", "weight", "canonical"])
def test_free_riders_do_not_freeze_a_round(aggregation: str) -> None:
    """3 clients that trained and 3 that sent the global model back unchanged: the global model moves as FedAvg over
    the six would (half the step of the trained clients' mean, those as recentring leaves them: the free riders set
    neither its center nor its scale; the aligned merges average LayerNorm-folded models, which is not linear in the
    native weights, so there within 10%), not 0, which is what clipping at a multiple of a lower median of 0 gave.
    The round counts the clients that did not move."""
    anchor = state(0)
    trained = [_tuned(anchor, i) for i in range(3)]
    replies = [reply(s, metrics(examples=10), node=i + 1) for i, s in enumerate([*trained, anchor, anchor, anchor])]
    merged, record = _round(aggregation, replies, Robustness(), anchor)
    held = recentre(unclipped(trained), Robustness().center_clip_ratio).states
    moved = math.sqrt(sum(float(((torch.from_numpy(merged[k]) - anchor[k]) ** 2).sum()) for k in anchor))
    mean = {k: sum(s[k] for s in held) / 3 for k in anchor}
    assert moved == pytest.approx(distance(mean, anchor) / 2, rel=1e-3 if aggregation == "fedavg" else 0.1)
    if aggregation == "fedavg":
        assert all(np.allclose(merged[k], ((mean[k] + anchor[k]) / 2).numpy(), atol=1e-6) for k in anchor)
    assert record.clipped == 0 and record.unmoved == 3


def test_drop_unchanged_drops_the_free_riders_with_the_reason() -> None:
    """drop-unchanged: replies identical to the model their node was sent are dropped, named; the round is then the
    FedAvg of the clients that trained (as recentring leaves them)."""
    anchor = state(0)
    trained = [_tuned(anchor, i) for i in range(3)]
    replies = [reply(s, metrics(examples=10), node=i + 1) for i, s in enumerate([*trained, anchor, anchor])]
    s = strategy("fedavg", drop_unchanged=True)
    s.global_arrays = ArrayRecord(anchor)  # type: ignore[arg-type]
    arrays, _ = s.aggregate_train(1, replies)
    assert arrays is not None and s.current.valid == 3 and len(s.current.dropped) == 2
    assert all("identical to the model it was sent (drop-unchanged" in line for line in s.current.dropped)
    mean = {k: sum(x[k] for x in recentre(unclipped(trained), 1.0).states) / 3 for k in anchor}
    assert all(np.allclose(v, mean[k].numpy(), atol=1e-6) for k, v in as_numpy(arrays).items())
    assert RunSettings.from_run_config({"drop-unchanged": True}).drop_unchanged


def test_a_clipping_reference_is_taken_over_the_clients_that_moved() -> None:
    center = state(0)
    trained = [_tuned(center, i, scale=0.01 * (i + 1)) for i in range(3)]
    result = clip([*trained, center, center, center, _tuned(center, 9, scale=1.0)], [center] * 7, ratio=5.0)
    assert result.clipped == 1 and result.factors[:6] == [1.0] * 6
    moved = sorted(distance(s, center) for s in [*trained, result.states[6]])
    assert distance(result.states[6], center) == pytest.approx(5 * moved[1], rel=1e-6)  # 5 × the lower median
    assert clip([center, center], [center, center], ratio=5.0).factors == [1.0, 1.0]  # nobody moved: nothing to clip


def _honest_replies(anchor: dict[str, torch.Tensor]) -> tuple[list, list]:
    """Three honest clients of 25, 20 and 10 examples: under every cap (the heaviest holds 1.25 × the second's and
    0.45 of the round); the one that moved farthest holds the fewest, so no example allowance covers it."""
    tuned = [_tuned(anchor, i, scale=0.01 * (i + 1)) for i in range(3)]
    return tuned, [reply(s, metrics(examples=n), node=i + 1) for i, (s, n) in enumerate(zip(tuned, (25, 20, 10),
                                                                                          strict=True))]


@pytest.mark.parametrize("aggregation", ["fedavg", "weight", "canonical"])
def test_the_caps_and_the_global_clip_leave_an_honest_round_bit_for_bit(aggregation: str) -> None:
    """The caps and clip-ratio 5 sit above this honest round: without the centred clipping it ends on the bits of no
    defence."""
    anchor = state(0)
    _, replies = _honest_replies(anchor)
    defended, record = _round(aggregation, replies, Robustness(center_clip_ratio=0.0), anchor)
    plain, _ = _round(aggregation, replies, Robustness.off(), anchor)
    assert all(np.array_equal(defended[k], plain[k]) for k in plain)
    assert record.capped == record.clipped == record.clipped_before == record.recentred == 0
    assert 1 < record.spread < 5


@pytest.mark.parametrize("aggregation", ["fedavg", "weight", "canonical"])
def test_at_the_defaults_an_honest_round_changes_by_the_recentring_alone(aggregation: str) -> None:
    """The centred clipping touches an honest round: the clients farther from the round's median than the lower
    median's distance are pulled in to it; nothing is capped or clipped around the global model. Under fedavg the
    round is then the weighted mean of those clients by hand."""
    anchor = state(0)
    tuned, replies = _honest_replies(anchor)
    defended, record = _round(aggregation, replies, Robustness(), anchor)
    assert record.recentred == 1 and record.capped == record.clipped == record.clipped_before == 0
    assert record.center_spread is not None and record.center_spread > 1
    if aggregation == "fedavg":
        held = recentre(unclipped(tuned), 1.0, [25, 20, 10]).states
        by_hand = {k: (25 * held[0][k] + 20 * held[1][k] + 10 * held[2][k]) / 55 for k in anchor}
        assert all(np.allclose(defended[k], by_hand[k].numpy(), atol=1e-6) for k in anchor)


def test_clipping_is_measured_after_alignment() -> None:
    """A client sent back in another basis (the same function) is far from the global model before matching and near
    it after: weight matching leaves it unclipped and merges it as if sent in the global basis; FedAvg, which does
    not align, clips it."""
    anchor = state(0)
    tuned = [_tuned(anchor, i) for i in range(4)]
    counts = (10, 20, 30, 40)
    replies = [reply(t, metrics(examples=n), node=i + 1) for i, (t, n) in enumerate(zip(tuned, counts, strict=True))]
    moved = [*replies[:3], reply(_permuted(tuned[3], seed=5), metrics(examples=40), node=4)]
    aligned, record = _round("weight", moved, Robustness(clip_ratio=2.0), anchor)
    reference, _ = _round("weight", replies, Robustness(clip_ratio=2.0), anchor)
    assert record.clipped == record.clipped_before == 0
    x = torch.randn(4, 1, 8, 8)
    as_torch = {k: torch.from_numpy(v) for k, v in aligned.items()}
    torch.testing.assert_close(logits(as_torch, x), logits({k: torch.from_numpy(v) for k, v in reference.items()}, x),
                               rtol=1e-4, atol=1e-4)
    _, unaligned = _round("fedavg", moved, Robustness(clip_ratio=2.0), anchor)
    assert unaligned.clipped == 1


def test_fedmedian_keeps_every_coordinate_within_the_honest_clients_range() -> None:
    anchor = state(0)
    honest = [_tuned(anchor, i, scale=0.05) for i in range(4)]
    attacker = {k: 1000 * v for k, v in honest[0].items()}
    replies = [reply(h, metrics(examples=10), node=i + 1) for i, h in enumerate(honest)]
    merged, _ = _round("fedavg", [*replies, reply(attacker, metrics(examples=10**9), node=9)],
                       Robustness(average="fedmedian"), anchor)
    for key in anchor:
        stacked = torch.stack([h[key] for h in honest]).numpy()
        assert (merged[key] >= stacked.min(0) - 1e-6).all() and (merged[key] <= stacked.max(0) + 1e-6).all()


@pytest.mark.parametrize(("changes", "message"), [
    ({"robust-average": "fedmedian", "width-tiers": "1,0.5"}, "equal-width"),
    ({"robust-average": "krum"}, "robust-average must be one of"),
    ({"clip-ratio": 0.5}, "clip-ratio below 1"),
    ({"max-examples-ratio": -1.0}, ">= 0"),
    ({"trim-beta": 0.5}, "trim-beta"),
])
def test_robust_settings_are_checked(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        RunSettings.from_run_config(changes)
    assert "\n" not in str(err.value)
    keys = {"robust-average": "fedtrimmedavg", "trim-beta": 0.3}
    assert RunSettings.from_run_config(keys).robustness.trim_beta == 0.3


def test_the_attack_hook_makes_well_formed_replies_of_each_attack() -> None:
    """client.attacks: every attack passes validation; sign flip and replacement move from the received model."""
    received, trained = state(0), _tuned(state(0), 1)
    for kind in ("none", "inflate", "scale", "signflip", "replace", "constant"):
        sent, changes = attack(kind, trained, received, CFG, boost=5.0, seed=7)
        assert check_reply(reply(sent, metrics(**changes)), schema()) is None, kind  # type: ignore[arg-type]
        if kind == "signflip":
            for k in received:
                torch.testing.assert_close(sent[k], received[k] - 5.0 * (trained[k] - received[k]))
    assert attack("inflate", trained, received, CFG, 5.0, 7)[1] == {"num-examples": 10**9}


def test_the_attack_table_sets_each_cell_against_fedavg_without_an_attacker_and_names_failed_runs():
    def row(split: str, aggregation: str, accuracy: float | None, status: str = "finished:completed") -> dict:
        records = [] if accuracy is None else [{"round": 1, "central_accuracy": accuracy}]
        return {"split": split, "aggregation": aggregation, "seed": 0, "status": status, "details": "why",
                "records": records}

    text = table([row("no-attack", "fedavg-undefended", 0.5), row("no-attack", "fedmedian", 0.55),
                  row("scale", "fedavg-undefended", None, "failed:not-aggregated"), row("scale", "fedmedian", 0.4)])
    lines = text.splitlines()
    assert lines[2] == "| no-attack | 50.0 (+0.0) | 55.0 (+5.0) |"
    assert lines[3] == "| scale | failed | 40.0 (-10.0) |"
    assert lines[-1] == "- failed, scale × fedavg-undefended (seed 0): failed:not-aggregated, why"


def _distilled(aggregation: str, states: list[dict[str, torch.Tensor]], robust: Robustness,
               anchor: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One round of ``aggregation`` distilled to the clients' predictions on 16 server images (labels unread)."""
    data = TensorDataset(torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(0)), torch.zeros(16).long())
    clients = [Client(s, 10.0, 1.0) for s in states]
    tune = TrainConfig(epochs=1, batch_size=8, lr=1e-2, seed=5, threads=1)
    options = MergeOptions(max_iters=1, match=MatchOptions(learn=LearnConfig(targets="endpoints")), robustness=robust)
    result = merge(clients, CFG, aggregation, options, anchor=anchor, data=data, tune=tune)
    assert result.state is not None
    return result.state


@pytest.mark.parametrize("aggregation", ["fedavg-ft", "server-only"])
def test_a_distillation_teacher_reads_the_clients_as_clipped(aggregation: str) -> None:
    """A client whose weights are scaled 1000× teaches as its clipped self (the model the average sees), not as the
    confident model it sent."""
    anchor = state(0)
    honest = [_tuned(anchor, i, scale=0.05) for i in range(3)]
    attacker = {k: 1000 * v for k, v in honest[0].items()}
    clipped = clip([*honest, attacker], [anchor] * 4, Robustness().clip_ratio).states[3]
    defended = _distilled(aggregation, [*honest, attacker], Robustness(), anchor)
    by_hand = _distilled(aggregation, [*honest, clipped], Robustness(), anchor)
    undefended = _distilled(aggregation, [*honest, attacker], Robustness.off(), anchor)
    x = torch.randn(32, 1, 8, 8)
    gap = (logits(defended, x) - logits(by_hand, x)).abs().max()
    assert gap < 1e-4 < (logits(defended, x) - logits(undefended, x)).abs().max()
