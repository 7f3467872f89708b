"""Seeded client sampling: each round's sample is drawn from the nodes' partition ids by the run's seed and the
round, so two runs of one seed (two aggregations of a grid, or a run and its resumption) train the same clients in
every round. flwr's own sampler draws node ids unseeded, and node ids are new in every run, so without this two
runs of a seed differ by which clients they trained as well as by what they did."""

from __future__ import annotations

import logging
import random

from flwr.app import Message, MessageType, RecordDict
from flwr.serverapp import Grid

from federation import protocol

log = logging.getLogger(__name__)


def said_partition(answer: Message) -> int | None:
    """The partition id a roll-call answer says: a non-negative integer, else None, with one line naming what came
    instead (a node's reply must not stop the round)."""
    if answer.has_error() or protocol.METRICS not in answer.content.metric_records:
        return None
    value = answer.content.metric_records[protocol.METRICS].get(protocol.PARTITION_KEY)
    if isinstance(value, int) and value >= 0:
        return value
    if value is not None:
        log.warning("node %d said partition id %.60r, not a non-negative integer: it is not sampled",
                    answer.metadata.src_node_id, value)
    return None


class PartitionSampler:
    """Samples nodes by partition id; learns each node's partition id once, by a query message (a roll call)."""

    def __init__(self, seed: int, timeout: float) -> None:
        self.seed, self.timeout = seed, timeout  # timeout: seconds a roll call waits for its replies
        self.partitions: dict[int, int] = {}  # node id → partition id

    def roll_call(self, grid: Grid, nodes: list[int]) -> None:
        """Ask the nodes whose partition id is not known yet for it; a node that does not answer stays unknown."""
        unknown = [node for node in nodes if node not in self.partitions]
        if not unknown:
            return
        asks = [Message(RecordDict(), message_type=MessageType.QUERY, dst_node_id=node) for node in unknown]
        asked = set(unknown)
        owners = {partition: node for node, partition in reversed(self.partitions.items())}  # the first to say it
        for answer in grid.send_and_receive(asks, timeout=self.timeout):
            node = answer.metadata.src_node_id
            if node in asked and (partition := said_partition(answer)) is not None:
                if partition in owners:
                    log.warning("node %d says partition %d, as node %d did: both may be sampled", node, partition,
                                owners[partition])
                owners.setdefault(partition, node)
                self.partitions[node] = partition
        if missing := [node for node in unknown if node not in self.partitions]:
            log.warning("%d of %d nodes did not say their partition id; they are not sampled until they do",
                        len(missing), len(unknown))

    def sample(self, grid: Grid, nodes: list[int], size: int, server_round: int, stream: str = "") -> dict[int, int]:
        """``size`` of the connected ``nodes`` whose partition is known, drawn by (seed, round, ``stream``: "" for
        training, "evaluate" for federated evaluation, a draw of its own): node id → partition."""
        self.roll_call(grid, nodes)
        known = sorted((self.partitions[node], node) for node in nodes if node in self.partitions)
        key = f"{self.seed}/{server_round}" + (f"/{stream}" if stream else "")
        chosen = random.Random(key).sample(known, min(size, len(known)))
        return {node: partition for partition, node in sorted(chosen)}
