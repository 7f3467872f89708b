"""Round hooks that write a run's outputs: metrics (JSON + CSV), one safetensors checkpoint per round, plots.

Layout of ``outputs/<run>/``::

    metrics.json   {"settings", "split", "model", "records": [RoundRecord...], "rounds_to_target": {tier: round}}
    metrics.csv    one row per round (dropped replies as a count, each tier's metric a column)
    checkpoints/round-NNN.safetensors   the global model after round N (round 0 = the initial model)
    clients/round-NNN/client-K.safetensors   with save-clients: the K-th valid client model of round N (its example
                                             count in the metadata's metrics["examples"])
    accuracy.png   central test accuracy of the global model (at every width tier) and of the clients' models (mean)
                   per round
"""

from __future__ import annotations

import csv
import io
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord
from torch.utils.data import Dataset

from federation.protocol import Client
from federation.settings import RunSettings
from glmc.archs import build_model, get_arch
from glmc.core.config import ModelConfig, scale_width
from glmc.errors import CheckpointError, ConfigError
from glmc.io.checkpoint import CheckpointMeta, load_checkpoint, save_checkpoint
from glmc.merging.evaluation import ensemble_metrics
from server.aggregation import client_models
from server.records import RoundHooks, RoundRecord, rounds_to_target, tier_name

log = logging.getLogger(__name__)

CHECKPOINT = re.compile(r"round-(\d+)\.safetensors")


