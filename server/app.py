"""ServerApp: reads the run config once, builds the strategy, evaluates centrally, writes ``outputs/<run>/``.

With ``resume=true`` it continues ``outputs/<run-name>/`` from its newest checkpoint: the global
weights are the saved ones bit for bit, and rounds are numbered globally (round k+1 follows k).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from federation import protocol
from federation.data import eval_subset, label_counts, pool, server_reads, split_config
from federation.preflight import check_fit, check_run_config
from federation.restriction import received
from federation.settings import GUARDED, NATURAL_SPLITS, RunSettings
from glmc.archs import build_model, get_arch
from glmc.core.config import ModelConfig, scale_width
from glmc.core.state import cast
from glmc.data.generated import text_writer
from glmc.device import resolve
from glmc.io.checkpoint import CheckpointMeta, state_digest
from glmc.match.options import LearnConfig
from glmc.train import TrainConfig, evaluate, seed_everything, set_threads
from server.guard import set_aside_note
from server.hooks import (
    CheckpointWriter,
    ClientsWriter,
    EnsembleEvaluator,
    MetricsWriter,
    clear_outputs,
    load_records,
    resume_point,
    round_before,
)
from server.momentum import ServerStep
from server.records import ACCURACY_AT, LOSS_AT, RoundHooks, tier_name
from server.sampling import PartitionSampler
from server.strategy import EvaluateFn, SymmetryAwareFedAvg
from server.validation import ReplySchema

log = logging.getLogger(__name__)

app = ServerApp()

RUN_HANDLER = "glmc-run"  # names the log handlers of the current run, so a second run in-process replaces them


def configure_logging(run_dir: Path) -> None:
    """INFO logs of this project to stderr (streamed by ``flwr run --stream``) and to ``<run>/server.log``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    for name in ("server", "glmc"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        for handler in [h for h in logger.handlers if h.name == RUN_HANDLER]:
            logger.removeHandler(handler)
            handler.close()
        for handler in (logging.StreamHandler(sys.stderr), logging.FileHandler(run_dir / "server.log")):
            handler.setFormatter(formatter)
            handler.name = RUN_HANDLER
            logger.addHandler(handler)


def reply_schema(settings: RunSettings, cfg: ModelConfig) -> ReplySchema:
    """The array shapes of every width tier the run allows (checked to fit the family by check_fit)."""
    shapes = {}
    for tier in settings.trained_tiers:
        model = build_model(scale_width(cfg, tier))
        shapes[tier] = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    return ReplySchema(shapes, protocol.train_metrics(settings.client_test))


def initial_model(settings: RunSettings, run_dir: Path, cfg: ModelConfig) -> tuple[int, ArrayRecord]:
    """(rounds already done, global arrays): the newest checkpoint on resume, else a fresh seeded model."""
    if settings.resume:
        done, state = resume_point(run_dir, cfg, settings.to_run_config())
        log.info("resuming %s from its round-%d checkpoint", run_dir, done)
        return done, ArrayRecord(state)  # type: ignore[arg-type]
    clear_outputs(run_dir)
    if settings.init_checkpoints:  # a pretrained start (a folder's first checkpoint, if its clients start apart)
        from glmc.io.formats import read

        log.info("initial global model: %s", settings.init_checkpoints[0])
        return 0, ArrayRecord(cast(read(settings.init_checkpoints[0])[0], torch.float32))  # type: ignore[arg-type]
    seed_everything(settings.seed)
    state = cast(build_model(cfg).state_dict(), torch.float32)
    return 0, ArrayRecord(state)  # type: ignore[arg-type]


def central_evaluator(settings: RunSettings, cfg: ModelConfig) -> EvaluateFn:
    """evaluate_fn(round, arrays): the global model on ``eval-limit`` held-out test samples, on the server's device,
    and the same at every width tier of the run as that tier's clients receive it (``accuracy@<tier>``,
    ``loss@<tier>``; smallest-width's global model is the same at every tier)."""
    test = eval_subset(pool(settings).test, settings.eval_limit, settings.seed)
    arch, device = get_arch(cfg.family), resolve(settings.server_device)

    def score(state: Mapping[str, torch.Tensor], tier: float) -> dict[str, float]:
        model = build_model(scale_width(cfg, tier))
        model.load_state_dict(state, strict=True)
        return evaluate(model.to(device), arch, test)

    def evaluate_global(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        state = arrays.to_torch_state_dict()
        scores = {1.0: score(state, 1.0)}
        metrics = {"central-loss": float(scores[1.0]["loss"]), "central-accuracy": float(scores[1.0]["accuracy"])}
        for tier in settings.width_tiers:
            own = settings.tier_of(0, tier)  # relative to the global model
            if own not in scores:
                scores[own] = score(received(state, cfg, own, settings.aggregation, settings.narrow_placement,
                                             server_round), own)
            metrics |= {f"{ACCURACY_AT}{tier_name(tier)}": float(scores[own]["accuracy"]),
                        f"{LOSS_AT}{tier_name(tier)}": float(scores[own]["loss"])}
        log.info("round %d: central test loss %.4f, accuracy %.4f; by tier %s", server_round, metrics["central-loss"],
                 metrics["central-accuracy"], {k: round(v, 4) for k, v in metrics.items() if k.startswith(ACCURACY_AT)})
        return MetricRecord(metrics)  # type: ignore[arg-type]

    return evaluate_global


def server_tuning(settings: RunSettings, learn: LearnConfig) -> TrainConfig:
    """How ``fedavg-ft`` trains the merged model: the learned refinement's epochs (or its steps, cycling through
    the data: an epoch is at least one) and batch size over the same server-held samples, at the clients' base
    learning rate (each round at the share lr-decay gives it: the strategy's ``rate``), on the server's one thread."""
    lr = settings.lr or pool(settings).task.defaults.get("lr", TrainConfig.lr)
    return TrainConfig(epochs=learn.steps or learn.epochs, max_steps=learn.steps, batch_size=learn.batch_size, lr=lr,
                       seed=settings.seed, threads=1)


def run_header(settings: RunSettings, num_nodes: int) -> dict[str, Any]:
    """What metrics.json says about the run besides its rounds: settings, split and its label counts."""
    task = pool(settings).task
    split: dict[str, Any] = {"scheme": settings.partitioner}
    if settings.partitioner not in NATURAL_SPLITS and num_nodes:
        split = dict(split_config(settings, num_nodes).describe())
        split["label_counts"] = label_counts(settings, num_nodes)
    title = f"{settings.dataset} {settings.model} {settings.aggregation}, {settings.partitioner}"
    return {"title": title, "settings": settings.to_run_config(), "model": task.config.to_dict(),
            "data": task.split, "split": split}


def output_hooks(settings: RunSettings, run_dir: Path, start_round: int, num_nodes: int) -> list[RoundHooks]:
    """Metrics files (continuing the earlier records on resume), one checkpoint per round, and on request
    the logit ensemble of the clients and their models."""
    task = pool(settings).task
    meta = CheckpointMeta(preset=settings.model, config=task.config, seed=settings.seed, dataset=settings.dataset,
                          split=task.split, train=settings.to_run_config(),
                          vocab=task.vocab.to_json() if task.vocab else None)
    previous = load_records(run_dir, start_round) if settings.resume else []
    hooks: list[RoundHooks] = [MetricsWriter(run_dir, run_header(settings, num_nodes), previous, settings.width_tiers,
                                             settings.target_accuracy),
                               CheckpointWriter(run_dir, meta)]
    if settings.save_clients:
        hooks.append(ClientsWriter(run_dir, meta))
    if settings.ensemble_eval:
        hooks.insert(0, EnsembleEvaluator(task.config, eval_subset(pool(settings).test, settings.eval_limit,
                                                                   settings.seed)))
    return hooks


@app.main()
def main(grid: Grid, context: Context) -> None:
    """One federated run: ``num-server-rounds`` rounds of train → validate → align → merge → evaluate."""
    settings = check_run_config(context.run_config)
    run_dir = settings.run_dir(context.run_id)
    configure_logging(run_dir)
    # One thread: the ServerApp shares the CPUs with the simulated clients, and a descheduled OpenMP thread
    # makes the many small ops of alignment many times slower; align-workers adds processes instead.
    set_threads(1)
    cfg = pool(settings).task.config
    check_fit(settings, cfg)  # the width tiers of a model an init checkpoint gives, unseen by check_run_config
    if settings.generated:
        text_writer(cfg)  # a model that cannot write its own inputs is refused before round 1
    done, initial = initial_model(settings, run_dir, cfg)
    if done >= settings.num_server_rounds:
        log.info("%s already has %d of %d rounds; nothing to do", run_dir, done, settings.num_server_rounds)
        return
    num_nodes, rounds = len(list(grid.get_node_ids())), settings.deployment
    strategy = SymmetryAwareFedAvg(
        settings.aggregation, reply_schema(settings, cfg), cfg, options=settings.merge_options,
        server_data=server_reads(settings), generate=settings.generated,
        tune=server_tuning(settings, settings.learn_options), narrow_placement=settings.narrow_placement,
        independent_init=settings.independent_start, drop_unchanged=settings.drop_unchanged,
        node_wait_timeout=rounds.node_wait_timeout, rate=lambda r: settings.round_lr(1.0, r), round_offset=done,
        hooks=output_hooks(settings, run_dir, done, num_nodes),
        sampler=PartitionSampler(settings.seed, rounds.round_timeout) if rounds.sampling == "seeded" else None,
        server_step=ServerStep(settings.server_learning_rate, settings.server_momentum),
        before=round_before(run_dir, done) if settings.resume and settings.server_momentum else None,
        fraction_train=rounds.fraction_train,
        fraction_evaluate=rounds.fraction_evaluate, min_train_nodes=rounds.min_train_nodes,
        min_available_nodes=rounds.min_available_nodes or rounds.min_train_nodes,
        min_evaluate_nodes=1 if rounds.fraction_evaluate else 0)
    # The digest glmc.io.checkpoint stores: a resumed deployment can be checked against its checkpoint bit for bit.
    log.info("global model after round %d: sha256 %s", done, state_digest(initial.to_torch_state_dict()))
    strategy.start(grid, initial, num_rounds=settings.num_server_rounds - done, timeout=rounds.round_timeout,
                   train_config=ConfigRecord(), evaluate_config=ConfigRecord(),
                   evaluate_fn=central_evaluator(settings, cfg))
    if settings.aggregation in GUARDED:
        log.info("run summary: %s", set_aside_note(strategy.records))
    log.info("run finished: outputs in %s", run_dir)
