"""Merging models of one width by a data-free method in one universe iteration without a copy of any model: each
model aligned to the first over canonical forms made tensor by tensor (as ``glmc align`` aligns a pair), and the
merged model made tensor by tensor on each read, as it is written. Bit for bit what :func:`merge_models` gives
there (tests/test_lazy_merge.py); :func:`whole_merge_needed` names the cases that need the whole-state path."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from glmc.archs import get_arch
from glmc.core.config import ModelConfig
from glmc.core.state import Lazy
from glmc.device import release_heap, resolve
from glmc.errors import ConfigError
from glmc.match.align import match_pair
from glmc.match.balance import balance, balances
from glmc.match.registry import get_method
from glmc.merging.corrections import Corrections
from glmc.merging.merge import MergeSetup
from glmc.merging.options import MergeOptions
from glmc.merging.robust import Robustness
from glmc.merging.universe import Member
from glmc.merging.widths import lstsq_merge, place
from glmc.symmetry.canonical import canonical_view
from glmc.symmetry.transforms import moved


def whole_merge_needed(configs: Sequence[ModelConfig], options: MergeOptions, target: ModelConfig) -> str | None:
    """Why :func:`glmc.merging.merge.merge_models` must hold the models whole to merge inputs of ``configs`` into
    ``target`` with ``options`` (None: the streamed merge gives the same model)."""
    entry = get_method(options.method)
    reasons = [
        (not entry.matches or entry.reads_data, f"method {options.method} is not a data-free matching"),
        (any(c != target for c in configs), "the inputs are embedded across widths"),
        (options.max_iters != 1, "universe iterations after the first align every model to the mean of all of them "
                                 "(--iters 1 streams)"),
        (options.corrections != Corrections(), "the corrections read every aligned model"),
        (options.robustness != Robustness.off(), "robust merging reads every aligned model"),
        (resolve(options.device).type != "cpu", "on a GPU the whole-state path matches where the models fit"),
    ]
    return next((why for needed, why in reasons if needed), None)


def stream_merge(members: Sequence[Member], setup: MergeSetup) -> tuple[Lazy, float]:
    """The merged canonical model (float64) of native ``members`` of ``setup.target``, where
    :func:`whole_merge_needed` says None: each tensor the weighted mean of the models moved towards the first, made on
    each read; and the seconds the alignments took. As :func:`glmc.merging.universe.universe_match`'s first iteration
    does, the first model is aligned to itself too, and each matching is ``match_pair``'s with its default
    ``recovered`` (not ``glmc align``'s share for half-precision inputs, which the whole-state path never uses)."""
    if any(m.placement is not None for m in members):
        raise ConfigError("a streamed merge starts every model where it is: no start placements")
    cfg, options = setup.target, setup.options
    arch, match = get_arch(cfg.family), dataclasses.replace(setup.options.match, form="standard")
    views = [canonical_view(arch, m.state, cfg, "standard", torch.float64) for m in members]
    start = time.perf_counter()
    balanced = balance(views[0], cfg) if balances(options.method, match) else None
    aligned = [moved(v, arch.spec, match_pair(options.method, views[0], v, cfg, None, match,  # type: ignore[arg-type]
                                              balanced).transform, cfg.heads) for v in views]
    seconds = time.perf_counter() - start
    release_heap()  # the matchings' freed blocks, before the merged model is made and written tensor by tensor
    placements, weights = [place(cfg, cfg)] * len(members), [m.weight for m in members]
    return Lazy(views[0], lambda name: lstsq_merge([{name: a[name]} for a in aligned], placements, weights)[name]), \
        seconds
