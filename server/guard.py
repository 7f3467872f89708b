"""The min-alignment-gain guard in words: what the ServerApp says about it when a run starts, and how many rounds it
set aside when the run ends.

At the defaults, clients fine-tuned from one shared global model are already in one basin: matching brings them
only about 1% closer, the guard sets every such round aside, and the run is FedAvg's. Without these lines a first
run looks as if alignment did nothing, with the reason nowhere in sight.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from federation.settings import GUARDED, REFINED

if TYPE_CHECKING:
    from server.records import RoundRecord

SEE_IT_ACT = "to see alignment act, start the clients apart (init='independent') or set min-alignment-gain=0"


def guard_note(aggregation: str, min_gain: float, tiers: Iterable[float]) -> str:
    """One line on the guard for this run: whether it can act, and what a set-aside round is."""
    if aggregation not in GUARDED:
        return f"min-alignment-gain: not used by aggregation {aggregation!r} (only by {', '.join(GUARDED)})"
    if not min_gain:
        return "min-alignment-gain=0: every round keeps its alignment"
    closer = (f"min-alignment-gain={min_gain:g}: a round whose matching brings the clients less than "
              f"{100 * min_gain:g}% closer (mean pairwise distance)")
    if aggregation in REFINED:
        return f"{closer} is refined from where the clients were placed, unmatched"
    if any(t != 1.0 for t in tiers):
        return f"{closer} is merged with the clients where they were placed, unmatched (the canonical ablation's merge)"
    return f"{closer} is averaged unaligned, as FedAvg; from a shared start that is most rounds, so {SEE_IT_ACT}"


def set_aside_note(records: Sequence[RoundRecord]) -> str:
    """How many of the run's trained rounds the guard set aside (merged unmatched: FedAvg at equal widths)."""
    rounds = [r for r in records if r.round > 0 and r.aggregated]
    aside = sum(r.unaligned for r in rounds)
    if not aside:
        return f"min-alignment-gain set aside 0 of {len(rounds)} aggregated rounds"
    every = " (every one: this run is FedAvg's)" if aside == len(rounds) else ""
    return (f"min-alignment-gain set aside {aside} of {len(rounds)} aggregated rounds{every}: their matching brought "
            "the clients too little closer, so they were merged unmatched (at equal widths: FedAvg; learned refines "
            f"it); {SEE_IT_ACT}")
