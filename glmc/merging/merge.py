"""Merging N checkpoints of one family, of the same or different widths, into one standard checkpoint: the target
config, the inputs' checks, and the merge itself (canonical form, universe matching, corrections)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.utils.data import Dataset

from glmc.archs import get_arch
from glmc.core.config import ModelConfig, preset, scale_width
from glmc.core.state import State, cast
from glmc.device import device_of, to_device
from glmc.errors import ConfigError
from glmc.io.checkpoint import CheckpointMeta
from glmc.merging.options import MergeOptions
from glmc.merging.universe import UniverseResult, universe_match
from glmc.merging.widths import WIDTH_FIELDS, check_embeddable
from glmc.symmetry.canonical import canonicalize


def target_config(metas: Sequence[CheckpointMeta], width_of: CheckpointMeta | None = None,
                  width_mult: float | None = None) -> tuple[ModelConfig, float]:
    """The merged model's config and width multiplier: another checkpoint's, a preset tier, or the widest input's."""
    if width_of is not None:
        return width_of.config, width_of.width_mult
    widest = max(metas, key=lambda m: (m.config.width, m.config.mlp, m.config.heads))
    if width_mult is None:
        return widest.config, widest.width_mult
    shared = {k: v for k, v in widest.config.to_dict().items() if k not in WIDTH_FIELDS}
    return scale_width(preset(widest.preset).replace(**shared), width_mult), width_mult


def check_inputs(metas: Sequence[CheckpointMeta], target: ModelConfig) -> None:
    """One-line ConfigError unless every input fits the target: family, depth, data and vocabulary, width."""
    for meta in metas:
        check_embeddable(meta.config, target)
    if len({m.dataset for m in metas}) > 1:
        raise ConfigError(f"checkpoints were trained on different datasets: {sorted({m.dataset for m in metas})}")
    if len({m.vocab for m in metas}) > 1:
        raise ConfigError("checkpoints have different vocabularies")


@dataclass(frozen=True)
class MergeSetup:
    """What to merge into, with what: the target config, the inputs' weights (None: equal), the training samples
    that data-driven methods and the corrections read (never the held-out split), and the options."""

    target: ModelConfig
    options: MergeOptions = field(default_factory=MergeOptions)
    weights: list[float] | None = None
    train: Dataset | None = None


def reference_of(configs: Sequence[ModelConfig], target: ModelConfig) -> int:
    """The first model already at the target width is U's first value (else the first model)."""
    return next((i for i, c in enumerate(configs) if c == target), 0)


def merge_states(natives: Sequence[Mapping[str, torch.Tensor]], configs: Sequence[ModelConfig], setup: MergeSetup,
                 ) -> UniverseResult:
    """Canonicalise every native state (float64), embed it into the target and run universe matching, then the
    corrections asked for (:class:`glmc.merging.corrections.Corrections`)."""
    options, target = setup.options, setup.target
    arch = get_arch(target.family)
    # Vanilla averaging at one width takes the models as trained, like the paper's baseline; everything else
    # (and any embedding across widths) needs the standard form, LayerNorms folded.
    raw = options.method == "none" and all(c == target for c in configs)
    natives = [to_device(s, options.device) for s in natives]
    states = [arch.to_canonical(cast(s, torch.float64), c) if raw
              else canonicalize(arch, s, c, dtype=torch.float64) for s, c in zip(natives, configs, strict=True)]
    result = universe_match(states, target, **options.universe(), weights=setup.weights, configs=configs,
                            reference=reference_of(configs, target), data=setup.train)
    result.merged = options.corrections.apply(result.merged, result.aligned, target, setup.train, setup.weights,
                                              result.placements)
    return result


def align_to_wide(wide: State, native: Mapping[str, torch.Tensor], cfg: ModelConfig,
                  setup: MergeSetup) -> UniverseResult:
    """A narrower native model (``cfg``) embedded into the canonical ``wide`` model's width (``setup.target``) and
    aligned to it by the method's own pairwise matching: one universe step anchored at ``wide``, so it computes the
    narrow function."""
    narrow = canonicalize(get_arch(cfg.family), to_device(native, device_of(wide)), cfg, dtype=torch.float64)
    keywords = setup.options.universe(pairwise=setup.options.method) | {"max_iters": 1, "workers": 1}
    return universe_match([narrow], setup.target, **keywords, anchor=wide, configs=[cfg], data=setup.train)
