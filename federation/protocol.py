"""What the ServerApp and the ClientApps exchange: record names and the metric keys of each reply.

A train reply holds one ArrayRecord (the model's own state dict, float32, at the client's width)
and one MetricRecord with exactly ``TRAIN_METRICS``. MetricRecords take only int and float, so
every value is converted with ``float()``/``int()`` before it is sent (no numpy scalars, no bool).
"""

from __future__ import annotations

ARRAYS = "arrays"
METRICS = "metrics"
CONFIG = "config"
WEIGHT_KEY = "num-examples"
TIER_KEY = "width-tier"
ROUND_KEY = "server-round"  # set by FedAvg.configure_train; this project sends the global round

TRAIN_METRICS = frozenset({
    WEIGHT_KEY,
    TIER_KEY,
    "train-loss",
    "train-steps",
    "train-seconds",
    "client-test-loss",  # the client's freshly trained model on the central test subset
    "client-test-accuracy",
    "client-peak-gpu-mb",  # peak GPU memory of the round's training and evaluation (0 on a CPU)
})
EVALUATE_METRICS = frozenset({WEIGHT_KEY, "eval-loss", "eval-accuracy"})
WIRE_DTYPE = "float32"
