"""Soft permutations (paper App. D): heads and MLP units mixed by Sinkhorn(exp Z), learned like Algorithm 1.

The latents start at the weight-matching permutations plus Xavier-scaled noise (App. D.2) and the residual is
learned by its polar projection as in learned matching. A doubly stochastic matrix is not a symmetry, so the
aligned endpoint only approximates B: the result reports the midpoint gain over weight matching *and* the
endpoint error, max |logits(T_soft(θ_B)) − logits(θ_B)| and the change of B's loss, on the validation split.
"""

from __future__ import annotations

import logging
import time

import torch
from torch.utils.data import DataLoader, Dataset

from glmc.archs import get_arch
from glmc.core.config import ModelConfig
from glmc.core.state import State
from glmc.match.common import MatchResult, require_data
from glmc.match.learned import Endpoint, Latents, Path, Sampler, learn, pair_points
from glmc.match.options import MatchOptions
from glmc.match.weight import warm_start
from glmc.symmetry.canonical import Form, residual_group
from glmc.symmetry.exactness import TOLERANCE
from glmc.symmetry.transforms import Transform
from glmc.train import target_count, token_loss

log = logging.getLogger(__name__)


@torch.no_grad()
def endpoint_error(b: State, t: Transform, cfg: ModelConfig, data: Dataset, form: Form = "standard",
                   ) -> dict[str, float]:
    """Max |logit difference| between T(θ_B) and θ_B, and the loss change L(T(θ_B)) − L(θ_B), on ``data`` (float64)."""
    path = Path([Endpoint(b)], cfg, form, torch.float64)
    original, moved = path.point([None], [1.0]), path.point([t], [1.0])
    worst, change, count = 0.0, 0.0, 0
    for x, y in DataLoader(data, batch_size=256):
        before, after = path.logits(original, x), path.logits(moved, x)
        worst = max(worst, float((after - before).abs().max()))
        y = y.to(path.device)
        change += float(token_loss(after, y, reduction="sum") - token_loss(before, y, reduction="sum"))
        count += target_count(y)
    return {"endpoint_max_logit_error": worst, "endpoint_loss_change": change / count}


def soft_match(a: State, b: State, cfg: ModelConfig, data: Dataset, options: MatchOptions | None = None, *,
               validation: Dataset | None = None) -> MatchResult:
    """Learn soft head and MLP permutations and the residual map for λ θ_A + (1−λ) T(θ_B) (App. D.3), from weight
    matching with ``options.weight`` and with ``options.learn``.

    The transform's ``heads`` and ``mlp`` are dense doubly stochastic matrices (``apply`` accepts them);
    ``info`` holds the midpoint gain over weight matching and the endpoint error.
    """
    options = options or MatchOptions()
    form, began = options.form, time.perf_counter()
    fix_ones = residual_group(form, get_arch(cfg.family))
    init = warm_start(a, b, cfg, options)
    learn_options = options.learn
    latents = Latents(init.transform, cfg, learn_options, fix_ones=fix_ones, soft=True)
    learned = learn([Endpoint(a), Endpoint(b, latents)], cfg, data, Sampler(learn_options.seed, lam=learn_options.lam),
                    pair_points(learn_options), learn_options, form=form, validation=validation)
    transform = learned.transforms[1]
    assert transform is not None
    gain = learned.history[0] - min(learned.history)
    error = endpoint_error(b, transform, cfg, learned.validation, form)
    if error["endpoint_max_logit_error"] > TOLERANCE:
        log.warning("soft permutations: the aligned B is not B's function (max |Δlogit| %.3g, loss change %+.4f "
                    "on the validation split)", error["endpoint_max_logit_error"], error["endpoint_loss_change"])
    info = learned.info | {"midpoint_gain": gain} | error
    return MatchResult(transform, learned.history, time.perf_counter() - began, info)


# The registry's entry points (glmc.match.registry): canonical states a, b of cfg, the training data, MatchOptions.
def pairwise(a: State, b: State, cfg: ModelConfig, data: Dataset | None, options: MatchOptions) -> MatchResult:
    """Soft permutations from weight matching."""
    return soft_match(a, b, cfg, require_data(data), options)
