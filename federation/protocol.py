"""What the ServerApp and the ClientApps exchange: record names and the metric keys of each reply.

A train reply holds one ArrayRecord (the model's own state dict, float32, at the client's width)
and one MetricRecord with exactly ``TRAIN_METRICS``. MetricRecords take only int and float, so
every value is converted with ``float()``/``int()`` before it is sent (no numpy scalars, no bool). A valid reply
is decoded into a :class:`Client`, which the strategy, its merge and its hooks all read.
"""

from __future__ import annotations

from dataclasses import dataclass

from glmc.core.config import ModelConfig, scale_width
from glmc.core.state import State
from glmc.merging.universe import Member
from glmc.merging.widths import Placement

ARRAYS = "arrays"
METRICS = "metrics"
CONFIG = "config"
WEIGHT_KEY = "num-examples"
TIER_KEY = "width-tier"
ROUND_KEY = "server-round"  # set by FedAvg.configure_train; this project sends the global round
PARTITION_KEY = "partition-id"  # a node's answer to the roll call of seeded sampling (server.sampling)

TRAIN_METRICS = frozenset({
    WEIGHT_KEY,
    TIER_KEY,
    "train-loss",
    "train-steps",
    "train-seconds",
    "client-test-loss",  # the client's freshly trained model on the central test subset (run-config client-test)
    "client-test-accuracy",
    "client-peak-gpu-mb",  # peak GPU memory of the round's training and evaluation (0 on a CPU)
})
CLIENT_TEST_METRICS = frozenset({"client-test-loss", "client-test-accuracy"})
EVALUATE_METRICS = frozenset({WEIGHT_KEY, "eval-loss", "eval-accuracy"})
WIRE_DTYPE = "float32"


def train_metrics(client_test: bool) -> frozenset[str]:
    """The metric keys of a train reply: without the client's central test score where the run does not ask for it."""
    return TRAIN_METRICS if client_test else TRAIN_METRICS - CLIENT_TEST_METRICS


@dataclass(frozen=True)
class Client:
    """One valid train reply, decoded: its native state, example count and width tier, and where a narrow one sits
    in the universe (None: the default place; matching finds it)."""

    state: State
    weight: float
    tier: float
    placement: Placement | None = None

    def member(self, full: ModelConfig) -> Member:
        """This reply as a model of a merge into ``full`` (:func:`glmc.merging.merge.merge_models`)."""
        return Member(self.state, scale_width(full, self.tier), self.weight, self.placement)
