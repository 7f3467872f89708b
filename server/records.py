"""What a round records, and the named hooks that read it (metrics files, checkpoints, plots): the strategy writes
records and calls the hooks; the guard, the hooks and the app read them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from flwr.app import ArrayRecord

from federation.protocol import Client


@dataclass
class RoundRecord:
    """Everything one round measured; JSON-able through ``asdict``."""

    round: int
    partitions: list[int] = field(default_factory=list)  # the partitions seeded sampling drew (server.sampling)
    replies: int = 0
    valid: int = 0
    dropped: list[str] = field(default_factory=list)  # "node N: reason"
    evaluate_dropped: list[str] = field(default_factory=list)  # federated evaluation replies dropped, "node N: reason"
    aggregated: bool = False
    failure: str | None = None  # why the valid replies could not be merged, or the merge was rejected (model kept)
    central_loss: float | None = None
    central_accuracy: float | None = None
    # the global model at every width tier of the run, as that tier's clients receive it, on the central test set:
    # "accuracy@<tier>" and "loss@<tier>" (tier as in width-tiers, "1" the full model)
    tier_metrics: dict[str, float] = field(default_factory=dict)
    mean_client_accuracy: float | None = None  # each client's trained model on the central test subset
    ensemble_loss: float | None = None  # logit ensemble of the valid clients' models (ensemble-eval)
    ensemble_accuracy: float | None = None
    train_loss: float | None = None  # example-weighted over valid replies
    align_seconds: float = 0.0
    aggregate_seconds: float = 0.0  # decoding + alignment + averaging
    round_seconds: float = 0.0  # configure_train to the end of central evaluation
    # where the round's time went: the instructions sent to the last reply in (the nodes' training and testing, the
    # engine's scheduling and transport), of it the valid clients' own training (summed over them), and central
    # evaluation at every tier; aggregate_seconds is the rest
    nodes_seconds: float = 0.0
    train_seconds: float = 0.0
    evaluate_seconds: float = 0.0
    distance_before: float | None = None  # mean pairwise client distance, canonical form
    distance_after: float | None = None
    unaligned: bool = False  # min-alignment-gain set this round's alignment aside: the clients were averaged (FedAvg)
    capped: int = 0  # replies whose num-examples the cap lowered (glmc.merging.robust)
    clipped_before: int = 0  # aligned aggregations: clients scaled down before matching (glmc.merging.robust.screen)
    clipped: int = 0  # clients clipped around the global model where they are averaged (after matching)
    recentred: int = 0  # clients then pulled toward the round's coordinate-wise median (equal widths)
    center_spread: float | None = None  # the farthest client's distance from that median over the lower median's
    spread: float | None = None  # the farthest client's distance from the global model over the lower median's
    unmoved: int = 0  # valid clients that came back where the global model put them (free riders, no-step stragglers)
    left_out: int = 0  # full-width-only: valid narrow replies left out of the average
    server_peak_gpu_mb: float = 0.0  # peak GPU memory of the server's aggregation and evaluation (0 on a CPU)
    client_peak_gpu_mb: float = 0.0  # the largest peak GPU memory a valid client reported

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def accuracy_at(self, tier: str) -> float | None:
        """The central accuracy of the global model at width tier ``tier`` (as written: "0.5"), if measured."""
        return self.tier_metrics.get(f"{ACCURACY_AT}{tier}")


ACCURACY_AT, LOSS_AT = "accuracy@", "loss@"  # the per-tier metric keys: "accuracy@0.5"


def tier_name(tier: float) -> str:
    """A width tier as the metric keys write it: "1", "0.5"."""
    return f"{tier:g}"


def first_round_at(points: Iterable[tuple[int, float | None]], target: float) -> int | None:
    """The first round of (round, accuracy) ``points`` whose accuracy reaches ``target`` (None: none does)."""
    return next((round_ for round_, accuracy in points if accuracy is not None and accuracy >= target), None)


def rounds_to_target(records: Sequence[RoundRecord], tiers: Sequence[float], target: float) -> dict[str, int | None]:
    """Per width tier, the first round at which the global model at that tier reaches ``target`` central accuracy
    (None: never in these records)."""
    return {tier_name(t): first_round_at(((r.round, r.accuracy_at(tier_name(t))) for r in records), target)
            for t in tiers}


class RoundHooks:
    """Named per-round hooks; subclass and override what you need (the defaults do nothing)."""

    def on_aggregate(self, record: RoundRecord, clients: Sequence[Client]) -> None:
        """After the valid replies of round ``record.round`` were merged; ``clients`` are the decoded models."""

    def on_round_end(self, record: RoundRecord, arrays: ArrayRecord) -> None:
        """After round ``record.round`` was aggregated and evaluated; ``arrays`` is the global model."""

    def on_run_end(self, records: Sequence[RoundRecord]) -> None:
        """After the last round."""
