"""Server momentum (server.momentum): the heavy-ball step against a hand computation, through the strategy over
rounds (a round that keeps the global model ends the momentum), and its settings and resume state refused in one
line where they cannot hold."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord

from federation.settings import RunSettings
from glmc.errors import ConfigError
from server.hooks import round_before
from server.momentum import PLAIN, ServerStep
from tests.test_strategy import metrics, reply, state, strategy

STEP = ServerStep(lr=0.1, momentum=0.9)


def _replies(seed: int) -> list:
    return [reply(state(seed + i), metrics(examples=n), node=i + 1) for i, n in enumerate((10, 20, 30))]


def _merge(seed: int, around: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain server's merge of round ``seed``'s replies around the global model ``around`` (clipped there as
    the momentum server's are): what the momentum server steps toward."""
    s = strategy()
    s.global_arrays = ArrayRecord(around)  # type: ignore[arg-type]
    arrays, _ = s.aggregate_train(1, _replies(seed))
    assert arrays is not None
    return arrays.to_torch_state_dict()


def test_the_step_is_the_heavy_ball_by_hand_and_keeps_index_buffers() -> None:
    current = {"w": torch.tensor([1.0, 2.0]), "i": torch.tensor([0, 1])}
    before = {"w": torch.tensor([0.5, 2.5]), "i": torch.tensor([0, 1])}
    merged = {"w": torch.tensor([3.0, 0.0]), "i": torch.tensor([1, 0])}
    out = STEP(current, before, merged)
    assert torch.allclose(out["w"], torch.tensor([1 + 0.1 * 2 + 0.9 * 0.5, 2 - 0.1 * 2 - 0.9 * 0.5]))
    assert torch.equal(out["i"], merged["i"])
    assert torch.allclose(STEP(current, None, merged)["w"], torch.tensor([1.2, 1.8]))  # round 1: no step yet
    assert PLAIN.plain and not STEP.plain


def test_the_strategy_steps_toward_each_merge_with_the_step_it_took_before() -> None:
    """Three rounds: θ1 = θ0 + η(m1 − θ0); θ2 = θ1 + η(m2 − θ1) + β(θ1 − θ0); a round with too few replies keeps
    θ2; the round after steps from θ2 with no momentum (the global model's last step was none)."""
    s = strategy(server_step=STEP)
    theta = [state(50)]
    s.global_arrays = ArrayRecord(theta[0])  # type: ignore[arg-type]
    for r, before in ((1, None), (2, theta[0])):
        arrays, _ = s.aggregate_train(r, _replies(10 * r))
        assert arrays is not None
        expected = STEP(theta[-1], before, _merge(10 * r, theta[-1]))
        got = arrays.to_torch_state_dict()
        assert all(torch.equal(got[k], expected[k]) for k in expected)
        theta.append(got)
    assert s.aggregate_train(3, _replies(30)[:1]) == (None, None)  # one valid reply < min-train-nodes 2
    arrays, _ = s.aggregate_train(4, _replies(40))
    assert arrays is not None
    expected = STEP(theta[2], theta[2], _merge(40, theta[2]))
    assert all(torch.equal(arrays.to_torch_state_dict()[k], expected[k]) for k in expected)
    carried = STEP(theta[2], theta[1], _merge(40, theta[2]))
    assert any(not torch.equal(arrays.to_torch_state_dict()[k], carried[k]) for k in carried)  # not carried on


def test_server_momentum_settings_and_resume_state_are_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="server-momentum in"):
        RunSettings(server_momentum=1.0)
    with pytest.raises(ConfigError, match="server-learning-rate must be > 0"):
        RunSettings(server_learning_rate=0.0)
    assert round_before(tmp_path, 0) is None
    with pytest.raises(ConfigError, match="resume under server-momentum needs round 2's global model"):
        round_before(tmp_path, 3)
