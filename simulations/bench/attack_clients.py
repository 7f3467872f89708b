"""The clients of the attack benches: a seeded vit-tiny global model, three honest clients (its seeded fine-tunes
of 20,000 examples each) and their replies as the SuperLink delivers them, so that :mod:`simulations.bench.
single_attacker` and the audit's figures (:mod:`simulations.analyses.hostile`) send the real strategy one round of
the same clients."""

from __future__ import annotations

import time

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, Metadata, MetricRecord, RecordDict

from federation import protocol
from glmc.archs import build_model
from glmc.core.config import preset
from glmc.train import seed_everything

MODEL = "vit-tiny"
HONEST_EXAMPLES = 20_000
STEP = 0.02  # the standard deviation of an honest client's step from the global model, per weight
State = dict[str, torch.Tensor]


def global_model(seed: int) -> State:
    """The state of a freshly initialised ``MODEL`` of this seed."""
    seed_everything(seed)
    return {k: v.detach().clone() for k, v in build_model(preset(MODEL)).state_dict().items()}


def honest_clients(g: State) -> list[State]:
    """Three honest clients: ``g`` plus seeded Gaussian steps (seed 2)."""
    gen = torch.Generator().manual_seed(2)
    return [{k: v + STEP * torch.randn(v.shape, generator=gen) for k, v in g.items()} for _ in range(3)]


def reply(state: State, examples: int, node: int) -> Message:
    """Node ``node``'s training reply: ``state`` and ``examples`` as its example count, with honest metrics."""
    values = {key: 0.5 for key in protocol.TRAIN_METRICS} | {protocol.TIER_KEY: 1.0, protocol.WEIGHT_KEY: examples}
    meta = Metadata(run_id=1, message_id=f"m{node}", src_node_id=0, dst_node_id=node, reply_to_message_id="",
                    group_id="1", created_at=time.time(), ttl=3600.0, message_type=MessageType.TRAIN)
    # flwr's own constructor for a message as the SuperLink delivers it (metadata given), outside its typed overloads
    instruction = Message(RecordDict({protocol.CONFIG: ConfigRecord()}), metadata=meta)  # type: ignore[call-overload]
    return Message(RecordDict({protocol.ARRAYS: ArrayRecord(state),  # type: ignore[arg-type]
                               protocol.METRICS: MetricRecord(values)}), reply_to=instruction)  # type: ignore[arg-type]
