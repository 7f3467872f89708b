"""ClientApp: train the received global model (or, in round 1 with ``init=independent``, a model
from the client's own seed; with ``init`` a folder of checkpoints, checkpoint p mod n) on this node's
partition at its width tier (under fjord, each step a leading sub-model at a tier up to its own), then reply
with the weights, ``num-examples``, the width tier and the training metrics.

The partition comes from the node config (``partition-id``, ``num-partitions``: the simulation
engine sets both; a deployed SuperNode passes them with ``--node-config``); the width tier from the
node config's ``width-tier`` or else the run config's ``width-tiers`` mapped over partition ids.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from client.attacks import attack
from federation import protocol
from federation.data import ClientShare, client_share, eval_subset, pool
from federation.preflight import check_run_config
from federation.restriction import received
from federation.settings import LABEL_MASK_FILLS, RunSettings
from glmc.archs import Arch, build_model, get_arch
from glmc.core.config import ModelConfig, scale_width
from glmc.core.state import cast
from glmc.data.vision import ArrayDataset
from glmc.device import peak_memory_mb, released, reset_peak_memory, resolve
from glmc.errors import ConfigError, first_line
from glmc.ordered_dropout import OrderedDropout
from glmc.train import TrainConfig, evaluate, seed_everything, set_threads, train

log = logging.getLogger(__name__)

app = ClientApp()


@dataclass(frozen=True)
class Node:
    """Who this client is in the run: its partition and its width tier."""

    partition_id: int
    num_partitions: int
    tier: float

    @classmethod
    def from_context(cls, context: Context, settings: RunSettings) -> Node:
        """Read the node config; a missing partition is a ConfigError naming the keys to set."""
        config = context.node_config
        if "partition-id" not in config or "num-partitions" not in config:
            raise ConfigError("node config needs partition-id and num-partitions (--node-config)")
        pid, count = int(config["partition-id"]), int(config["num-partitions"])
        declared = float(config["width-tier"]) if "width-tier" in config else None
        return cls(pid, count, settings.tier_of(pid, declared))


def _setup(context: Context) -> tuple[RunSettings, Node, ModelConfig, ClientShare]:
    """Settings, node identity, the model config at this node's width, and its data (cached)."""
    settings = check_run_config(context.run_config)
    node = Node.from_context(context, settings)
    set_threads(settings.client_threads)
    share = client_share(settings, node.partition_id, node.num_partitions)
    return settings, node, scale_width(pool(settings).task.config, node.tier), share


def _received_model(msg: Message, cfg: ModelConfig, settings: RunSettings, node: Node) -> nn.Module:
    """A model at this node's width holding the weights the server sent."""
    state = dict(msg.content.array_records[protocol.ARRAYS].to_torch_state_dict())
    return _model_at_tier(state, cfg, settings, node, _round(msg))


def _round(msg: Message) -> int:
    """The global round of the server's instruction (train and evaluate both carry it)."""
    return int(msg.content.config_records[protocol.CONFIG][protocol.ROUND_KEY])  # type: ignore[arg-type]


def _model_at_tier(state: dict[str, torch.Tensor], cfg: ModelConfig, settings: RunSettings, node: Node,
                   server_round: int) -> nn.Module:
    """A model at this node's width holding ``state``.

    A server that has not heard from this node yet sends the full-width model (and a pretrained start is one);
    the node then restricts it itself, exactly as the server would (its HeteroFL slice or FedRolex window of round
    ``server_round``, or its projection for aligned merging).
    """
    model = build_model(cfg)
    if any(state[k].shape != v.shape for k, v in model.state_dict().items() if k in state):
        state = received(state, pool(settings).task.config, node.tier, settings.aggregation,
                         settings.narrow_placement, server_round)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ConfigError(f"server weights do not fit a width-{node.tier:g} model: {first_line(err)}") from err
    return model


def _start_model(msg: Message, cfg: ModelConfig, settings: RunSettings, node: Node, server_round: int) -> nn.Module:
    """The model to train: the server's weights, or this client's own seed in an independent first round."""
    starts = settings.init_checkpoints
    if len(starts) > 1 and server_round == 1:  # independently pretrained clients: checkpoint p mod n
        from glmc.io.formats import read

        own = starts[node.partition_id % len(starts)]
        log.info("partition %d starts from %s", node.partition_id, own)
        return _model_at_tier(cast(read(own)[0], torch.float32), cfg, settings, node, server_round)
    if settings.init == "independent" and server_round == 1:
        seed_everything(settings.seed + 1000 * node.partition_id)
        return build_model(cfg)
    return _received_model(msg, cfg, settings, node)


def _device(context: Context, settings: RunSettings) -> torch.device:
    """Where this node computes: its node config's ``device``, else the run config's ``client-device``."""
    return resolve(str(context.node_config.get("device", settings.client_device)))


def train_config(settings: RunSettings, defaults: dict, seed: int, device: torch.device,
                  server_round: int) -> TrainConfig:
    """Local training hyper-parameters: the run config where set, else the dataset's defaults; the learning rate
    as lr-decay sets it for ``server_round``."""
    given = {"batch_size": settings.batch_size, "lr": settings.lr}
    chosen = defaults | {k: v for k, v in given.items() if v}
    chosen["lr"] = settings.round_lr(chosen["lr"], server_round)
    return TrainConfig(epochs=settings.local_epochs, seed=seed, max_steps=settings.local_steps or None,
                       threads=settings.client_threads, device=str(device), **chosen)


