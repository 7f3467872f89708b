"""The robust defaults against one attacker among three honest clients, under every aggregation, through the real
strategy on real flwr replies (simulations.bench.single_attacker's vit-tiny clients): no attack moves the aggregate
further from the honest clients' own than the farthest honest client does when it is the one added, and no reply
keeps half of a round's weight once four or more replied."""

from __future__ import annotations

import pytest

from federation.settings import AGGREGATIONS
from glmc.merging.robust import Robustness
from simulations.bench.single_attacker import OLD, influence, largest_share


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_one_attacker_moves_the_aggregate_no_further_than_the_farthest_honest_client(aggregation: str) -> None:
    ratios = influence(aggregation, Robustness())
    targets = {"10^9 examples", "x1000", "all 9999", "sign flip x10"}
    assert set(ratios) == targets | {"sign flip x10, 10^9 examples"}
    assert all(ratios[name] <= 1.0 for name in targets), ratios


def test_the_example_allowance_gives_a_heavy_attacker_nothing_over_equal_honest_clients() -> None:
    """The recentring bound grows with a node's weight only up to the heaviest other node's, so a sign flip that
    also claims 10⁹ examples lands where it lands under one bound for all (at the target's edge, 1.00)."""
    combined = "sign flip x10, 10^9 examples"
    allowed = influence("fedavg", Robustness())[combined]
    assert allowed == pytest.approx(influence("fedavg", Robustness(center_clip_by_examples=False))[combined], rel=1e-6)
    assert allowed < 1.05


@pytest.mark.parametrize("replies", [4, 5, 8])
def test_no_reply_keeps_half_the_weight_of_a_round_of_four_or_more(replies: int) -> None:
    assert largest_share(Robustness(), replies) < 0.5
    assert largest_share(OLD, 4) > 0.5  # the old defaults let 10⁹ examples weigh 5 × the median: 5/8 of the round


def test_the_old_defaults_missed_the_target() -> None:
    """What the peer cap and the centred clipping changed: at the old defaults (cap 5, clip 5) every attack moved
    FedAvg's round more than 3 times as far as the farthest honest client did."""
    assert min(influence("fedavg", OLD).values()) > 3
