"""Data-free repair of a merge's variance collapse: give every unit of the merged model back its inputs' norm.

Averaging units that are only approximately aligned cancels their misaligned parts, so the merged units are
shorter than any input's: pre-activations and attention logits shrink, the "variance collapse" that REPAIR
(Jordan et al., 2022) measures in activations and mends with data. Here the weights alone are used: each
merged unit is rescaled so that its norm is the weighted mean of the inputs' norms of that unit. The units are
the MLP neurons, read by fc1's rows [w | b] (a gated MLP's ``up``) and written by fc2's columns, and the query
heads, whose QK and OV circuits over x̃ = [x; 1] set the q rows and the proj columns; every tensor is found by its
axis kind. An input that does not hold a unit (a narrower model embedded in the universe, whose unit is zero) is left
out of that unit's mean.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from glmc.archs import get_arch
from glmc.core.config import ModelConfig
from glmc.core.spec import HEADS, MLP, MLP_IN, QKV, AxisKind, Q, expand
from glmc.core.state import State
from glmc.match.common import gather, head_circuits

# A unit family: the merged state and one layer → a (units,) norm per unit, and the rescaling by (units,) factors.
Norms = Callable[[Mapping[str, torch.Tensor], int, ModelConfig], torch.Tensor]
Scale = Callable[[State, int, ModelConfig, torch.Tensor], None]


def _spec(cfg: ModelConfig) -> Mapping[str, tuple[AxisKind | None, ...]]:
    return get_arch(cfg.family).spec


def _mlp_in_norms(state: Mapping[str, torch.Tensor], layer: int, cfg: ModelConfig) -> torch.Tensor:
    """Each unit's row [w | b] of fc1 (a gated MLP's ``up``, the linear side)."""
    return gather(state, _spec(cfg), cfg.depth, MLP, layer).norm(dim=1)


def _mlp_out_norms(state: Mapping[str, torch.Tensor], layer: int, cfg: ModelConfig) -> torch.Tensor:
    return gather(state, _spec(cfg), cfg.depth, MLP_IN, layer).norm(dim=1)


def _qk_norms(state: Mapping[str, torch.Tensor], layer: int, cfg: ModelConfig) -> torch.Tensor:
    """Each query head's QK circuit over x̃ = [x; 1] (with its KV head's k under grouped queries)."""
    return head_circuits(state, _spec(cfg), cfg.depth, layer, cfg.heads)[0].flatten(1).norm(dim=1)


def _ov_norms(state: Mapping[str, torch.Tensor], layer: int, cfg: ModelConfig) -> torch.Tensor:
    return head_circuits(state, _spec(cfg), cfg.depth, layer, cfg.heads)[1].flatten(1).norm(dim=1)


def _scale_kind(state: State, layer: int, cfg: ModelConfig, kind: AxisKind, factor: torch.Tensor) -> None:
    """Multiply the ``kind`` axis of every tensor of ``layer`` that has one by ``factor`` (one entry per index)."""
    spec = _spec(cfg)
    for name, (lay, template) in expand(spec, cfg.depth).items():
        axes = spec[template]
        if lay == layer and name in state and kind in axes:
            shape = [1] * len(axes)
            shape[axes.index(kind)] = -1
            state[name] = state[name] * factor.to(state[name].dtype).reshape(shape)


def _scale_mlp_in(state: State, layer: int, cfg: ModelConfig, s: torch.Tensor) -> None:
    _scale_kind(state, layer, cfg, MLP, s)


def _scale_mlp_out(state: State, layer: int, cfg: ModelConfig, s: torch.Tensor) -> None:
    _scale_kind(state, layer, cfg, MLP_IN, s)


def _scale_q(state: State, layer: int, cfg: ModelConfig, s: torch.Tensor) -> None:
    """Scale query head h's q rows by s[h] (the first third of a fused qkv, head by head); k and v stay."""
    q = s.repeat_interleave(cfg.head_dim)
    if any(QKV in axes for axes in _spec(cfg).values()):
        _scale_kind(state, layer, cfg, QKV, torch.cat([q, torch.ones(2 * q.numel(), dtype=s.dtype)]))
    else:
        _scale_kind(state, layer, cfg, Q, q)


def _scale_proj(state: State, layer: int, cfg: ModelConfig, s: torch.Tensor) -> None:
    _scale_kind(state, layer, cfg, HEADS, s.repeat_interleave(cfg.head_dim))


UNITS: tuple[tuple[Norms, Scale], ...] = (
    (_mlp_in_norms, _scale_mlp_in),
    (_mlp_out_norms, _scale_mlp_out),
    (_qk_norms, _scale_q),
    (_ov_norms, _scale_proj),
)


def target_norms(inputs: Sequence[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """Per unit, the weighted mean of the inputs' norms over the inputs that hold the unit (norm > 0)."""
    norms = torch.stack(list(inputs))  # (N, units)
    held = (norms > 0).to(norms.dtype) * weights.to(norms.device)[:, None]
    return (held * norms).sum(0) / held.sum(0).clamp_min(torch.finfo(norms.dtype).tiny)


def restore_norms(merged: Mapping[str, torch.Tensor], inputs: Sequence[Mapping[str, torch.Tensor]],
                  cfg: ModelConfig, weights: Sequence[float] | None = None) -> State:
    """``merged`` with every MLP neuron and head rescaled to the weighted mean norm of that unit in ``inputs``
    (canonical states in the merged model's basis and width, e.g. universe matching's aligned models)."""
    n = torch.tensor([1.0] * len(inputs) if weights is None else list(weights), dtype=torch.float64)
    out = dict(merged)
    for layer in range(cfg.depth):
        for norms, scale in UNITS:
            have = norms(out, layer, cfg)
            want = target_norms([norms(s, layer, cfg) for s in inputs], n).to(have.dtype)
            scale(out, layer, cfg, torch.where(have > 0, want / have.clamp_min(torch.finfo(have.dtype).tiny), 1.0))
    return out