def ordered_dropout(model: nn.Module, arch: Arch, settings: RunSettings, tier: float,
                    seed: int) -> OrderedDropout | None:
    """FjORD's Ordered Dropout for a node of ``tier`` over :meth:`RunSettings.ordered_tiers`, its draws seeded by
    ``seed``; None where the node trains at one width (plain training)."""
    tiers = settings.ordered_tiers(tier)
    if len(tiers) < 2:
        return None
    full = pool(settings).task.config
    return OrderedDropout(model, arch, [scale_width(full, t) for t in tiers], seed)


def label_masked(logits: Callable[[nn.Module, torch.Tensor], torch.Tensor], labels: torch.Tensor, num_classes: int,
                 fill: str = "zero") -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """``logits`` with the classes absent from ``labels`` (a client's share) set to 0 (HeteroFL's masked
    cross-entropy, under which local steps leave the head rows of unseen classes to the other clients) or, for
    ``fill`` "exclude", to −inf: they leave the softmax (restricted softmax)."""
    absent = torch.ones(num_classes, dtype=torch.bool)
    absent[labels.unique()] = False
    value = LABEL_MASK_FILLS[fill]

    def masked(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = logits(model, x)
        return out.masked_fill(absent.to(out.device), value)

    return masked


def step_logits(arch: Arch, settings: RunSettings, ordered: OrderedDropout | None, share: ClientShare,
                cfg: ModelConfig) -> Callable[[nn.Module, torch.Tensor], torch.Tensor] | None:
    """The training steps' forward: FjORD's draw where it runs, label-masked where ``label-mask`` asks; None where
    both are off (the family's own)."""
    if not settings.label_mask:
        return ordered
    assert isinstance(share.train, ArrayDataset), "label-mask is checked to run on label splits"
    return label_masked(ordered if ordered is not None else arch.logits, share.train.y, cfg.num_classes,
                        settings.label_mask_fill)


def _reply_state(model: nn.Module, settings: RunSettings, node: Node) -> dict[str, torch.Tensor]:
    """The float32 state dict to send; the fault-partition TEST HOOK turns it into NaNs."""
    state = cast(model.state_dict(), torch.float32)
    if node.partition_id == settings.fault_partition:
        log.warning("fault-partition test hook: partition %d replies NaN weights", node.partition_id)
        state = {k: torch.full_like(v, math.nan) for k, v in state.items()}
    return state


def client_test(model: nn.Module, arch: Arch, settings: RunSettings) -> dict[str, float]:
    """The trained model's central test score (eval-limit samples) where the run's client-test asks for it."""
    if not settings.client_test:
        return {}
    test = evaluate(model, arch, eval_subset(pool(settings).test, settings.eval_limit, settings.seed))
    return {"client-test-loss": float(test["loss"]), "client-test-accuracy": float(test["accuracy"])}


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    """One round of local training."""
    settings, node, cfg, share = _setup(context)
    server_round = _round(msg)
    arch, device = get_arch(cfg.family), _device(context, settings)
    model = _start_model(msg, cfg, settings, node, server_round)
    received = {k: v.detach().to(torch.float32, copy=True) for k, v in model.state_dict().items()}  # before training
    seed = settings.seed + 1000 * node.partition_id + server_round
    reset_peak_memory(device)
    with released(device):  # an idle client (a Ray actor between rounds) keeps no cached GPU memory
        config = train_config(settings, pool(settings).task.defaults, seed, device, server_round)
        ordered = ordered_dropout(model, arch, settings, node.tier, seed)
        fit = train(model, arch, share.train, config, progress=False,
                    step_logits=step_logits(arch, settings, ordered, share, cfg))
        test = client_test(model, arch, settings)
        model.cpu()
    values = {
        protocol.WEIGHT_KEY: len(share.train),  # type: ignore[arg-type]  # every share is a sized dataset
        protocol.TIER_KEY: float(node.tier),
        "train-loss": float(fit["train_loss"]),
        "train-steps": int(fit["steps"]),
        "train-seconds": float(fit["seconds"]),
        "client-peak-gpu-mb": peak_memory_mb(device),
    } | test
    state = _reply_state(model, settings, node)
    if node.partition_id == settings.attack_partition and settings.attack != "none":
        log.warning("attack test hook: partition %d replies with attack %r", node.partition_id, settings.attack)
        state, changes = attack(settings.attack, state, received, cfg, node.num_partitions, seed)
        values |= changes
    metrics = MetricRecord(values)  # type: ignore[arg-type]
    return Message(RecordDict({protocol.ARRAYS: ArrayRecord(state), protocol.METRICS: metrics}),  # type: ignore[arg-type]
                   reply_to=msg)


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    """Federated evaluation: the global model at this node's width on its local validation set."""
    settings, node, cfg, share = _setup(context)
    device = _device(context, settings)
    with released(device):
        model = _received_model(msg, cfg, settings, node).to(device)
        result = evaluate(model, get_arch(cfg.family), share.val)
    metrics = MetricRecord({protocol.WEIGHT_KEY: len(share.val), "eval-loss": float(result["loss"]),  # type: ignore[arg-type]
                            "eval-accuracy": float(result["accuracy"])})
    return Message(RecordDict({protocol.METRICS: metrics}), reply_to=msg)


@app.query()
def query_fn(msg: Message, context: Context) -> Message:
    """The roll call of seeded sampling (server.sampling): this node's partition id; no model, no data loaded."""
    node = Node.from_context(context, check_run_config(context.run_config))
    return Message(RecordDict({protocol.METRICS: MetricRecord({protocol.PARTITION_KEY: node.partition_id})}),
                   reply_to=msg)
