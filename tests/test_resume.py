"""Resuming a run: an interrupted run, resumed, ends bit for bit where the same run uninterrupted ends; a resume
checks every checkpoint (checksum, architecture, shapes) and falls back to the newest good one; it refuses a run
config other than the checkpoint's; and a fresh run clears only its own outputs.

The in-process round loop of test_flower_sim (the real ServerApp ``main`` and ClientApp functions, no Ray) runs
the federated rounds.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from flwr.app import Message, MessageType
from test_flower_sim import InProcessGrid, needs_data, run_in_process, server_identity  # noqa: F401 (fixture)

from federation.settings import RunSettings
from glmc.archs import build_model
from glmc.core.config import preset
from glmc.errors import ConfigError
from glmc.io.checkpoint import CheckpointMeta, load_checkpoint, save_checkpoint, state_digest
from server.hooks import checkpoint_path, clear_outputs, resume_point

RUN = {"num-server-rounds": 3, "aggregation": "weight", "min-alignment-gain": 0.0}


class Interrupted(Exception):
    """What stops the run mid-round (a killed ServerApp)."""


class InterruptedGrid(InProcessGrid):
    """Raises in the middle of round ``at``: its train instructions are sent, and no reply ever comes."""

    at = 3

    def send_and_receive(self, messages: list[Message], *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        if messages and messages[0].metadata.message_type == MessageType.TRAIN and \
                messages[0].content["config"]["server-round"] == self.at:
            raise Interrupted
        return super().send_and_receive(messages, timeout=timeout)


@pytest.mark.slow
@needs_data
@pytest.mark.parametrize("step", [{}, {"server-learning-rate": 0.1, "server-momentum": 0.9}])
def test_a_run_interrupted_and_resumed_ends_bit_for_bit_where_the_uninterrupted_run_ends(
        tmp_path: Path, server_identity: None, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        step: dict[str, float]) -> None:
    """Under server momentum too: the resumed round 3 steps on from round 2's step, read off its two checkpoints."""
    run_in_process(tmp_path, **RUN, **step, **{"run-name": "whole"})
    monkeypatch.setattr("test_flower_sim.InProcessGrid", InterruptedGrid)
    with pytest.raises(Interrupted):
        run_in_process(tmp_path, **RUN, **step, **{"run-name": "cut"})
    assert not checkpoint_path(tmp_path / "cut", 3).exists() and checkpoint_path(tmp_path / "cut", 2).exists()
    monkeypatch.setattr("test_flower_sim.InProcessGrid", InProcessGrid)
    run_in_process(tmp_path, **RUN, **step, **{"run-name": "cut", "resume": True})
    whole, _ = load_checkpoint(checkpoint_path(tmp_path / "whole", 3))
    resumed, _ = load_checkpoint(checkpoint_path(tmp_path / "cut", 3))
    assert state_digest(resumed) == state_digest(whole)
    records = [json.loads((tmp_path / name / "metrics.json").read_text())["records"] for name in ("whole", "cut")]
    assert [r["round"] for r in records[1]] == [0, 1, 2, 3]
    assert [r["central_accuracy"] for r in records[1]] == [r["central_accuracy"] for r in records[0]]


@pytest.mark.slow
@needs_data
def test_a_finished_run_extended_past_its_schedule_ends_where_the_longer_run_ends(
        tmp_path: Path, server_identity: None) -> None:  # noqa: F811
    """A 2-round run under lr-decay step (round 2 at a tenth of the rate), resumed to 3 rounds with lr-decay-rounds 2,
    ends bit for bit where a 3-round run with the same schedule ends: round 3 keeps round 2's rate. Resumed under a
    schedule that would give round 2 another rate, it is refused in one line."""
    step = {"aggregation": "fedavg", "lr-decay": "step", "lr-decay-rounds": 2}
    run_in_process(tmp_path, **step, **{"num-server-rounds": 3, "run-name": "whole"})
    short = {"aggregation": "fedavg", "lr-decay": "step", "num-server-rounds": 2, "run-name": "cut"}
    run_in_process(tmp_path, **short)
    with pytest.raises(ConfigError, match=r"another learning-rate schedule.*lr-decay-rounds"):
        run_in_process(tmp_path, **short | {"num-server-rounds": 3, "resume": True})
    run_in_process(tmp_path, **short | step | {"num-server-rounds": 3, "resume": True})
    whole, _ = load_checkpoint(checkpoint_path(tmp_path / "whole", 3))
    resumed, _ = load_checkpoint(checkpoint_path(tmp_path / "cut", 3))
    assert state_digest(resumed) == state_digest(whole)
    records = [json.loads((tmp_path / name / "metrics.json").read_text())["records"] for name in ("whole", "cut")]
    assert [r["central_accuracy"] for r in records[1]] == [r["central_accuracy"] for r in records[0]]


CFG = preset("vit-tiny")


def _save(run_dir: Path, round_: int, cfg: str = "vit-tiny", **train: object) -> Path:
    torch.manual_seed(round_)
    path = checkpoint_path(run_dir, round_)
    meta = CheckpointMeta(preset=cfg, config=preset(cfg), train=RunSettings().to_run_config() | train)
    return save_checkpoint(path, build_model(preset(cfg)).state_dict(), meta)


def test_resume_falls_back_to_the_newest_good_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Round 4 is truncated, round 3 is a self-consistent checkpoint of another model: round 2 is resumed."""
    _save(tmp_path, 1)
    good = _save(tmp_path, 2)
    _save(tmp_path, 3, cfg="vit-bench")
    broken = _save(tmp_path, 4)
    broken.write_bytes(broken.read_bytes()[:-100])
    with caplog.at_level(logging.WARNING):
        round_, state = resume_point(tmp_path, CFG, RunSettings().to_run_config())
    assert round_ == 2 and state_digest(state) == state_digest(load_checkpoint(good)[0])
    skipped = [r.getMessage() for r in caplog.records if "resume: skipping" in r.getMessage()]
    assert len(skipped) == 2 and "round-003" in skipped[1] and "another model" in skipped[1]


def test_resume_refuses_another_run_config_and_an_empty_run(tmp_path: Path) -> None:
    _save(tmp_path, 1, aggregation="weight")
    with pytest.raises(ConfigError, match="aggregation 'weight' → 'fedavg'"):
        resume_point(tmp_path, CFG, RunSettings().to_run_config())
    changed = RunSettings.from_run_config({"aggregation": "weight", "num-server-rounds": 9,
                                           "round-timeout": 60.0}).to_run_config()
    assert resume_point(tmp_path, CFG, changed)[0] == 1  # how long it runs and waits may change
    with pytest.raises(ConfigError, match="no usable checkpoint"):
        resume_point(tmp_path / "empty", CFG, changed)


def test_a_fresh_run_clears_its_own_outputs_and_no_other_runs(tmp_path: Path) -> None:
    for name in ("a", "b"):
        _save(tmp_path / name, 1)
        (tmp_path / name / "metrics.json").write_text("{}")
    clear_outputs(tmp_path / "a")
    assert not checkpoint_path(tmp_path / "a", 1).exists() and not (tmp_path / "a" / "metrics.json").exists()
    assert checkpoint_path(tmp_path / "b", 1).exists() and (tmp_path / "b" / "metrics.json").exists()
    with pytest.raises(ConfigError, match="plain name"):
        RunSettings(run_name="../b").run_dir(1)
