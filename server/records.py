"""What a round records, and the named hooks that read it (metrics files, checkpoints, plots): the strategy writes
records and calls the hooks; the guard, the hooks and the app read them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from flwr.app import ArrayRecord

from federation.protocol import Client


@dataclass
class RoundRecord:
    """Everything one round measured; JSON-able through ``asdict``."""

    round: int
    replies: int = 0
    valid: int = 0
    dropped: list[str] = field(default_factory=list)  # "node N: reason"
    evaluate_dropped: list[str] = field(default_factory=list)  # federated evaluation replies dropped, "node N: reason"
    aggregated: bool = False
    failure: str | None = None  # why the valid replies could not be merged, or the merge was rejected (model kept)
    central_loss: float | None = None
    central_accuracy: float | None = None
    mean_client_accuracy: float | None = None  # each client's trained model on the central test subset
    ensemble_loss: float | None = None  # logit ensemble of the valid clients' models (ensemble-eval)
    ensemble_accuracy: float | None = None
    train_loss: float | None = None  # example-weighted over valid replies
    align_seconds: float = 0.0
    aggregate_seconds: float = 0.0  # decoding + alignment + averaging
    round_seconds: float = 0.0  # configure_train to the end of central evaluation
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
    server_peak_gpu_mb: float = 0.0  # peak GPU memory of the server's aggregation and evaluation (0 on a CPU)
    client_peak_gpu_mb: float = 0.0  # the largest peak GPU memory a valid client reported

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RoundHooks:
    """Named per-round hooks; subclass and override what you need (the defaults do nothing)."""

    def on_aggregate(self, record: RoundRecord, clients: Sequence[Client]) -> None:
        """After the valid replies of round ``record.round`` were merged; ``clients`` are the decoded models."""

    def on_round_end(self, record: RoundRecord, arrays: ArrayRecord) -> None:
        """After round ``record.round`` was aggregated and evaluated; ``arrays`` is the global model."""

    def on_run_end(self, records: Sequence[RoundRecord]) -> None:
        """After the last round."""
