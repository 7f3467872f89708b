"""The global model at a client's width, as both apps compute it: the server when it sends a known node its share,
a node that the server has not heard from yet when it restricts the full model itself (the same function)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from federation.settings import AGGREGATION_TABLE, SLICED, places_principal
from glmc.archs import get_arch
from glmc.core.config import ModelConfig, scale_width
from glmc.core.state import State
from glmc.merging import heterofl
from glmc.merging.widths import Placement, place, principal_place, project
from glmc.symmetry.canonical import canonicalize


def restrict(global_native: Mapping[str, torch.Tensor], full: ModelConfig, tier: float, aggregation: str,
             placement: Placement | None = None, server_round: int = 0) -> State:
    """The global model at a client's width in round ``server_round``: its HeteroFL slice (the aggregations that do
    not align; FedRolex's window of that round), else its projection onto the client's subspace of the universe
    (``placement``: where alignment last put it; default: the exact embedding)."""
    narrow = scale_width(full, tier)
    if narrow == full:
        return dict(global_native)
    if aggregation in SLICED:
        offset = AGGREGATION_TABLE[aggregation].offset(server_round)
        return wire_state(heterofl.restrict(global_native, full, narrow, offset))
    arch = get_arch(full.family)
    canonical = canonicalize(arch, global_native, full, dtype=torch.float64)
    return wire_state(arch.to_native(project(canonical, placement or place(narrow, full)), full))


def received(global_native: Mapping[str, torch.Tensor], full: ModelConfig, tier: float, aggregation: str,
             narrow_placement: str, server_round: int) -> State:
    """The global model as a node of ``tier`` that the server has not heard from restricts it itself in round
    ``server_round`` (client.app): principal placement where the run places narrow clients so, else the slice or the
    exact embedding. The server scores every tier's model so (server.app)."""
    principal = places_principal(aggregation, narrow_placement) and scale_width(full, tier) != full
    placement = principal_placement(global_native, full, tier) if principal else None
    return restrict(global_native, full, tier, aggregation, placement, server_round)


def principal_placement(global_native: Mapping[str, torch.Tensor], full: ModelConfig, tier: float) -> Placement:
    """Where a narrow client gets the global model with ``narrow-placement=principal``: the heads, MLP units and
    residual subspace holding most of its weights (:func:`glmc.merging.widths.principal_place`)."""
    arch = get_arch(full.family)
    canonical = canonicalize(arch, global_native, full, dtype=torch.float64)
    return principal_place(canonical, scale_width(full, tier), full)


def wire_state(state: Mapping[str, torch.Tensor]) -> State:
    """The CPU float32 copy that goes into an ArrayRecord, wherever the state was computed."""
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
