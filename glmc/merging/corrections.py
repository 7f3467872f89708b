"""The corrections applied to a merged model after universe matching, in one order for every front-end (the CLI, the
API and the FL strategy): merge the heads as circuits, restore the units' norms, refit the linear layers, then REPAIR
the channels' statistics. Each reads the aligned inputs, so each sees the merge the previous one left."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch.utils.data import Dataset

from glmc.core.config import ModelConfig
from glmc.core.options import option
from glmc.core.state import State
from glmc.errors import ConfigError
from glmc.merging.circuits import merge_circuits
from glmc.merging.refit import refit
from glmc.merging.repair import repair
from glmc.merging.rescale import restore_norms
from glmc.merging.widths import Placement

ALL = None  # a correction's sample count meaning every sample of the data it is given


@dataclass(frozen=True)
class Corrections:
    """Which corrections run. ``refit`` and ``repair``: 0 off, N the first N training samples, None all of them."""

    # The run config switches each on (refit and repair then read all of the server's samples); the CLI has its own
    # flags, with sample counts.
    restore_norms: bool = option(False, "rescale the merged units to the inputs' mean norm (glmc.merging.rescale)",
                                 flag=None, key="restore-norms")
    refit: int | None = option(0, "refit the merged layers to the inputs' mean outputs (glmc.merging.refit)",
                               flag=None, key="refit", switch=ALL)
    repair: int | None = option(0, "reset the merged channels' mean and std to the inputs' (glmc.merging.repair)",
                                flag=None, key="repair", switch=ALL)
    circuit_heads: bool = option(False, "refit the merged heads to the inputs' mean circuits (glmc.merging.circuits)",
                                 flag=None, key="circuit-heads")

    def __post_init__(self) -> None:
        if any(n is not None and n < 0 for n in (self.refit, self.repair)):
            raise ConfigError(f"refit and repair take a sample count ≥ 0, got {self.refit} and {self.repair}")

    @property
    def samples(self) -> int | None:
        """Training samples the corrections read: the most either asks for (None: all; 0: none)."""
        counts = [n for n in (self.refit, self.repair) if n != 0]
        return ALL if ALL in counts else max(counts, default=0)  # type: ignore[type-var]

    def apply(self, merged: State, aligned: Sequence[State], cfg: ModelConfig, data: Dataset | None,
              weights: Sequence[float] | None, placements: Sequence[Placement] | None = None) -> State:
        """``merged`` (canonical, standard form) after every correction asked for, against the aligned inputs
        (canonical, in the merge's basis; ``placements``: where each sits in the universe)."""
        if self.circuit_heads:
            if placements is not None and any(p.narrow != cfg for p in placements):
                raise ConfigError("heads merged as circuits need inputs of one width")
            merged = merge_circuits(merged, aligned, cfg, weights)
        if self.restore_norms:
            merged = restore_norms(merged, aligned, cfg, weights)
        if self.refit != 0:
            merged = refit(merged, aligned, cfg, data, self.refit, weights, placements=placements)
        if self.repair != 0:
            merged = repair(merged, aligned, cfg, data, self.repair, weights)
        return merged
