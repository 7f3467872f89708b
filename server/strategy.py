"""SymmetryAwareFedAvg: FedAvg whose averaging step first aligns the clients' Transformers.

``aggregation="fedavg"`` runs flwr's own ``FedAvg.aggregate_train`` on the valid replies, so it is
FedAvg exactly (as are fedrolex, fjord and smallest-width at equal widths, and full-width-only, which leaves the
narrow replies out). ``weight``, ``activation``, ``learned``, ``canonical``, ``fedavg-ft`` and ``server-only`` hand the
decoded client states to :func:`server.aggregation.merge`. Every reply is validated first
(:mod:`server.validation`); a bad one is dropped with a one-line reason, and with fewer than ``min_train_nodes``
valid replies the global model is kept for the round; so it is when the merge itself raises (any exception, logged
and kept in the round's ``failure``) and when the merged model is not finite and bounded (:func:`check_model`).
Evaluate replies are validated the same way. A node's width tier is the server's: the first valid reply
of a node fixes it, and a later reply of another tier is dropped.

The round loop stays flwr's ``Strategy.start``; this class only wraps its ``evaluate_fn`` so that,
after the central evaluation of each round, the named hooks ``on_round_end(record, arrays)`` run
(metrics files, checkpoints) and ``on_run_end(records)`` once at the end (plots). Nothing copies
the loop. ``round_offset`` makes a resumed run count rounds globally.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from torch.utils.data import Dataset

from federation import protocol
from federation.protocol import Client
from federation.restriction import principal_placement, restrict
from federation.settings import (
    AGGREGATION_TABLE,
    AGGREGATIONS,
    AVERAGING,
    NARROW_PLACEMENTS,
    Deployment,
    RunSettings,
    places_principal,
)
from glmc.core.config import ModelConfig, scale_width
from glmc.core.state import State
from glmc.data.generated import generated_text, writing_seconds
from glmc.device import peak_memory_mb, released, reset_peak_memory, resolve
from glmc.errors import ConfigError, GlmcError
from glmc.merging.merge import embedded_distance
from glmc.merging.options import MergeOptions
from glmc.merging.robust import Clipping, cap_examples, clip, combine, recentre_round, unclipped
from glmc.merging.widths import Placement
from glmc.train import TrainConfig
from server.aggregation import MergeResult, merge, universe_states
from server.guard import guard_note
from server.momentum import PLAIN, ServerStep
from server.records import ACCURACY_AT, LOSS_AT, RoundHooks, RoundRecord
from server.sampling import PartitionSampler
from server.validation import ReplySchema, check_evaluate_reply, check_model, split_replies

log = logging.getLogger(__name__)

NODE_POLL_SECONDS = 1.0  # how often a round that waits for nodes counts them (flwr's own wait polls once a second)

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


def at_rate(options: MergeOptions, share: float) -> MergeOptions:
    """``options`` with the learned refinement's learning rate at ``share`` of its own (a round's lr-decay)."""
    learn = options.match.learn
    if share == 1.0:
        return options
    return dataclasses.replace(options, match=dataclasses.replace(options.match, learn=dataclasses.replace(
        learn, lr=learn.lr * share)))


class SymmetryAwareFedAvg(FedAvg):
    """FedAvg with validated replies, symmetry-aware merging, per-round records and hooks."""

    def __init__(self, aggregation: str, schema: ReplySchema, model_config: ModelConfig, *,
                 options: MergeOptions | None = None, server_data: Dataset | None = None, generate: int = 0,
                 tune: TrainConfig | None = None, narrow_placement: str = RunSettings.narrow_placement,
                 independent_init: bool = False, drop_unchanged: bool = False,
                 node_wait_timeout: float = Deployment.node_wait_timeout, rate: Callable[[int], float] | None = None,
                 round_offset: int = 0, hooks: Sequence[RoundHooks] = (), sampler: PartitionSampler | None = None,
                 server_step: ServerStep = PLAIN, before: State | None = None, **fedavg: Any) -> None:
        """``options``: how the server merges (default: the run config's defaults on the CPU), its method set by
        ``aggregation``; ``tune``: how fedavg-ft and server-only train on the server data; ``rate``: the share of
        its base learning rate that round r's training runs at (lr-decay), the server's own (fedavg-ft's and
        server-only's training, learned's refinement) as the clients'; ``sampler``: draws each round's nodes by
        partition (sampling="seeded"), None for FedAvg's own sampler; ``server_step``: how the global model moves
        toward each round's merge (server momentum), ``before``: the global model of the round before the initial
        one, where a resumed run had one (its step is the momentum's state)."""
        fedavg.setdefault("min_available_nodes", fedavg.get("min_train_nodes", 2))
        super().__init__(**fedavg)
        if aggregation not in AGGREGATIONS:
            raise ConfigError(f"aggregation {aggregation!r} is not available; choose one of {AGGREGATIONS}")
        if narrow_placement not in NARROW_PLACEMENTS:
            raise ConfigError(f"narrow placement {narrow_placement!r} is not one of {NARROW_PLACEMENTS}")
        self.aggregation = aggregation
        self.schema = schema
        self.model_config = model_config
        self.server_data = server_data
        self.generate = generate  # > 0: each round's server data is this many windows the clients' models write
        options = options or RunSettings(server_device="cpu").merge_options
        self.device = resolve(options.device)  # where the server aligns and merges (server-device)
        self.options = dataclasses.replace(options, device=str(self.device))
        self.tune = tune  # how fedavg-ft trains the merged model on the server data (its seed moves by round)
        self.rate = rate or (lambda server_round: 1.0)
        self.node_tiers: dict[int, float] = {}  # node id → width tier of its last valid reply
        self.placements: dict[int, Placement | None] = {}  # node id → where alignment last put it
        # where a narrow node gets the global model: the principal subspace, or where alignment last put it
        self.principal = places_principal(aggregation, narrow_placement)
        self._sent_state: State | None = None  # this round's global model, for nodes that restrict it themselves
        self._principal: dict[float, Placement] = {}  # tier → this round's principal placement
        self.independent_init = independent_init
        self.node_wait_timeout = node_wait_timeout  # seconds a round waits for enough nodes before it is skipped
        self.drop_unchanged = drop_unchanged  # drop replies identical to what their node was sent (free riders)
        self.round_offset = round_offset
        self.sampler = sampler
        self.server_step = server_step
        self._before = before  # the global model of the round before the current one (server momentum)
        self.hooks = list(hooks)
        self.records: list[RoundRecord] = []
        self.current = RoundRecord(round_offset)
        self.global_arrays: ArrayRecord | None = None
        self.instructions: list[Message] = []  # this round's train messages; the grid sets their ids when it sends
        self._round_start = self._sent = time.perf_counter()

    def summary(self) -> None:
        super().summary()
        log.info("\t├──> Aggregation: %s (align iterations %d), width tiers %s", self.aggregation,
                 self.options.max_iters, sorted(self.schema.shapes))
        log.info("\t└──> %s", guard_note(self.aggregation, self.options.min_gain, self.schema.shapes))

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """FedAvg's sampling, with the global round number and a fresh round record."""
        self._round_start = time.perf_counter()
        self.current = RoundRecord(server_round + self.round_offset)
        self.instructions = []
        if not self.await_nodes(grid, max(self.min_available_nodes, self.min_train_nodes)):
            return []
        if self.sampler is None:
            messages = list(super().configure_train(self.current.round, arrays, config, grid))
        else:
            messages = self._seeded_train(self.current.round, arrays, config, grid, self.sampler)
        self.instructions = self.restrict_to_widths(messages, arrays, self.current.round)
        self._sent = time.perf_counter()
        return self.instructions

    def _seeded_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid,
                      sampler: PartitionSampler) -> list[Message]:
        """FedAvg's train messages, to the nodes ``sampler`` draws for the round (FedAvg's sample size)."""
        chosen = self._seeded_sample(grid, sampler, self.fraction_train, self.min_train_nodes, server_round)
        if not chosen:
            self.current.failure = ("no node said its partition id (a ClientApp without the query handler?); round "
                                    "skipped: sampling='flwr' samples without it")
            log.error("round %d: %s", server_round, self.current.failure)
            return []
        self.current.partitions = list(chosen.values())
        log.info("configure_train: sampled partitions %s", self.current.partitions)
        return self._messages(arrays, config, server_round, list(chosen), MessageType.TRAIN)

    def _seeded_sample(self, grid: Grid, sampler: PartitionSampler, fraction: float, minimum: int, server_round: int,
                       stream: str = "") -> dict[int, int]:
        """FedAvg's sample size (``fraction`` of the connected nodes, at least ``minimum``), drawn by ``sampler``."""
        nodes = list(grid.get_node_ids())
        return sampler.sample(grid, nodes, max(int(len(nodes) * fraction), minimum), server_round, stream)

    def _messages(self, arrays: ArrayRecord, config: ConfigRecord, server_round: int, nodes: list[int],
                  message_type: str) -> list[Message]:
        """FedAvg's messages of ``message_type`` to ``nodes``, carrying the global round number."""
        config[protocol.ROUND_KEY] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return list(self._construct_messages(record, nodes, message_type))

    def await_nodes(self, grid: Grid, needed: int) -> bool:
        """Wait until ``needed`` nodes are connected, at most ``node_wait_timeout`` seconds; False (the round is
        skipped, the reason recorded) if they never are. FedAvg sizes its sample from the nodes connected *before*
        it waits, so a node that joins during the wait would otherwise be left out of the round; and flwr's own
        wait has no deadline."""
        deadline = time.monotonic() + self.node_wait_timeout
        while (connected := len(list(grid.get_node_ids()))) < needed:
            if time.monotonic() >= deadline:
                self.current.failure = (f"only {connected} of the {needed} nodes the round needs connected within "
                                        f"{self.node_wait_timeout:g} s; round skipped")
                log.error("round %d: %s", self.current.round, self.current.failure)
                return False
            log.info("waiting for nodes: %d connected, %d needed", connected, needed)
            time.sleep(NODE_POLL_SECONDS)
        return True

    def restrict_to_widths(self, messages: list[Message], arrays: ArrayRecord, server_round: int = 0) -> list[Message]:
        """Give every node whose width tier is known (from its last reply) the global model at its own width, as
        round ``server_round`` windows it (FedRolex).

        A node not heard from yet gets the full model and restricts it itself the same way (client.app).
        """
        cache: dict[tuple[float, int | None], ArrayRecord] = {}
        self._sent_state, self._principal = arrays.to_torch_state_dict(), {}
        for msg in messages:
            node = msg.metadata.dst_node_id
            if node not in self.node_tiers:
                continue
            tier = self.node_tiers[node]
            if tier == 1.0:
                continue
            placement = self._placement(node, tier)
            key = (tier, id(placement) if placement is not None else None)
            if key not in cache:
                state = restrict(self._sent_state, self.model_config, tier, self.aggregation, placement, server_round)
                cache[key] = ArrayRecord(state)  # type: ignore[arg-type]
            msg.content = RecordDict({self.arrayrecord_key: cache[key],
                                      self.configrecord_key: msg.content[self.configrecord_key]})
        return messages

    def _placement(self, node: int, tier: float) -> Placement | None:
        """Where ``node`` gets this round's global model: where alignment last put it, or the principal placement
        (:func:`federation.restriction.principal_placement`), one per tier and round."""
        if tier == 1.0:
            return None
        if not self.principal:
            return self.placements.get(node)
        if tier not in self._principal:
            assert self._sent_state is not None
            self._principal[tier] = principal_placement(self._sent_state, self.model_config, tier)
        return self._principal[tier]

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """FedAvg's sampling for federated evaluation (or the seeded sampler's, its own draw), each node getting the
        global model at its own width."""
        needed = max(self.min_available_nodes, self.min_evaluate_nodes)
        if self.fraction_evaluate == 0 or not self.await_nodes(grid, needed):
            return []
        server_round += self.round_offset
        if self.sampler is None:
            messages = list(super().configure_evaluate(server_round, arrays, config, grid))
        else:
            chosen = self._seeded_sample(grid, self.sampler, self.fraction_evaluate, self.min_evaluate_nodes,
                                         server_round, stream="evaluate")
            messages = self._messages(arrays, config, server_round, list(chosen), MessageType.EVALUATE)
        return self.restrict_to_widths(messages, arrays, server_round)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate, then merge the valid replies; None (keep the global model) if too few are valid, if the merge
        raises anything at all, or if the merged model is not finite and bounded (the reason goes in the record)."""
        replies = list(replies)
        self.current.nodes_seconds = time.perf_counter() - self._sent
        held = None if self.server_step.plain else self.global_arrays  # plain: no copy of the model
        current = held.to_torch_state_dict() if held is not None else None
        before, self._before = self._before, current  # the step of this round's global model, whatever it merges
        addressees = {m.metadata.message_id: m.metadata.dst_node_id for m in self.instructions}
        valid, dropped = split_replies(replies, self.schema, addressees, self.node_tiers)
        if self.drop_unchanged:
            valid, dropped = self._drop_unchanged(valid, dropped)
        record = self.current
        record.replies, record.valid = len(replies), len(valid)
        if AGGREGATION_TABLE[self.aggregation].full_only:
            valid = self._full_width(valid)
            record.left_out = record.valid - len(valid)
            log.info("round %d: full-width-only left %d narrow replies out", record.round, record.left_out)
        record.dropped = [f"node {node}: {reason}" for node, reason in dropped]
        for line in record.dropped:
            log.warning("round %d: dropped reply from %s", record.round, line)
        if len(valid) < max(1, self.min_train_nodes):
            log.warning("round %d: %d valid replies < min-train-nodes %d; keeping the global model",
                        record.round, len(valid), self.min_train_nodes)
            return None, None
        try:
            return self._merge_valid(record, valid, current, before)
        except Exception as err:  # whatever the replies make the merge do, the run goes on with the global model
            record.failure = f"{type(err).__name__}: {err}".splitlines()[0]
            log.error("round %d: aggregation failed, keeping the global model: %s", record.round, record.failure)
            return None, None

    def _merge_valid(self, record: RoundRecord, valid: list[Message], current: State | None = None,
                     before: State | None = None) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode, merge and check the valid replies, and step the global model ``current`` toward the merge
        (``server_step``, with ``before`` the global model of the round before); run the hooks; the new global
        model, if any."""
        start = time.perf_counter()
        reset_peak_memory(self.device)
        clients = self._capped([self._decode(msg) for msg in valid])
        record.capped = sum(c.weight < float(_metrics(m)[protocol.WEIGHT_KEY])  # type: ignore[arg-type]
                            for c, m in zip(clients, valid, strict=True))
        with released(self.device):
            arrays, metrics = self._aggregate(record, valid, clients)
        if arrays is not None and current is not None and not self.server_step.plain:
            arrays = ArrayRecord(self.server_step(current, before, arrays.to_torch_state_dict()))  # type: ignore[arg-type]
        if arrays is not None and (problem := check_model(arrays)) is not None:
            raise GlmcError(f"the merged model is rejected: {problem}")
        record.aggregate_seconds = time.perf_counter() - start
        record.aggregated = arrays is not None
        self._record_client_metrics(record, valid, metrics)
        for hook in self.hooks:
            hook.on_aggregate(record, clients)
        if arrays is not None:
            self.global_arrays = arrays
        return arrays, metrics

    def _full_width(self, valid: list[Message]) -> list[Message]:
        """``full-width-only``: the full tier's valid replies; the narrow nodes' tiers are remembered for the
        downlink, their replies left out of the average."""
        kept = []
        for msg in valid:
            tier = self._tier(msg)
            self.node_tiers[msg.metadata.src_node_id] = tier
            if tier == 1.0:
                kept.append(msg)
        return kept

    def _drop_unchanged(self, valid: list[Message], dropped: list[tuple[int, str]],
                        ) -> tuple[list[Message], list[tuple[int, str]]]:
        """``drop-unchanged``: the valid replies that are, to the bit, the model their node was sent move to
        ``dropped``."""
        kept = []
        for msg in valid:
            node = msg.metadata.src_node_id
            sent = self._sent_to(node, self._tier(msg))
            if sent is not None and all(torch.equal(v, sent[k]) for k, v in _state(msg).items()):
                dropped.append((node, "identical to the model it was sent (drop-unchanged: a free rider)"))
            else:
                kept.append(msg)
        return kept, dropped

    def _sent_to(self, node: int, tier: float) -> State | None:
        """The global model this round sent ``node``, at its width (None before the first global model)."""
        state = self._sent_state if self._sent_state is not None else (
            self.global_arrays.to_torch_state_dict() if self.global_arrays is not None else None)
        if state is None or tier == 1.0:
            return state
        return restrict(state, self.model_config, tier, self.aggregation, self._placement(node, tier),
                        self.current.round)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """FedAvg's weighted metrics over the evaluate replies that pass :func:`check_evaluate_reply`; the others
        are dropped with a reason in the round's ``evaluate_dropped``."""
        valid, record = [], self.current
        for msg in replies:
            reason = check_evaluate_reply(msg)
            if reason is None:
                valid.append(msg)
            else:
                record.evaluate_dropped.append(f"node {msg.metadata.src_node_id}: {reason}")
                log.warning("round %d: dropped evaluate reply from %s", record.round, record.evaluate_dropped[-1])
        return super().aggregate_evaluate(server_round, valid) if valid else None

    def _tier(self, msg: Message) -> float:
        """The width tier a valid reply reports, as the schema spells it."""
        return self.schema.tier(float(_metrics(msg)[protocol.TIER_KEY])) or 1.0  # type: ignore[arg-type]

    def _decode(self, msg: Message) -> Client:
        """A valid reply as a client model; remembers the node's width tier for the downlink."""
        metrics, tier = _metrics(msg), self._tier(msg)
        node = msg.metadata.src_node_id
        self.node_tiers[node] = tier
        # A principal reply is embedded where its tier's model was placed (a new node placed it itself, the same
        # way); an aligned one is found again by matching from the default embedding (embedding it where it was sent
        # measured 1.0 point worse over 5 seeds of widths-principal)
        placement = self._placement(node, tier) if self.principal else None
        return Client(_state(msg), float(metrics[protocol.WEIGHT_KEY]), tier, placement)  # type: ignore[arg-type]

    def _capped(self, clients: list[Client]) -> list[Client]:
        """The clients with their num-examples capped (:func:`glmc.merging.robust.cap_examples`)."""
        weights = cap_examples([c.weight for c in clients], self.options.robustness)
        return [c if c.weight == w else dataclasses.replace(c, weight=w)
                for c, w in zip(clients, weights, strict=True)]

    def _aggregate(self, record: RoundRecord, valid: list[Message],
                   clients: list[Client]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The one aggregation step: FedAvg (:meth:`_fedavg`) for the averaging aggregations at equal widths and for
        a round that min-alignment-gain sets aside, else :func:`merge`."""
        if AGGREGATION_TABLE[self.aggregation].averages and all(c.tier == 1.0 for c in clients):
            states, configs = universe_states(clients, self.model_config)
            record.distance_before = record.distance_after = embedded_distance(states, configs, self.model_config)
            return self._fedavg(record, valid, clients)
        result = self._merge(record.round, clients)
        record.align_seconds = result.align_seconds
        record.distance_before, record.distance_after = result.distance_before, result.distance_after
        record.unaligned = result.unaligned
        record.clipped_before = result.clipped_before
        for msg, placement in zip(valid, result.placements, strict=True):
            self.placements[msg.metadata.src_node_id] = placement
        if result.state is None:  # set aside: flwr's float32 FedAvg, so the fedavg run's bits exactly
            return self._fedavg(record, valid, clients)
        if result.clipping is not None:
            _record_clipping(record, result.clipping)
        metrics = self.train_metrics_aggr_fn([msg.content for msg in valid], self.weighted_by_key)
        return ArrayRecord(result.state), metrics  # type: ignore[arg-type]

    def _fedavg(self, record: RoundRecord, valid: list[Message],
                clients: list[Client]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """flwr's own FedAvg of the replies, bit for bit, unless a defence acts (a weight capped, a client
        clipped around the global model or recentred, or a robust average): then the robust average of the
        clients."""
        states = [c.state for c in clients]
        anchor = self.global_arrays.to_torch_state_dict() if self.global_arrays is not None else None
        robust = self.options.robustness
        if anchor is None:  # no global model yet (a test's first round): nothing to clip around, as in merge
            clipping = unclipped(states)
        else:
            clipping = recentre_round(clip(states, [anchor] * len(states), robust.clip_ratio), robust,
                                      [c.weight for c in clients])
        _record_clipping(record, clipping)
        if not (record.capped or clipping.acted) and robust.weighted_mean:
            return super().aggregate_train(record.round, valid)
        merged = combine(clipping.states, [c.weight for c in clients], robust)
        metrics = self.train_metrics_aggr_fn([msg.content for msg in valid], self.weighted_by_key)
        return ArrayRecord(merged), metrics  # type: ignore[arg-type]

    def _merge(self, global_round: int, clients: list[Client]) -> MergeResult:
        # With independent inits the round-1 global model is an unrelated random net: no anchor then (server-only
        # trains it: from scratch).
        fresh = self.independent_init and global_round == 1 and self.aggregation not in (*AVERAGING, "server-only")
        anchor = None if fresh or self.global_arrays is None else self.global_arrays.to_torch_state_dict()
        share = self.rate(global_round)
        tune = None if self.tune is None else dataclasses.replace(self.tune, seed=self.tune.seed + global_round,
                                                                  lr=self.tune.lr * share)
        data = self._round_data(global_round, clients)
        result = merge(clients, self.model_config, self.aggregation, at_rate(self.options, share), anchor=anchor,
                       data=data, tune=tune, server_round=global_round)
        return dataclasses.replace(result, align_seconds=result.align_seconds + writing_seconds(data))

    def _round_data(self, global_round: int, clients: list[Client]) -> Dataset | None:
        """The server data of this round: the held-back split, or text the clients' models write in equal shares
        (seeded by the round; its writing time counts as alignment, :func:`glmc.data.generated.writing_seconds`)."""
        if not self.generate:
            return self.server_data
        return generated_text([c.state for c in clients], [scale_width(self.model_config, c.tier) for c in clients],
                              self.generate, seed=global_round, device=self.device)

    def _record_client_metrics(self, record: RoundRecord, valid: list[Message], metrics: MetricRecord | None) -> None:
        if "client-test-accuracy" in self.schema.metric_keys:
            record.mean_client_accuracy = statistics.fmean(
                float(_metrics(m)["client-test-accuracy"]) for m in valid)  # type: ignore[arg-type]
        record.client_peak_gpu_mb = max(float(_metrics(m)["client-peak-gpu-mb"]) for m in valid)  # type: ignore[arg-type]
        record.train_seconds = sum(float(_metrics(m)["train-seconds"]) for m in valid)  # type: ignore[arg-type,misc]
        if metrics is not None and "train-loss" in metrics:
            record.train_loss = float(metrics["train-loss"])  # type: ignore[arg-type]

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: EvaluateFn | None = None) -> Result:
        """flwr's round loop, with ``evaluate_fn`` wrapped to close each round's record and run the hooks."""
        self.global_arrays = initial_arrays
        result = super().start(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config,
                               self._closing(evaluate_fn))
        for hook in self.hooks:
            hook.on_run_end(self.records)
        return result

    def _closing(self, evaluate_fn: EvaluateFn | None) -> EvaluateFn:
        def evaluate_and_close(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            if server_round == 0 and self.round_offset:
                return None  # a resumed run: round `offset` was recorded before it stopped
            start = time.perf_counter()
            metrics = evaluate_fn(server_round + self.round_offset, arrays) if evaluate_fn else None
            self.current.evaluate_seconds = time.perf_counter() - start
            self.end_round(server_round + self.round_offset, arrays, metrics)
            return metrics

        return evaluate_and_close

    def end_round(self, global_round: int, arrays: ArrayRecord, metrics: MetricRecord | None) -> RoundRecord:
        """Close round ``global_round``'s record with its central metrics and run ``on_round_end``."""
        record = self.current if self.current.round == global_round else RoundRecord(global_round)
        if metrics is not None:
            record.central_loss = _optional_float(metrics.get("central-loss"))
            record.central_accuracy = _optional_float(metrics.get("central-accuracy"))
            record.tier_metrics = {k: float(v) for k, v in metrics.items()  # type: ignore[arg-type]
                                   if k.startswith((ACCURACY_AT, LOSS_AT))}
        record.round_seconds = time.perf_counter() - self._round_start if global_round > self.round_offset else 0.0
        record.server_peak_gpu_mb = peak_memory_mb(self.device)  # aggregation and central evaluation
        self.records.append(record)
        for hook in self.hooks:
            hook.on_round_end(record, arrays)
        return record


def _record_clipping(record: RoundRecord, clipping: Clipping) -> None:
    record.clipped, record.spread, record.unmoved = clipping.clipped, clipping.spread, clipping.unmoved
    record.recentred, record.center_spread = clipping.recentred, clipping.center_spread
    if clipping.unmoved:
        log.info("round %d: %d clients did not move from the global model", record.round, clipping.unmoved)
    if clipping.clipped:
        log.warning("round %d: %d clients clipped to the bound around the global model", record.round,
                    clipping.clipped)


def _metrics(msg: Message) -> MetricRecord:
    return next(iter(msg.content.metric_records.values()))


def _state(msg: Message) -> State:
    return next(iter(msg.content.array_records.values())).to_torch_state_dict()  # type: ignore[return-value]


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
