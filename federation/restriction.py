"""The global model at a client's width, as both apps compute it: the server when it sends a known node its share,
a node that the server has not heard from yet when it restricts the full model itself (the same function)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from federation.settings import SLICED
from glmc.archs import get_arch
from glmc.core.config import ModelConfig, scale_width
from glmc.core.state import State
from glmc.merging import heterofl
from glmc.merging.widths import Placement, place, principal_place, project
from glmc.symmetry.canonical import canonicalize


def restrict(global_native: Mapping[str, torch.Tensor], full: ModelConfig, tier: float, aggregation: str,
             placement: Placement | None = None) -> State:
    """The global model at a client's width: its HeteroFL slice (fedavg, fedavg-ft, server-only), else its projection
    onto the client's subspace of the universe (``placement``: where alignment last put it; default: the exact
    embedding)."""
    narrow = scale_width(full, tier)
    if narrow == full:
        return dict(global_native)
    if aggregation in SLICED:
        return wire_state(heterofl.restrict(global_native, full, narrow))
    arch = get_arch(full.family)
    canonical = canonicalize(arch, global_native, full, dtype=torch.float64)
    return wire_state(arch.to_native(project(canonical, placement or place(narrow, full)), full))


def principal_placement(global_native: Mapping[str, torch.Tensor], full: ModelConfig, tier: float) -> Placement:
    """Where a narrow client gets the global model with ``narrow-placement=principal``: the heads, MLP units and
    residual subspace holding most of its weights (:func:`glmc.merging.widths.principal_place`)."""
    arch = get_arch(full.family)
    canonical = canonicalize(arch, global_native, full, dtype=torch.float64)
    return principal_place(canonical, scale_width(full, tier), full)


def wire_state(state: Mapping[str, torch.Tensor]) -> State:
    """The CPU float32 copy that goes into an ArrayRecord, wherever the state was computed."""
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
