"""HeteroFL, the width-heterogeneous FedAvg baseline (Diao, Ding & Tarokh, "HeteroFL: Computation and
Communication Efficient Federated Learning for Heterogeneous Clients", ICLR 2021, arXiv:2010.01264).

A client of width tier r holds the leading slice of every axis of the global model: the first r·d residual
coordinates (LayerNorm and RMSNorm gains included), the first r·H heads (in each of q, k and v, and in the columns
the output projection reads; with grouped-query attention the first r·H_kv KV heads and the G query heads of each,
whole groups), and the first r·f MLP units (a gated MLP's gate rows with them). Heads keep their size. Aggregation
averages every entry over the clients that hold it, weighted by example counts; an entry no client holds keeps its
global value. At equal widths this is FedAvg. The slices are read from the symmetry spec's axis kinds, so no
architecture is named here.

FedRolex (Alam et al., "FedRolex: Model-Heterogeneous Federated Learning with Rolling Sub-Model Extraction",
NeurIPS 2022) is the same rule at a rolling ``offset``: a client keeping k of an axis's n units holds units
(offset + i) mod n, i < k, of every width axis: residual coordinates, KV heads (whole groups, whole heads: tiers keep
d_h) and MLP units. Offset 0 is HeteroFL's leading slice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from glmc.archs import get_arch
from glmc.core.config import ModelConfig
from glmc.core.spec import HEADS, MLP, MLP_GATE, MLP_IN, NORM, QKV, RES, AxisKind, K, Q, V, expand
from glmc.core.state import State


def _window(kept: int, units: int, offset: int) -> torch.Tensor:
    """Units (offset + i) mod ``units``, i < ``kept``: FedRolex's rolling window, HeteroFL's leading slice at 0. A
    client that keeps every unit holds them in place (a rotation of them would reorder its model's units)."""
    return (torch.arange(kept) + (offset if kept < units else 0)) % units


def _axis_index(kind: AxisKind | None, size: int, narrow: ModelConfig, full: ModelConfig,
                offset: int = 0) -> torch.Tensor:
    """Indices of the global axis (length ``size``) that a ``narrow`` client holds, its window starting at unit
    ``offset``."""
    if kind in (RES, NORM):
        return _window(narrow.width, full.width, offset)
    if kind in (MLP, MLP_GATE, MLP_IN):
        return _window(narrow.mlp, full.mlp, offset)
    if kind in (QKV, Q, K, V, HEADS):
        # fused q|k|v rows are (3, H, d_h), q rows and proj columns (H_kv, G, d_h), k and v rows (H_kv, d_h): the
        # window runs over KV heads and keeps each one's G query heads, whole groups
        per = 1 if kind in (K, V) else full.group
        grid = torch.arange(size).reshape(-1, full.kv_heads, per, full.head_dim)
        return grid[:, _window(narrow.kv_heads, full.kv_heads, offset), :, : narrow.head_dim].reshape(-1)
    return torch.arange(size)


def positions(shape: Sequence[int], axes: Sequence[AxisKind | None], narrow: ModelConfig,
              full: ModelConfig, offset: int = 0) -> torch.Tensor:
    """Flat indices into a global tensor of ``shape``, arranged in the narrow client's shape."""
    flat = torch.arange(int(torch.tensor(shape).prod())).reshape(*shape)
    for axis, (kind, size) in enumerate(zip(axes, shape, strict=True)):
        flat = flat.index_select(axis, _axis_index(kind, size, narrow, full, offset))
    return flat


def _canonical_positions(full_state: Mapping[str, torch.Tensor], narrow: ModelConfig,
                         full: ModelConfig, offset: int = 0) -> dict[str, torch.Tensor]:
    spec = get_arch(full.family).spec
    return {name: positions(full_state[name].shape, spec[template], narrow, full, offset)
            for name, (_, template) in expand(spec, full.depth).items() if name in full_state}


def restrict(global_native: Mapping[str, torch.Tensor], full: ModelConfig, narrow: ModelConfig,
             offset: int = 0) -> State:
    """The narrow client's slice of the global model, its window at ``offset`` (native keys, the client's
    shapes)."""
    arch = get_arch(full.family)
    canonical = arch.to_canonical(global_native, full)
    where = _canonical_positions(canonical, narrow, full, offset)
    return arch.to_native({k: v.reshape(-1)[where[k]] for k, v in canonical.items()}, narrow)


def merge(states: Sequence[Mapping[str, torch.Tensor]], configs: Sequence[ModelConfig], weights: Sequence[float],
          full: ModelConfig, previous: Mapping[str, torch.Tensor], offset: int = 0) -> State:
    """Coverage-weighted average of the clients' slices (their windows at ``offset``); uncovered entries keep
    ``previous`` (native keys)."""
    arch = get_arch(full.family)
    base = arch.to_canonical(previous, full)
    total = {k: torch.zeros(v.numel(), dtype=torch.float64) for k, v in base.items()}
    count = {k: torch.zeros(v.numel(), dtype=torch.float64) for k, v in base.items()}
    for state, cfg, weight in zip(states, configs, weights, strict=True):
        where = _canonical_positions(base, cfg, full, offset)
        for name, value in arch.to_canonical(state, cfg).items():
            total[name].index_add_(0, where[name].reshape(-1), weight * value.reshape(-1).double())
            count[name].index_add_(0, where[name].reshape(-1), torch.full((value.numel(),), float(weight),
                                                                          dtype=torch.float64))
    merged = {k: torch.where(count[k] > 0, total[k] / count[k].clamp_min(1e-300), v.reshape(-1).double())
              .reshape(v.shape).to(v.dtype) for k, v in base.items()}
    return arch.to_native(merged, full)
