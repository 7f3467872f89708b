"""The width-heterogeneous baselines against hand computations on a tiny ViT (2 heads, width 16, MLP 32; its half
has 1 head, width 8, MLP 16): FedRolex's rolling windows, smallest-width's FedAvg at the smallest tier,
full-width-only's FedAvg of the full tier, and the per-tier records they are compared by."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord
from test_flower_sim import needs_data, run_in_process, server_identity  # noqa: F401  (a fixture, used by name)
from test_strategy import CFG, HALF, as_numpy, half_state, instruction, metrics, mixed_strategy, reply, state

from federation import protocol
from federation.restriction import received, restrict
from federation.settings import RunSettings
from glmc.core.config import preset, scale_width
from glmc.errors import ConfigError
from glmc.io.checkpoint import load_checkpoint
from server.records import RoundRecord, rounds_to_target

FC1, QKV, PROJ = "blocks.0.mlp.fc1.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight"


def window(offset: int, kept: int, units: int) -> torch.Tensor:
    """FedRolex's window written out: units (offset + i) mod n, i < k."""
    return torch.tensor([(offset + i) % units for i in range(kept)])


def qkv_rows(head: int) -> torch.Tensor:
    """The fused q|k|v rows of one head: its d_h rows in each of the three (H·d_h)-row blocks."""
    dh, rows = CFG.head_dim, CFG.heads * CFG.head_dim
    return torch.cat([torch.arange(b * rows + head * dh, b * rows + (head + 1) * dh) for b in range(3)])


@pytest.mark.parametrize("server_round", [3, 13])  # 13: the residual and MLP windows wrap around
def test_fedrolex_averages_each_entry_over_the_clients_holding_it_at_the_rolled_indices(server_round: int) -> None:
    full, half = state(1), half_state(2)
    s = mixed_strategy("fedrolex")
    s.current = RoundRecord(server_round)
    arrays, _ = s.aggregate_train(server_round, [reply(full, metrics(examples=30), node=1),
                                                 reply(half, metrics(examples=10, **{protocol.TIER_KEY: 0.5}), node=2)])
    assert arrays is not None
    merged = {k: torch.from_numpy(v) for k, v in as_numpy(arrays).items()}
    res, mlp = window(server_round, HALF.width, CFG.width), window(server_round, HALF.mlp, CFG.mlp)
    head = server_round % CFG.heads
    held = full[FC1][mlp][:, res]
    torch.testing.assert_close(merged[FC1][mlp][:, res], (30 * held + 10 * half[FC1]) / 40)
    torch.testing.assert_close(merged[QKV][qkv_rows(head)][:, res], (30 * full[QKV][qkv_rows(head)][:, res]
                                                                      + 10 * half[QKV]) / 40)
    cols = torch.arange(head * CFG.head_dim, (head + 1) * CFG.head_dim)
    torch.testing.assert_close(merged[PROJ][res][:, cols], (30 * full[PROJ][res][:, cols] + 10 * half[PROJ]) / 40)
    # the full client alone holds every other entry: there the merge is its model
    others = torch.ones(CFG.mlp, CFG.width, dtype=torch.bool)
    others[mlp[:, None], res[None, :]] = False
    torch.testing.assert_close(merged[FC1][others], full[FC1][others])


def test_fedrolex_keeps_what_nobody_holds_and_sends_the_window_it_merges() -> None:
    s = mixed_strategy("fedrolex")
    s.current = RoundRecord(5)
    arrays, _ = s.aggregate_train(5, [reply(half_state(2), metrics(**{protocol.TIER_KEY: 0.5}), node=2)])
    assert arrays is not None
    merged = {k: torch.from_numpy(v) for k, v in as_numpy(arrays).items()}
    res, mlp = window(5, HALF.width, CFG.width), window(5, HALF.mlp, CFG.mlp)
    torch.testing.assert_close(merged[FC1][mlp][:, res], half_state(2)[FC1])
    outside = torch.ones(CFG.mlp, dtype=torch.bool)
    outside[mlp] = False
    torch.testing.assert_close(merged[FC1][outside], state(0)[FC1][outside])  # the global model's, untouched
    # round 5's downlink to the node is that window; a new node restricts the full model to the same one
    [message] = s.restrict_to_widths([instruction(2)], arrays, 5)
    sent = message.content[protocol.ARRAYS].to_torch_state_dict()
    assert all(torch.equal(sent[k], v) for k, v in half_state(2).items())
    own = received(merged, CFG, 0.5, "fedrolex", RunSettings.narrow_placement, 5)
    assert all(torch.equal(own[k], sent[k]) for k in sent)
    # the next round's window has moved one unit along every axis
    nxt = restrict(merged, CFG, 0.5, "fedrolex", server_round=6)
    torch.testing.assert_close(nxt[FC1], merged[FC1][window(6, HALF.mlp, CFG.mlp)][:, window(6, HALF.width, CFG.width)])


