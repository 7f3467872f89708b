"""Seeded client sampling: a round's sample is drawn by the run's seed and the round from the nodes' partition ids,
which each node says once when asked (a roll call), so runs of one seed train the same clients whatever ids the
engine gives their nodes."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from test_flower_sim import needs_data, run_in_process, server_identity  # noqa: F401  (a fixture, used by name)
from test_strategy import JoiningGrid, instruction, state, strategy

from federation import protocol
from server.sampling import PartitionSampler


class PartitionGrid(JoiningGrid):
    """Connected nodes that answer the roll call with their partition id, except the ``silent`` ones."""

    def __init__(self, partitions: dict[int, int], silent: tuple[int, ...] = ()) -> None:
        self.partitions, self.silent, self.asked = partitions, silent, []

    def get_node_ids(self) -> list[int]:
        return list(self.partitions)

    def send_and_receive(self, messages: list[Message], *, timeout: float | None = None) -> list[Message]:
        answers = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            self.asked.append(node)
            if node not in self.silent:
                said = MetricRecord({protocol.PARTITION_KEY: self.partitions[node]})
                answers.append(Message(RecordDict({protocol.METRICS: said}), reply_to=instruction(node)))
        return answers


@pytest.fixture(autouse=True)
def identity(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("_task_id", "_run_id", "_node_id"):  # what the ServerApp process sets before messages are made
        monkeypatch.setattr(TaskIdentity, key, 1)


def grid_of(ids_seed: int, count: int = 20) -> PartitionGrid:
    """``count`` partitions behind node ids drawn from ``ids_seed`` (as a new run of the engine draws them)."""
    ids = random.Random(ids_seed).sample(range(1, 2**40), count)
    return PartitionGrid({node: partition for partition, node in enumerate(ids)})


def drawn(sampler: PartitionSampler, grid: PartitionGrid, rounds: range, size: int = 4) -> list[list[int]]:
    return [list(sampler.sample(grid, grid.get_node_ids(), size, r).values()) for r in rounds]


def test_runs_of_one_seed_sample_the_same_partitions_whatever_their_node_ids() -> None:
    one, other = grid_of(1), grid_of(2)
    assert set(one.partitions).isdisjoint(other.partitions)
    ours = drawn(PartitionSampler(3, 1.0), one, range(1, 7))
    assert sorted(one.asked) == sorted(one.partitions)  # each node was asked once, in the first round
    assert ours == drawn(PartitionSampler(3, 1.0), other, range(1, 7))
    assert all(len(set(sample)) == 4 for sample in ours) and len({tuple(s) for s in ours}) > 1  # rounds differ
    assert drawn(PartitionSampler(4, 1.0), one, range(1, 7)) != ours  # so do seeds


def test_the_sample_maps_the_nodes_it_drew_to_their_partitions() -> None:
    grid = grid_of(5)
    chosen = PartitionSampler(0, 1.0).sample(grid, grid.get_node_ids(), 6, 1)
    assert len(chosen) == 6 and all(grid.partitions[node] == partition for node, partition in chosen.items())
    # never more than the nodes connected
    assert len(PartitionSampler(0, 1.0).sample(grid, grid.get_node_ids(), 50, 1)) == 20


def test_a_node_that_does_not_say_its_partition_is_not_sampled(caplog: pytest.LogCaptureFixture) -> None:
    grid = grid_of(6, count=5)
    mute = next(iter(grid.partitions))
    grid.silent = (mute,)
    sampler = PartitionSampler(0, 1.0)
    with caplog.at_level(logging.WARNING):
        samples = [sampler.sample(grid, grid.get_node_ids(), 5, r) for r in range(1, 4)]
    assert all(mute not in sample and len(sample) == 4 for sample in samples)
    assert "1 of 1 nodes did not say their partition id" in caplog.text
    assert grid.asked.count(mute) == 3  # asked again every round, until it answers


def test_the_strategy_trains_the_drawn_nodes_and_records_their_partitions() -> None:
    grid = grid_of(7, count=10)
    sampler = PartitionSampler(2, 1.0)
    s = strategy(fraction_train=0.3, round_offset=4, sampler=sampler)
    messages = list(s.configure_train(1, ArrayRecord(state(0)), ConfigRecord(), grid))  # type: ignore[arg-type]
    # round 1 of a run resumed after round 4 is round 5
    expected = PartitionSampler(2, 1.0).sample(grid, grid.get_node_ids(), 3, 5)
    assert [m.metadata.dst_node_id for m in messages] == list(expected)
    assert s.current.partitions == list(expected.values())
    assert all(m.content[protocol.CONFIG][protocol.ROUND_KEY] == 5 for m in messages)


def test_federated_evaluation_draws_its_own_seeded_sample_whatever_the_node_ids() -> None:
    """Its own draw (by seed, round and "evaluate"), so two runs of a seed score the same clients, and evaluating
    changes nothing in who trains."""
    def evaluated(grid: PartitionGrid) -> list[list[int]]:
        s = strategy(fraction_evaluate=0.3, min_evaluate_nodes=1, round_offset=2, sampler=PartitionSampler(1, 1.0))
        messages = [list(s.configure_evaluate(r, ArrayRecord(state(0)), ConfigRecord(), grid))  # type: ignore[arg-type]
                    for r in (1, 2)]
        rounds = [[m.content[protocol.CONFIG][protocol.ROUND_KEY] for m in ms] for ms in messages]
        assert rounds == [[3] * len(messages[0]), [4] * len(messages[1])]  # the global round, as in training
        return [[grid.partitions[m.metadata.dst_node_id] for m in ms] for ms in messages]

    one, other = grid_of(9), grid_of(10)
    ours = evaluated(one)
    assert ours == evaluated(other) and all(len(p) == 6 for p in ours)
    train = PartitionSampler(1, 1.0).sample(one, one.get_node_ids(), 6, 3)
    assert ours[0] != list(train.values())  # a draw of its own, not the training sample's


@pytest.mark.slow
@needs_data
def test_two_aggregations_of_one_seed_train_the_same_clients_each_round(tmp_path: Path,
                                                                         server_identity: None) -> None:  # noqa: F811
    """Through the real ServerApp and ClientApp, on node ids that differ between the runs."""
    runs = {"fedavg": 100, "weight": 5000}
    for aggregation, first_node in runs.items():
        run_in_process(tmp_path, num_nodes=6, first_node=first_node,
                       **{"num-server-rounds": 3, "aggregation": aggregation, "fraction-train": 0.5,
                          "run-name": aggregation})
    sampled = [[r["partitions"] for r in json.loads((tmp_path / name / "metrics.json").read_text())["records"]]
               for name in runs]
    assert sampled[0] == sampled[1]
    assert [len(p) for p in sampled[0]] == [0, 3, 3, 3]  # round 0 is the initial model


def test_a_round_whose_nodes_all_keep_quiet_is_skipped_in_one_line() -> None:
    grid = grid_of(8, count=4)
    grid.silent = tuple(grid.partitions)
    s = strategy(sampler=PartitionSampler(0, 1.0))
    assert list(s.configure_train(1, ArrayRecord(state(0)), ConfigRecord(), grid)) == []  # type: ignore[arg-type]
    assert "no node said its partition id" in (s.current.failure or "") and "sampling='flwr'" in s.current.failure


class SayingGrid(PartitionGrid):
    """Nodes that answer the roll call with whatever ``said`` gives them (a malformed or a copied partition id)."""

    def __init__(self, said: dict[int, int | float | list[int]]) -> None:
        super().__init__({node: 0 for node in said})
        self.said = said

    def send_and_receive(self, messages: list[Message], *, timeout: float | None = None) -> list[Message]:
        return [Message(RecordDict({protocol.METRICS: MetricRecord({protocol.PARTITION_KEY: self.said[node]})}),
                        reply_to=instruction(node)) for node in (m.metadata.dst_node_id for m in messages)]


@pytest.mark.parametrize("said", [float("nan"), 1.5, -2, [3, 4], float("inf")])
def test_a_node_that_says_no_partition_id_is_left_out_in_one_line(said: float | list[int],
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    grid = SayingGrid({11: 0, 12: 1, 13: said})  # type: ignore[dict-item]
    with caplog.at_level(logging.WARNING):
        chosen = PartitionSampler(0, 1.0).sample(grid, grid.get_node_ids(), 3, 1)
    assert chosen == {11: 0, 12: 1}
    assert "node 13 said partition id" in caplog.text and "not a non-negative integer" in caplog.text


def test_two_nodes_that_say_one_partition_are_named(caplog: pytest.LogCaptureFixture) -> None:
    grid = SayingGrid({21: 0, 22: 5, 23: 5})
    with caplog.at_level(logging.WARNING):
        chosen = PartitionSampler(0, 1.0).sample(grid, grid.get_node_ids(), 3, 1)
    assert chosen == {21: 0, 22: 5, 23: 5}
    assert "node 23 says partition 5, as node 22 did" in caplog.text
