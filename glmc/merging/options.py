"""How a merge runs, as one frozen object that the CLI builds from its flags, the API from its keywords and the FL
strategy from its run config: the method, the pairwise matcher's options, universe matching's iterations and
workers, how narrow models fill the universe, the corrections afterwards, robustness and the device."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from glmc.errors import ConfigError, check_options
from glmc.match.options import MatchOptions
from glmc.match.registry import get_method
from glmc.merging.corrections import Corrections
from glmc.merging.robust import Robustness
from glmc.merging.widths import FILLS


@dataclass(frozen=True)
class MergeOptions:
    """One merge's options. ``method`` is a registry method that merges N models (glmc.match.registry)."""

    method: str = "weight"
    match: MatchOptions = field(default_factory=MatchOptions)  # each pairwise matching (its form stays standard)
    max_iters: int = 5  # universe iterations
    tol: float = 1e-3  # stop once U, or the mean distance to it, moves less than this (relative)
    workers: int = 1  # processes for each iteration's N pairwise alignments
    fill: str = "zeros"  # how narrow models fill the universe's extra heads and units
    corrections: Corrections = field(default_factory=Corrections)
    robustness: Robustness = field(default_factory=Robustness.off)  # clipping and the robust average (FL)
    min_gain: float = 0.0  # equal widths: below this relative distance gain, set the alignment aside (0 = off)
    # a method that does not match, at one width: average the models with their norms folded (FL's canonical
    # ablation), not as trained (the paper's vanilla baseline)
    fold_norms: bool = False
    device: str = "cpu"  # where the merge is computed; the result stays there

    def __post_init__(self) -> None:
        get_method(self.method, merging=True)
        check_options("merge", [("≥ 1", lambda v: v >= 1, {"max_iters": self.max_iters, "workers": self.workers}),
                                ("finite and ≥ 0", lambda v: math.isfinite(v) and v >= 0, {"tol": self.tol}),
                                ("in [0, 1)", lambda v: 0 <= v < 1, {"min_gain": self.min_gain})])
        if self.fill not in FILLS:
            raise ConfigError(f"unknown fill {self.fill!r}; known: {', '.join(FILLS)}")

    @property
    def reads_data(self) -> bool:
        """Whether the method itself reads training data (the corrections may too: :attr:`Corrections.samples`)."""
        return get_method(self.method).reads_data