class MetricsWriter(RoundHooks):
    """Rewrites metrics.json and metrics.csv after every round, each atomically (a temporary file renamed over it), so
    a run killed at any moment keeps what it measured."""

    def __init__(self, run_dir: Path, header: dict[str, Any], records: Sequence[RoundRecord] = (),
                 tiers: Sequence[float] = (1.0,), target: float = RunSettings.target_accuracy) -> None:
        """``tiers``: the run's width tiers, each reaching ``target`` accuracy in its ``rounds_to_target`` round."""
        self.run_dir, self.header = run_dir, header
        self.records = list(records)
        self.tiers, self.target = tuple(tiers), target

    def on_round_end(self, record: RoundRecord, arrays: ArrayRecord) -> None:
        self.records.append(record)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        body = self.header | {"records": [r.to_dict() for r in self.records], "target_accuracy": self.target,
                              "rounds_to_target": rounds_to_target(self.records, self.tiers, self.target)}
        _atomic_write(self.run_dir / "metrics.json", json.dumps(body, indent=1))
        rows = [_row(r) for r in self.records]
        table = io.StringIO(newline="")
        # a resumed run's older rows may lack a later key (a tier's metric)
        writer = csv.DictWriter(table, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
        writer.writeheader()
        writer.writerows(rows)
        _atomic_write(self.run_dir / "metrics.csv", table.getvalue())

    def on_run_end(self, records: Sequence[RoundRecord]) -> None:
        """accuracy.png over every round of the run, resumed ones included."""
        from server.plots import plot_curves

        curves = {
            "global model": [(r.round, r.central_accuracy) for r in self.records],
            **{f"global model @ width {tier_name(t)}": [(r.round, r.accuracy_at(tier_name(t))) for r in self.records]
               for t in self.tiers if t != 1.0},
            "clients (mean)": [(r.round, r.mean_client_accuracy) for r in self.records],
        }
        path = plot_curves(curves, self.run_dir / "accuracy.png", str(self.header.get("title", "")))
        log.info("accuracy plot: %s", path)


def _row(record: RoundRecord) -> dict[str, Any]:
    """One round's CSV row: its record, the dropped replies counted, each tier's metric a column."""
    row = record.to_dict() | {"dropped": len(record.dropped)} | record.tier_metrics
    del row["tier_metrics"]
    return row


def load_records(run_dir: Path, up_to: int) -> list[RoundRecord]:
    """The records of rounds 0..up_to from an earlier metrics.json (for resume)."""
    path = run_dir / "metrics.json"
    if not path.is_file():
        return []
    records = json.loads(path.read_text())["records"]
    return [RoundRecord(**r) for r in records if r["round"] <= up_to]


@dataclass(frozen=True)
class CheckpointWriter(RoundHooks):
    """Saves the global model of every round through glmc.io.checkpoint (safetensors + checked JSON metadata)."""

    run_dir: Path
    meta: CheckpointMeta

    def on_round_end(self, record: RoundRecord, arrays: ArrayRecord) -> None:
        metrics = {k: float(v) for k, v in asdict(record).items()
                   if k in ("round", "central_loss", "central_accuracy") and v is not None}
        save_checkpoint(checkpoint_path(self.run_dir, record.round), arrays.to_torch_state_dict(),
                        replace(self.meta, metrics=metrics))


@dataclass(frozen=True)
class ClientsWriter(RoundHooks):
    """Saves every valid client model of each round (``save-clients``), for merging them offline (``glmc merge``)."""

    run_dir: Path
    meta: CheckpointMeta

    def on_aggregate(self, record: RoundRecord, clients: Sequence[Client]) -> None:
        folder = self.run_dir / "clients" / f"round-{record.round:03d}"
        for stale in folder.glob("client-*.safetensors"):
            stale.unlink()
        for k, client in enumerate(clients):
            meta = replace(self.meta, config=scale_width(self.meta.config, client.tier), width_mult=client.tier,
                           metrics={"round": float(record.round), "examples": client.weight})
            save_checkpoint(folder / f"client-{k}.safetensors", client.state, meta)
        log.info("round %d: %d client models written to %s", record.round, len(clients), folder)


@dataclass(frozen=True)
class EnsembleEvaluator(RoundHooks):
    """The logit ensemble of each round's client models on the central test subset: the one-shot reference
    that merging into a single model tries to reach (the one-shot experiment)."""

    full: ModelConfig
    test: Dataset

    def on_aggregate(self, record: RoundRecord, clients: Sequence[Client]) -> None:
        models = client_models(clients, self.full)
        result = ensemble_metrics(models, get_arch(self.full.family), self.test)
        record.ensemble_loss, record.ensemble_accuracy = result["loss"], result["accuracy"]
        log.info("round %d: logit ensemble of %d clients: accuracy %.4f", record.round, len(models), result["accuracy"])


def checkpoint_path(run_dir: Path, round_: int) -> Path:
    return run_dir / "checkpoints" / f"round-{round_:03d}.safetensors"


# What a resumed run may change: how long it runs and waits (and for how many nodes), how many threads or workers
# and which devices it computes with, what it saves, the federated evaluations that train nothing, the accuracy the
# summary counts rounds to, the NaN test hook, and the clients' learning-rate schedule where it has not run yet
# (every round done keeps its rate: _require_same_rates). Any other run-config key would make the resumed rounds
# another experiment than the checkpoints' own.
RESUME_MAY_CHANGE = frozenset({"num-server-rounds", "resume", "round-timeout", "node-wait-timeout", "client-threads",
                               "align-workers", "output-dir", "fraction-evaluate", "ensemble-eval", "min-train-nodes",
                               "min-available-nodes", "client-device", "server-device", "save-clients",
                               "target-accuracy", "fault-partition", "lr-decay", "lr-decay-rounds"})


SCHEDULE_KEYS = ("lr-decay", "lr-decay-rounds", "num-server-rounds")  # what sets a round's learning rate


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(round, path) of every round checkpoint in ``run_dir``, newest first."""
    return sorted(((int(m[1]), p) for p in (run_dir / "checkpoints").glob("round-*.safetensors")
                   if (m := CHECKPOINT.fullmatch(p.name))), reverse=True)


def resume_point(run_dir: Path, cfg: ModelConfig, run_config: Mapping[str, Any]) -> tuple[int, dict[str, torch.Tensor]]:
    """(round, state) of the newest checkpoint in ``run_dir`` that is whole (its checksum holds) and fits ``cfg``
    (architecture and every tensor's shape); a newer one that is not is skipped, with a warning. A ConfigError if none
    is, or if the one found was written with other run-config values than ``run_config`` (those of
    RESUME_MAY_CHANGE aside)."""
    expected = {k: tuple(v.shape) for k, v in build_model(cfg).state_dict().items()}
    skipped = []
    for round_, path in checkpoints(run_dir):
        try:
            state, meta = load_checkpoint(path)
        except CheckpointError as err:
            skipped.append(str(err))
        else:
            if meta.config == cfg and {k: tuple(v.shape) for k, v in state.items()} == expected:
                _require_same_run(path, meta.train, run_config)
                _require_same_rates(path, meta.train, run_config, round_)
                return round_, state
            skipped.append(f"{path.name} holds another model ({meta.preset}) than this run's")
        log.warning("resume: skipping %s", skipped[-1])
    raise ConfigError(f"resume=true but {run_dir} has no usable checkpoint"
                      f"{': ' + '; '.join(skipped) if skipped else ''}; run once without resume first")


def round_before(run_dir: Path, done: int) -> dict[str, torch.Tensor] | None:
    """The global model of round ``done`` − 1, which a resumed run under server momentum steps from (its step is
    the momentum's state); None where ``done`` is 0. A ConfigError, in one line, if that checkpoint is missing or
    broken."""
    if done == 0:
        return None
    path = checkpoint_path(run_dir, done - 1)
    try:
        return load_checkpoint(path)[0]
    except CheckpointError as err:
        raise ConfigError(f"resume under server-momentum needs round {done - 1}'s global model too (the step it "
                          f"took is the momentum): {err}") from err


def _require_same_run(path: Path, saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """ConfigError naming the run-config keys whose values differ between the checkpoint and this run (keys a
    checkpoint predates count as their current defaults)."""
    defaults = RunSettings().to_run_config()
    changed = sorted(k for k in set(saved) | set(current) if k not in RESUME_MAY_CHANGE
                     and saved.get(k, defaults.get(k)) != current.get(k, defaults.get(k)))
    if changed:
        shown = ", ".join(f"{k} {saved.get(k, defaults.get(k))!r} → {current.get(k)!r}" for k in changed[:4])
        raise ConfigError(f"resume: {path.name} was written with other settings ({shown}); resume with its run "
                          f"config (only {', '.join(sorted(RESUME_MAY_CHANGE - {'resume'}))} may change)")


def _require_same_rates(path: Path, saved: Mapping[str, Any], current: Mapping[str, Any], done: int) -> None:
    """ConfigError unless each of the ``done`` rounds ran at the learning rate this run's schedule gives it: a run
    extended past num-server-rounds keeps its schedule, or holds its last rate (lr-decay-rounds)."""
    def rates(config: Mapping[str, Any]) -> list[float]:
        settings = RunSettings.from_run_config({k: config[k] for k in SCHEDULE_KEYS if k in config})
        return [settings.round_lr(1.0, r) for r in range(1, done + 1)]

    if rates(saved) != rates(current):
        shown = ", ".join(f"{k} {saved.get(k)!r} → {current.get(k)!r}" for k in sorted(SCHEDULE_KEYS)
                          if saved.get(k) != current.get(k))
        raise ConfigError(f"resume: {path.name}'s {done} rounds ran under another learning-rate schedule ({shown}); "
                          f"to run on past them, set lr-decay-rounds to the rounds their schedule spanned")


def clear_outputs(run_dir: Path) -> None:
    """A fresh (not resumed) run starts from an empty run directory: stale checkpoints would mislead a resume. Only
    this run's own files go: ``run_dir`` is output-dir/run-name, and a run name is a plain name, never a path."""
    stale = [*(run_dir / "checkpoints").glob("round-*.safetensors"), run_dir / "metrics.json", run_dir / "metrics.csv"]
    for path in stale:
        path.unlink(missing_ok=True)
    if any(p.name.startswith("round-") for p in stale):
        log.info("fresh run: removed the old checkpoints in %s", run_dir)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
