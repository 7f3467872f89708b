"""Failure handling of the strategy on real flwr Messages: a merge that raises anything, a merged model that is not
finite and bounded, evaluate replies, the server's hold on each node's width tier, oversized arrays, and a round
that waits for nodes that never come.

The crash and the runaway merge are real: a well-formed reply of all 9999 makes weight matching's assignment
infeasible and makes the canonical merge reach about 4e8, with the robust defences turned off.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from test_strategy import (
    CFG,
    as_numpy,
    good_replies,
    instruction,
    merge_options,
    metrics,
    reply,
    schema,
    state,
    strategy,
)

from federation import protocol
from federation.settings import RunSettings
from glmc.errors import ConfigError
from glmc.merging.robust import Robustness
from server.hooks import MetricsWriter
from server.records import RoundRecord
from server.strategy import SymmetryAwareFedAvg
from server.validation import check_evaluate_reply, check_model

OFF = Robustness.off()  # the robust defences off: the failures as the audit saw them


def _constant(value: float) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, value) for k, v in state(0).items()}


def _hostile_round(aggregation: str, robustness: Robustness | None = None) -> tuple[ArrayRecord | None, object]:
    changes = {} if robustness is None else {"robustness": robustness}
    s = strategy(aggregation, options=merge_options(min_gain=0.0, **changes))
    s.global_arrays = ArrayRecord(state(7))  # type: ignore[arg-type]
    arrays, _ = s.aggregate_train(1, [*good_replies(), reply(_constant(9999.0), node=9)])
    return arrays, s


def test_any_exception_of_the_merge_keeps_the_global_model_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    """Weight matching raises scipy's ValueError on the all-9999 reply: the round keeps the global model."""
    with caplog.at_level(logging.ERROR):
        arrays, s = _hostile_round("weight", OFF)
    assert arrays is None and not s.current.aggregated  # type: ignore[attr-defined]
    assert s.global_arrays is not None and np.array_equal(as_numpy(s.global_arrays)["head.weight"],  # type: ignore[attr-defined]
                                                          state(7)["head.weight"].numpy())
    assert (s.current.failure or "").startswith("ValueError: cost matrix is infeasible")  # type: ignore[attr-defined]
    assert any("aggregation failed, keeping the global model" in r.getMessage() for r in caplog.records)


def test_a_merged_model_beyond_the_bound_is_rejected() -> None:
    arrays, s = _hostile_round("canonical", OFF)
    assert arrays is None and "merged model is rejected" in (s.current.failure or "")  # type: ignore[attr-defined]
    assert "beyond" in (s.current.failure or "")  # type: ignore[attr-defined]


def test_check_model_names_nan_and_values_beyond_the_bound() -> None:
    good = ArrayRecord(state(0))  # type: ignore[arg-type]
    assert check_model(good) is None
    for value, reason in ((math.nan, "NaN or Inf"), (math.inf, "NaN or Inf"), (2e4, "beyond")):
        bad = state(0)
        bad["head.bias"][0] = value
        assert reason in (check_model(ArrayRecord(bad)) or "")  # type: ignore[arg-type]


def _evaluate_reply(node: int, **values: object) -> Message:
    record = {protocol.WEIGHT_KEY: 10, "eval-loss": 1.0, "eval-accuracy": 0.5} | values
    return Message(RecordDict({protocol.METRICS: MetricRecord({k: v for k, v in record.items() if v is not None})}),  # type: ignore[arg-type]
                   reply_to=instruction(node))


BAD_EVALUATE = {
    "missing key": (_evaluate_reply(1, **{"eval-accuracy": None}), "missing metric keys"),
    "negative count": (_evaluate_reply(2, **{protocol.WEIGHT_KEY: -100}), "positive whole number"),
    "zero count": (_evaluate_reply(3, **{protocol.WEIGHT_KEY: 0}), "positive whole number"),
    "NaN": (_evaluate_reply(4, **{"eval-loss": math.nan}), "not a finite number"),
    "client error": (Message(Error(code=1, reason="boom"), reply_to=instruction(5)), "client error"),
    "arrays": (Message(RecordDict({"a": ArrayRecord(state(0)), protocol.METRICS: MetricRecord({})}),  # type: ignore[arg-type]
                       reply_to=instruction(6)), "expected no ArrayRecord"),
}


def test_evaluate_replies_are_validated_like_train_replies() -> None:
    """Each bad one is dropped with its reason; the aggregate is flwr's weighted mean of the valid ones alone."""
    for case, (bad, reason) in BAD_EVALUATE.items():
        assert reason in (check_evaluate_reply(bad) or ""), case
    s = strategy()
    good = [_evaluate_reply(10, **{"eval-accuracy": 0.2}), _evaluate_reply(11, **{protocol.WEIGHT_KEY: 30})]
    result = s.aggregate_evaluate(1, [*good, *(bad for bad, _ in BAD_EVALUATE.values())])
    assert result is not None and result["eval-accuracy"] == pytest.approx((10 * 0.2 + 30 * 0.5) / 40)
    assert len(s.current.evaluate_dropped) == len(BAD_EVALUATE)
    assert s.aggregate_evaluate(1, [bad for bad, _ in BAD_EVALUATE.values()]) is None