def test_fedrolex_at_round_zero_and_full_clients_are_heterofl() -> None:
    """Offset 0 is HeteroFL's leading slice; a full-width client holds every unit in place whatever the round."""
    g = state(3)
    assert all(torch.equal(a, b) for a, b in zip(restrict(g, CFG, 0.5, "fedrolex").values(),
                                                 restrict(g, CFG, 0.5, "fedavg", server_round=7).values(), strict=True))
    s = mixed_strategy("fedrolex")
    s.current = RoundRecord(7)
    arrays, _ = s.aggregate_train(7, [reply(state(1), metrics(examples=30), node=1),
                                      reply(state(2), metrics(examples=10), node=3)])
    assert arrays is not None
    merged = as_numpy(arrays)
    for k, v in state(1).items():
        torch.testing.assert_close(torch.from_numpy(merged[k]), (30 * v + 10 * state(2)[k]) / 40)


def test_full_width_only_averages_the_full_tier_and_counts_the_narrow_left_out() -> None:
    s = mixed_strategy("full-width-only")
    arrays, _ = s.aggregate_train(1, [reply(state(1), metrics(examples=30), node=1),
                                      reply(state(2), metrics(examples=20), node=3),
                                      reply(half_state(4), metrics(examples=10, **{protocol.TIER_KEY: 0.5}), node=2)])
    assert arrays is not None
    merged = as_numpy(arrays)
    for k, v in state(1).items():
        torch.testing.assert_close(torch.from_numpy(merged[k]), (30 * v + 20 * state(2)[k]) / 50)
    assert (s.current.valid, s.current.left_out, s.node_tiers[2]) == (3, 1, 0.5)


def test_full_width_only_keeps_the_global_model_when_no_full_client_replied() -> None:
    s = mixed_strategy("full-width-only")
    arrays, _ = s.aggregate_train(1, [reply(half_state(4), metrics(**{protocol.TIER_KEY: 0.5}), node=2)])
    assert arrays is None and s.current.left_out == 1


def test_smallest_width_trains_every_client_at_the_smallest_tier_and_averages_there() -> None:
    settings = RunSettings(aggregation="smallest-width", width_tiers=(1.0, 0.5, 0.25), model="vit-bench")
    assert settings.global_width == 0.25 and settings.trained_tiers == (1.0,)
    assert {settings.tier_of(p) for p in range(6)} == {settings.tier_of(0, 0.5)} == {1.0}
    from federation.data import base_config

    assert base_config("fashion-mnist", "vit-bench", (), width=0.25) == scale_width(preset("vit-bench"), 0.25)
    # the server's FedAvg at that width is flwr's: every reply at tier 1 of the global (small) model
    s = mixed_strategy("smallest-width")
    s.model_config = HALF
    s.schema = type(s.schema)({1.0: {k: tuple(v.shape) for k, v in half_state(0).items()}})
    s.global_arrays = ArrayRecord(half_state(0))  # type: ignore[arg-type]
    arrays, _ = s.aggregate_train(1, [reply(half_state(1), metrics(examples=30), node=1),
                                      reply(half_state(2), metrics(examples=10), node=2)])
    assert arrays is not None
    merged = as_numpy(arrays)
    for k, v in half_state(1).items():
        torch.testing.assert_close(torch.from_numpy(merged[k]), (30 * v + 10 * half_state(2)[k]) / 40)


def test_smallest_width_refuses_a_full_width_init_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "m.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="smallest-width"):
        RunSettings(aggregation="smallest-width", init=str(tmp_path / "m.safetensors"))


def test_rounds_to_target_is_each_tiers_first_round_at_the_target() -> None:
    records = [RoundRecord(r, tier_metrics={"accuracy@1": a, "accuracy@0.5": b})
               for r, a, b in ((0, 0.1, 0.1), (1, 0.72, 0.4), (2, 0.6, 0.71), (3, 0.8, 0.75))]
    assert rounds_to_target(records, (1.0, 0.5, 0.25), 0.7) == {"1": 1, "0.5": 2, "0.25": None}
    with pytest.raises(ConfigError, match="target-accuracy"):
        RunSettings(target_accuracy=0.0)


