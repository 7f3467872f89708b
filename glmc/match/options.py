"""How a pairwise matcher runs, as one frozen object that every method of the registry takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from glmc.match.weight import DEFAULT_START, Start, WeightOptions

if TYPE_CHECKING:
    from glmc.match.learned import LearnConfig
    from glmc.symmetry.canonical import Form


@dataclass(frozen=True)
class MatchOptions:
    """The form the states are in, activation matching's sample count, the learned methods' options, and where the
    weight matching that the weight and learned methods run starts, with its costs (None: glmc's defaults)."""

    form: Form = "standard"
    batch: int = 512  # activation matching: the first ``batch`` inputs of the data
    learn: LearnConfig | None = None
    start: Start = DEFAULT_START
    weight: WeightOptions | None = None