def test_the_server_owns_each_nodes_width_tier() -> None:
    """A node's first valid reply fixes its tier; a later reply claiming another tier is dropped, and the node
    keeps getting the model at the tier the server holds."""
    s = strategy()
    s.schema = s.schema.__class__({**s.schema.shapes, 0.5: s.schema.shapes[1.0]})  # a second tier of the same shapes
    s.aggregate_train(1, good_replies())
    assert s.node_tiers == {1: 1.0, 2: 1.0, 3: 1.0}
    spoofed = reply(state(5), metrics(examples=10, **{protocol.TIER_KEY: 0.5}), node=1)
    s.aggregate_train(2, [spoofed, *good_replies()[1:]])
    assert s.current.dropped == ["node 1: width tier 0.5, but the server holds tier 1 for this node"]
    assert s.node_tiers[1] == 1.0


def test_an_array_larger_in_bytes_than_its_shape_is_dropped_before_it_is_decoded() -> None:
    padded = dict(ArrayRecord(state(1)).items())  # type: ignore[arg-type]
    real = padded["head.weight"]
    padded["head.weight"] = Array(dtype=real.dtype, shape=real.shape, stype=real.stype, data=real.data + bytes(10**6))
    s = strategy()
    s.aggregate_train(1, [*good_replies()[:2], reply(ArrayRecord(padded), node=4)])  # type: ignore[arg-type]
    assert len(s.current.dropped) == 1 and "bytes, more than the" in s.current.dropped[0]


class FixedGrid:
    """A grid with a fixed set of connected nodes (only what the waiting step calls)."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return list(range(1, self.nodes + 1))


def test_a_round_whose_nodes_never_come_is_skipped_after_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("server.strategy.NODE_POLL_SECONDS", 0.01)
    s = strategy(min_train_nodes=3, node_wait_timeout=0.05, fraction_evaluate=1.0, min_evaluate_nodes=2)
    arrays = ArrayRecord(state(0))  # type: ignore[arg-type]
    assert list(s.configure_train(1, arrays, ConfigRecord(), FixedGrid(1))) == []  # type: ignore[arg-type]
    assert "only 1 of the 3 nodes" in (s.current.failure or "")
    assert list(s.configure_evaluate(1, arrays, ConfigRecord(), FixedGrid(1))) == []  # type: ignore[arg-type]
    assert s.aggregate_train(1, []) == (None, None)


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".hidden", "/abs", "a b"])
def test_run_names_are_plain_names(name: str) -> None:
    with pytest.raises(ConfigError, match="run-name must be a plain name"):
        RunSettings(run_name=name)


def test_cell_names_of_the_comparison_grid_are_plain_names() -> None:
    assert RunSettings(run_name="weight_dirichlet0.1_1-0.5-0.25_s0").run_name


def test_metrics_files_survive_a_write_that_fails_half_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run killed while writing its metrics keeps the last complete files: metrics.csv is written atomically, as
    metrics.json is (it used to be truncated first, then written row by row)."""
    writer = MetricsWriter(tmp_path, {"title": "t"})
    writer.on_round_end(RoundRecord(1, central_accuracy=0.5), ArrayRecord(state(0)))  # type: ignore[arg-type]
    before = (tmp_path / "metrics.csv").read_text()

    def dies(*_: object) -> None:
        raise KeyboardInterrupt("killed while writing rows")

    monkeypatch.setattr(csv.DictWriter, "writerows", dies)
    with pytest.raises(KeyboardInterrupt):
        writer.on_round_end(RoundRecord(2, central_accuracy=0.6), ArrayRecord(state(1)))  # type: ignore[arg-type]
    assert (tmp_path / "metrics.csv").read_text() == before  # round 1, whole
    assert "0.5" in before and len(before.splitlines()) == 2


def test_a_tier_that_splits_a_kv_group_is_refused_before_round_1() -> None:
    """Grouped queries keep whole groups: a tier that splits one is one line, tiers that keep them run."""
    from federation.preflight import check_fit
    from glmc.core.config import preset
    from glmc.errors import ConfigError
    from server.app import reply_schema

    cfg = preset("llama-tiny").replace(vocab_size=20, context=8)
    with pytest.raises(ConfigError, match=r"width-tiers '1,0\.25': llama models of these widths cannot") as err:
        check_fit(RunSettings(model="llama-tiny", dataset="shakespeare", width_tiers=(1.0, 0.25)), cfg)
    assert "\n" not in str(err.value) and "use width-tiers whose models nest" in str(err.value)
    check_fit(RunSettings(model="llama-tiny", dataset="shakespeare", width_tiers=(1.0, 0.5)), cfg)
    assert reply_schema(RunSettings(model="llama-tiny"), cfg) is not None


def test_client_test_off_takes_replies_without_the_score_and_refuses_those_with_it() -> None:
    """client-test = false: the schema expects no client-test keys, so a reply that sends them anyway is dropped in
    one line, and the round records no clients' mean accuracy."""
    off = dataclasses.replace(schema(), metric_keys=protocol.train_metrics(False))
    assert protocol.CLIENT_TEST_METRICS <= protocol.TRAIN_METRICS and not protocol.CLIENT_TEST_METRICS & off.metric_keys
    without = [reply(state(i), metrics(**dict.fromkeys(protocol.CLIENT_TEST_METRICS)), node=i + 1) for i in range(3)]
    s = SymmetryAwareFedAvg("fedavg", off, CFG, min_train_nodes=2)
    s.current = RoundRecord(1)
    arrays, _ = s.aggregate_train(1, without)
    assert arrays is not None and s.current.valid == 3 and s.current.mean_client_accuracy is None
    s.current = RoundRecord(2)
    assert s.aggregate_train(2, good_replies()) == (None, None)
    assert all("extra metric keys" in line or "client-test" in line for line in s.current.dropped), s.current.dropped
