"""Every pairwise alignment method, declared once: its name, the options it reads, what data it reads, where it runs,
whether it merges N models, and its function. The CLI's choices and flags, the API's checks, the FL aggregations'
"reads server data" marks and the docs read this table, and no other module names a method to decide what to do;
it imports no torch, and each method's function is imported only when it runs."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from glmc.errors import ConfigError

if TYPE_CHECKING:
    from glmc.match.common import MatchResult


@dataclass(frozen=True)
class Method:
    """One alignment method. ``function`` is ``module:name`` of its pairwise matcher, called as
    ``f(a, b, cfg, data, options)`` on canonical states (:class:`glmc.match.options.MatchOptions`); None: no matching
    (the models as trained)."""

    name: str
    summary: str
    function: str | None
    # the sections of MatchOptions it reads (each a dataclass of glmc.match.options, its flags and keys declared there)
    options: tuple[str, ...] = ()
    reads_data: bool = False  # reads training inputs (activations, or a loss to learn the maps on)
    # reads only the first ActivationOptions.batch inputs: a universe's worker processes get that small sample
    reads_sample: bool = False
    reads_labels: bool = False  # reads their labels too, when it learns against labels (the default off generated text)
    learns: bool = False  # learns its maps by gradient on that data (LearnConfig's options apply)
    exact: bool = True  # moves B by an exact symmetry, so it computes the same function (soft only approximates)
    # merging N models: the pairwise method each universe iteration runs (None: it does not merge N models) ...
    merge_pairwise: str | None = None
    refines: bool = False  # ... finished by the multi-model learned refinement (paper §4.3)
    # matches a small model on the CPU when the models sit on a GPU (glmc.merging.universe.HOST_MATCH_MAX_PARAMS)
    host_when_small: bool = False

    @property
    def matches(self) -> bool:
        """Whether it moves B at all (``none`` leaves the models as trained)."""
        return self.function is not None

    @property
    def guarded(self) -> bool:
        """Whether a merge may set its matching aside when it brings the models too little closer
        (:attr:`glmc.merging.options.MergeOptions.min_gain`): any method that matches (one that refines then refines
        the unmatched models)."""
        return self.matches

    def match(self) -> Callable[..., MatchResult]:
        """The pairwise matcher, imported now."""
        if self.function is None:
            raise ConfigError(f"method {self.name!r} does not match: it leaves the models as trained")
        module, name = self.function.split(":")
        return getattr(importlib.import_module(module), name)


# A method that reads ``symmetry`` searches the whole declared group unless told otherwise (SymmetryOptions); the
# permutation-only ablations search their subgroup and do not, nor do soft permutations, which only approximate B.
WEIGHT = ("symmetry", "weight")  # weight matching's options (glmc.match.options.WeightOptions)
LEARNED = ("symmetry", "weight", "learn")  # the learned methods: the weight matching they start from, then LearnConfig
PERMUTATIONS = ("weight",)  # weight matching's options, on permutations alone
LEARNED_PERMUTATIONS = ("weight", "learn")  # the learned methods that search their subgroup alone

METHODS: dict[str, Method] = {m.name: m for m in (
    Method("none", "no alignment: the models as trained (the vanilla baseline)", None, merge_pairwise="none"),
    Method("weight", "weight matching: residual orthogonal maps, head and MLP permutations, within-head maps (§4.1)",
           "glmc.match.weight:pairwise", WEIGHT, merge_pairwise="weight", host_when_small=True),
    Method("weight-perm", "weight matching with head and MLP permutations only, the residual stream left alone",
           "glmc.match.weight:pairwise_permutations", PERMUTATIONS, merge_pairwise="weight-perm"),
    Method("weight-perm-stream", "weight matching with permutations only: of the residual stream, heads and MLP units",
           "glmc.match.weight:pairwise_stream_permutations", PERMUTATIONS, merge_pairwise="weight-perm-stream"),
    Method("activation", "activation matching: correlations of the models' activations on training inputs",
           "glmc.match.activation:pairwise", ("symmetry", "activation"), reads_data=True, reads_sample=True,
           merge_pairwise="activation"),
    Method("learned", "learned matching: the maps trained so that the midpoint model's loss falls (Algorithm 1)",
           "glmc.match.learned:pairwise", LEARNED, reads_data=True, reads_labels=True, learns=True,
           merge_pairwise="weight", refines=True),
    Method("learned-perm", "learned matching with permutations only",
           "glmc.match.learned:pairwise_permutations", LEARNED_PERMUTATIONS, reads_data=True, reads_labels=True,
           learns=True),
    Method("soft", "soft permutations: doubly stochastic mixing, learned (approximates B; paper App. D)",
           "glmc.match.soft:pairwise", LEARNED_PERMUTATIONS, reads_data=True, reads_labels=True, learns=True,
           exact=False),
    Method("dual", "dual learned matching: both endpoints learn their maps toward one shared path",
           "glmc.match.dual:pairwise", LEARNED, reads_data=True, reads_labels=True, learns=True),
)}
MERGE_METHODS = tuple(name for name, m in METHODS.items() if m.merge_pairwise is not None)
OPTION_SECTIONS = tuple(dict.fromkeys(s for m in METHODS.values() for s in m.options))  # every section a method reads


def get_method(name: str, merging: bool = False) -> Method:
    """The registered method (one that merges N models, with ``merging``), or a ConfigError naming the known ones."""
    known = MERGE_METHODS if merging else tuple(METHODS)
    if name not in known:
        what = "merge method" if merging else "alignment method"
        raise ConfigError(f"unknown {what} {name!r}; known: {', '.join(known)}")
    return METHODS[name]