@needs_data
@pytest.mark.usefixtures("server_identity")
def test_a_fedrolex_run_sends_each_round_its_window_and_scores_every_tier(tmp_path: Path) -> None:
    """The real ServerApp and ClientApps in-process: round 2's narrow node gets round 2's window of the round-1
    model, and every round records each tier's accuracy, the CSV as columns, metrics.json the rounds to target."""
    grid = run_in_process(tmp_path, **{"num-server-rounds": 2, "aggregation": "fedrolex", "target-accuracy": 0.01})
    run = tmp_path / "inproc"
    body = json.loads((run / "metrics.json").read_text())
    for r in body["records"]:
        assert set(r["tier_metrics"]) == {"accuracy@1", "loss@1", "accuracy@0.5", "loss@0.5"}
        assert r["tier_metrics"]["accuracy@1"] == r["central_accuracy"]
    assert body["rounds_to_target"] == {"1": 0, "0.5": 0}
    assert "accuracy@0.5" in (run / "metrics.csv").read_text().splitlines()[0]
    global1, _ = load_checkpoint(run / "checkpoints" / "round-001.safetensors")
    full = preset("vit-tiny")
    [narrow] = [m for m in grid.sent[2] if m.content[protocol.ARRAYS]["norm.weight"].shape[0] < full.width]
    sent = narrow.content[protocol.ARRAYS].to_torch_state_dict()
    expected = restrict(global1, full, 0.5, "fedrolex", server_round=2)
    assert all(torch.equal(sent[k], expected[k]) for k in expected)


@needs_data
@pytest.mark.usefixtures("server_identity")
def test_a_smallest_width_run_trains_the_small_model_and_scores_it_at_every_tier(tmp_path: Path) -> None:
    run_in_process(tmp_path, **{"num-server-rounds": 1, "aggregation": "smallest-width"})
    _, meta = load_checkpoint(tmp_path / "inproc" / "checkpoints" / "round-001.safetensors")
    assert meta.config == scale_width(preset("vit-tiny"), 0.5)
    last = json.loads((tmp_path / "inproc" / "metrics.json").read_text())["records"][-1]
    assert last["valid"] == 3 and last["aggregated"]
    assert last["tier_metrics"]["accuracy@1"] == last["tier_metrics"]["accuracy@0.5"] == last["central_accuracy"]


def test_the_summary_gives_each_tiers_final_accuracy_and_rounds_to_target() -> None:
    from simulations.compare import tier_columns

    def row(*accuracies: tuple[float, float]) -> dict[str, object]:
        return {"records": [{"round": k, "tier_metrics": {"accuracy@1": a, "accuracy@0.5": b}}
                            for k, (a, b) in enumerate(accuracies)]}

    columns = tier_columns([row((0.1, 0.1), (0.8, 0.5), (0.9, 0.6)), row((0.1, 0.1), (0.6, 0.4), (0.7, 0.8))], 0.7)
    assert columns == {"accuracy@1 %": "80.0 ± 10.0", "rounds to 0.7@1": "1.5 (2/2)",
                       "accuracy@0.5 %": "70.0 ± 10.0", "rounds to 0.7@0.5": "2.0 (1/2)"}


def test_the_plateau_column_is_the_last_fifth_of_rounds_against_the_fifth_before() -> None:
    from simulations.compare import late_gain, plateau_column

    def row(*accuracies: float) -> dict[str, object]:
        return {"records": [{"round": k, "central_accuracy": a} for k, a in enumerate(accuracies)]}

    climbing = row(0.1, *[0.5 + 0.01 * k for k in range(10)])  # round 0 left out; 10 trained rounds, k = 2
    flat = row(0.1, *[0.8] * 8, 0.801, 0.803)
    assert late_gain(climbing) == pytest.approx((0.58 + 0.59) / 2 - (0.56 + 0.57) / 2)
    assert late_gain(flat) == pytest.approx(0.002)
    assert late_gain(row(0.1, 0.5)) is None  # too few rounds to have a last fifth and one before it
    assert plateau_column([climbing, flat]) == "1.1 ± 0.9 (1/2)"
