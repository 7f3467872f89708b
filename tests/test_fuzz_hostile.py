"""Fuzzing the strategy with well-formed hostile replies: 120 seeded attacks that pass validation, sent one at a time
beside three honest clients through every aggregation.

The attacks: example inflation (up to 10⁹), scaling (×10 to ×1000), sign flip and model replacement (boosted 1 to
20×), constant tensors (up to ±9999, with and without inflation) and width-tier spoofing (a node claiming another
tier than the one the server holds for it, with arrays of that tier). Expected: no exception out of
``aggregate_train``, a global model every round, spoofed replies dropped (the global model is then the honest-only
one, bit for bit), and otherwise the stated bound of glmc.merging.robust:

    ‖global − honest-only global‖ ≤ (clip-ratio + 1) · R,

R the largest distance of an honest client from the previous global model, both measured in the canonical form
(LayerNorms folded) in which the aligned aggregations average, and with the defaults (clip-ratio 5).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from conftest import synthetic_images
from flwr.app import ArrayRecord, Message
from test_strategy import CFG, merge_options, metrics, reply, state

from federation import protocol
from glmc.archs import build_model, get_arch
from glmc.core.config import scale_width
from glmc.match.options import LearnConfig
from glmc.merging.robust import Robustness, distance
from glmc.symmetry.canonical import canonicalize
from glmc.train import TrainConfig
from server.strategy import SymmetryAwareFedAvg
from server.validation import ReplySchema, check_reply

SEED = 20250101
CASES = 120
ATTACKER = 9
HONEST_STEP = 0.05
BOUND = Robustness().clip_ratio + 1  # in units of R

State = dict[str, torch.Tensor]
Attack = Callable[[np.random.Generator, State, State], tuple[State, dict[str, object]]]


def _shapes(tier: float) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in build_model(scale_width(CFG, tier)).state_dict().items()}


SCHEMA = ReplySchema({1.0: _shapes(1.0), 0.5: _shapes(0.5)})
GLOBAL = state(0)


def _honest(seed: int) -> State:
    g = torch.Generator().manual_seed(seed)
    return {k: v + HONEST_STEP * torch.randn(v.shape, generator=g) for k, v in GLOBAL.items()}


HONEST = [_honest(i) for i in range(3)]


def inflate(rng: np.random.Generator, trained: State, _: State) -> tuple[State, dict[str, object]]:
    return trained, {protocol.WEIGHT_KEY: int(10 ** rng.uniform(5, 9))}


def scale(rng: np.random.Generator, trained: State, _: State) -> tuple[State, dict[str, object]]:
    factor = float(10 ** rng.uniform(1, 3))
    return {k: factor * v for k, v in trained.items()}, {}


def signflip(rng: np.random.Generator, trained: State, g: State) -> tuple[State, dict[str, object]]:
    boost = float(rng.uniform(1, 20))
    return {k: g[k] - boost * (v - g[k]) for k, v in trained.items()}, {}


def replace(rng: np.random.Generator, trained: State, g: State) -> tuple[State, dict[str, object]]:
    target, boost = state(int(rng.integers(100, 10**6))), float(rng.uniform(1, 20))
    return {k: g[k] + boost * (target[k] - g[k]) for k in trained}, {}


def constant(rng: np.random.Generator, trained: State, _: State) -> tuple[State, dict[str, object]]:
    value = float(rng.choice([9999.0, -9999.0, rng.uniform(-9999, 9999)]))
    changes: dict[str, object] = {protocol.WEIGHT_KEY: 10**9} if rng.random() < 0.5 else {}
    return {k: torch.full_like(v, value) for k, v in trained.items()}, changes


def spoof_tier(rng: np.random.Generator, trained: State, _: State) -> tuple[State, dict[str, object]]:
    """Arrays of tier 0.5, well-formed for it, from a node the server holds at tier 1."""
    narrow = {k: torch.randn(shape) * 0.1 for k, shape in _shapes(0.5).items()}
    return narrow, {protocol.TIER_KEY: 0.5}


ATTACKS: list[Attack] = [inflate, scale, signflip, replace, constant, spoof_tier]


def hostile_cases() -> list[tuple[str, Message]]:
    """(name, reply) for CASES attacks, each kind equally often, each from a fresh honest fine-tune."""
    rng = np.random.default_rng(SEED)
    cases = []
    for i in range(CASES):
        kind = ATTACKS[i % len(ATTACKS)]
        arrays, changes = kind(rng, _honest(1000 + i), GLOBAL)
        record = metrics(examples=20_000, **changes)  # type: ignore[arg-type]
        cases.append((f"{kind.__name__} #{i}", reply({k: v.float() for k, v in arrays.items()}, record, node=ATTACKER)))
    return cases


def _strategy(aggregation: str) -> SymmetryAwareFedAvg:
    data = synthetic_images(48)
    s = SymmetryAwareFedAvg(aggregation, SCHEMA, CFG, min_train_nodes=2, server_data=data,
                            options=merge_options(learn=LearnConfig(steps=4, eval_every=2, batch_size=16, lr=0.05)),
                            tune=TrainConfig(epochs=1, batch_size=16, lr=0.05, threads=1))
    s.global_arrays = ArrayRecord(GLOBAL)  # type: ignore[arg-type]
    s.node_tiers[ATTACKER] = 1.0  # heard from before at full width
    return s


def _canonical(arrays: ArrayRecord | State) -> State:
    native = arrays.to_torch_state_dict() if isinstance(arrays, ArrayRecord) else arrays
    return canonicalize(get_arch(CFG.family), native, CFG, dtype=torch.float64)


def _honest_replies() -> list[Message]:
    return [reply(h, metrics(examples=20_000), node=i + 1) for i, h in enumerate(HONEST)]


def test_hostile_cases_are_well_formed_deterministic_and_varied() -> None:
    first, second = hostile_cases(), hostile_cases()
    assert len(first) >= 100 and [n for n, _ in first] == [n for n, _ in second]
    for name, msg in first:
        assert check_reply(msg, SCHEMA) is None, name  # every one passes validation as a first reply
    assert {n.split(" ")[0] for n, _ in first} == {a.__name__ for a in ATTACKS}


# Every case through FedAvg; the aggregations that match, refine or fine-tune take a stride of the cases, every
# attack kind included (the stride is coprime to the number of kinds), to keep this test within seconds.
STRIDES = {"fedavg": 1, "canonical": 5, "weight": 5, "activation": 7, "learned": 11, "fedavg-ft": 11}


@pytest.mark.parametrize("aggregation", list(STRIDES))
def test_hostile_replies_never_crash_and_stay_within_the_bound(aggregation: str) -> None:
    honest_only, _ = _strategy(aggregation).aggregate_train(1, _honest_replies())
    assert honest_only is not None
    reference = _canonical(honest_only)
    anchor = _canonical(GLOBAL)
    radius = max(distance(_canonical(h), anchor) for h in HONEST)
    cases = hostile_cases()[::STRIDES[aggregation]]
    assert {n.split(" ")[0] for n, _ in cases} == {a.__name__ for a in ATTACKS}
    worst = 0.0
    for name, bad in cases:
        s = _strategy(aggregation)
        arrays, _ = s.aggregate_train(1, [*_honest_replies(), bad])  # raises nothing, whatever the reply
        assert arrays is not None and s.current.failure is None, f"{name}: {s.current.failure}"
        moved = distance(_canonical(arrays), reference)
        if name.startswith("spoof_tier"):
            assert s.current.valid == 3 and "server holds tier 1" in s.current.dropped[0], name
            assert moved == 0.0, name
        worst = max(worst, moved / radius)
        assert moved <= BOUND * radius, f"{name}: moved {moved / radius:.2f} R, bound {BOUND} R"
    assert math.isfinite(worst)
