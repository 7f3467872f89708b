"""Several endpoints learn at once: dual learning (seed 004) and the multi-model refinement (paper §4.3).

Dual learning moves both models toward one shared path θ(λ) = λ π_A(θ_A) + (1−λ) π_B(θ_B); π_A starts at the
identity and π_B at weight matching, and both are exact symmetries. Because every symmetry acts linearly on
parameters and preserves the function of *any* (folded) parameter vector, π_A⁻¹ maps that path point by point
onto λ θ_A + (1−λ) π_A⁻¹π_B(θ_B) with identical losses; so the pairwise result leaves A in place and moves B by
π_A⁻¹ ∘ π_B, and the barrier is the one of the dual path. The multi-model refinement draws the mixing weights
from Dirichlet(c·N·ŵ) over N models already aligned into one universe and learns a transform per model, the
reference fixed: the paper's c = 0.1 spreads them over the simplex, the default c = 10 keeps them near the
weighted mean that a merge keeps (``LearnConfig.concentration``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.utils.data import Dataset

from glmc.archs import get_arch
from glmc.core.config import ModelConfig
from glmc.core.state import State
from glmc.errors import ConfigError, check_weights
from glmc.match.common import MatchResult, require_data
from glmc.match.learned import PLAIN, Endpoint, Latents, Sampler, Scoring, Weights, learn, pair_points
from glmc.match.options import LearnConfig, MatchOptions
from glmc.match.weight import learned_start
from glmc.symmetry.canonical import Form, residual_group
from glmc.symmetry.transforms import Transform, compose, invert

if TYPE_CHECKING:
    from glmc.match.options import MatchOptions


@dataclass
class DualResult:
    """π_A and π_B, and the pairwise result: B moved by π_A⁻¹ ∘ π_B with A left in place (the same path)."""

    transform_a: Transform
    transform_b: Transform
    result: MatchResult


def dual_match(a: State, b: State, cfg: ModelConfig, data: Dataset, options: MatchOptions | None = None, *,
               validation: Dataset | None = None) -> DualResult:
    """Learn π_A and π_B jointly so that λ π_A(θ_A) + (1−λ) π_B(θ_B) has low task loss, λ ~ U(0.4, 0.6), B's side
    starting from weight matching with ``options.weight``."""
    options = options or MatchOptions()
    learn_options, began = options.learn, time.perf_counter()
    fix_ones = residual_group(options.form, get_arch(cfg.family))
    start = learned_start(a, b, cfg, options)
    sides = [Latents(t, cfg, learn_options, fix_ones=fix_ones, seed=i) for i, t in enumerate((Transform(cfg.depth),
                                                                                               start.match.transform))]
    learned = learn([Endpoint(a, sides[0]), Endpoint(start.b, sides[1])], cfg, data,
                    Sampler(learn_options.seed, lam=learn_options.lam), pair_points(learn_options), learn_options,
                    form=options.form, validation=validation)
    ta, learned_b = learned.transforms
    assert ta is not None and learned_b is not None
    tb = start.carried(learned_b)
    result = MatchResult(compose(invert(ta), tb), learned.history, time.perf_counter() - began,
                         learned.info | {"weight_objective": start.match.objective[-1]})
    return DualResult(ta, tb, result)


def _validation_points(weights: Sequence[float], reference: int) -> list[Weights]:
    """The weighted centroid and the midpoint between the reference and every other model."""
    n = len(weights)
    points: list[Weights] = [list(weights)]
    for i, j in itertools.combinations(range(n), 2):
        if reference in (i, j):
            points.append([0.5 if k in (i, j) else 0.0 for k in range(n)])
    return points


def mixing_sampler(weights: Sequence[float], options: LearnConfig) -> Sampler:
    """Mixing weights ~ Dirichlet(c·N·ŵ): mean ŵ (normalised ``weights``), closer to it the larger c."""
    return Sampler(options.seed, alpha=[options.concentration * len(weights) * x for x in weights])


def refine_universe(states: Sequence[State], cfg: ModelConfig, data: Dataset, weights: Sequence[float] | None = None,
                    *, reference: int = 0, form: Form = "standard", options: LearnConfig | None = None,
                    validation: Dataset | None = None, still: Sequence[int] = (), scoring: Scoring = PLAIN,
                    ) -> list[Transform]:
    """Transforms T_i (T_reference = identity) minimising E_w L(Σ_i w_i T_i(θ_i)), w ~ Dirichlet(c·N·ŵ), or the loss
    of the merge and views that ``scoring`` names.

    ``states``: canonical states already aligned into one universe (e.g. by universe matching); ``weights``:
    relative importance ŵ (e.g. example counts, normalised here), uniform by default. Each T_i starts at the
    identity and is an exact symmetry, so T_i(θ_i) computes θ_i's function. ``still``: models that keep the
    identity too; ``scoring``: the merge the caller makes of the moved models and what it serves, so that the loss
    learned and validated is theirs.
    """
    options = options or LearnConfig()
    n = len(states)
    if n < 2 or not 0 <= reference < n:
        raise ConfigError(f"refining a universe needs at least 2 models and a reference among them, got {n}")
    w = [1.0] * n if weights is None else check_weights(weights, n)
    w = [x / sum(w) for x in w]
    fix_ones = residual_group(form, get_arch(cfg.family))
    fixed = {reference, *still}
    if len(fixed) == n:  # nothing may move: the merge is already the refined one
        return [Transform(cfg.depth) for _ in states]
    endpoints = [Endpoint(s, None if i in fixed else
                          Latents(Transform(cfg.depth), cfg, options, fix_ones=fix_ones, seed=i))
                 for i, s in enumerate(states)]
    learned = learn(endpoints, cfg, data, mixing_sampler(w, options), _validation_points(w, reference), options,
                    form=form, validation=validation, scoring=scoring)
    return [t or Transform(cfg.depth) for t in learned.transforms]


# The registry's entry points (glmc.match.registry): canonical states a, b of cfg, the training data, MatchOptions.
def pairwise(a: State, b: State, cfg: ModelConfig, data: Dataset | None, options: MatchOptions) -> MatchResult:
    """Dual learned matching; B moved by π_A⁻¹ ∘ π_B, A in place."""
    return dual_match(a, b, cfg, require_data(data), options).result
