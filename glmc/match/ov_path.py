"""Invertible v/o maps inside heads, chosen without data so that the models' own path follows the circuit path.

Interpolating a head's factors, ((1−λ)O_A + λO_B)((1−λ)V_A + λV_B) = (1−λ)O_AV_A + λO_BV_B − λ(1−λ)ΔO ΔV with
ΔO = O_A − O_B and ΔV = V_A − V_B: the standard form leaves the circuit path (the paper's OV circuits
interpolated) by λ(1−λ)ΔO ΔV at every λ. Any invertible N per KV head (V → N V, O → O N⁻¹) is an exact symmetry;
the one minimising Σ‖ΔO ΔV‖² over a layer's heads brings the two paths together. Weight matching's orthogonal N
minimises ‖ΔO‖² + ‖ΔV‖² instead.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

import torch

from glmc.archs import get_arch
from glmc.core.config import ModelConfig
from glmc.core.spec import SpecTable
from glmc.core.state import State
from glmc.match.common import MatchResult, head_factors
from glmc.symmetry.transforms import Transform, apply, compose

STEPS = 300  # L-BFGS iterations per layer: the (H_kv, d_h, d_h) problem is small, and it converges well within them
MAX_CONDITION = 1e6  # a map beyond this condition number is refused (the layer keeps weight matching's map)


def ov_path_maps(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], spec: SpecTable, depth: int,
                 heads: int) -> list[torch.Tensor | None]:
    """Per layer, the (H_kv, d_h, d_h) invertible N that brings B's heads (already matched to A) to the circuit path
    between them, or None where no better finite, well-conditioned map was found."""
    return [_layer_map(head_factors(a, spec, depth, i, heads), head_factors(b, spec, depth, i, heads))
            for i in range(depth)]


def _layer_map(fa: tuple[torch.Tensor, torch.Tensor, int], fb: tuple[torch.Tensor, torch.Tensor, int],
               ) -> torch.Tensor | None:
    """One layer's maps from its (3, H, d_h, m) q|k|v factors and (H, d_h, d) output factors (W_Oᵀ) of A and B."""
    kv, grams = fa[2], grams_of(fa, fb)
    group = grams[0].shape[0] // kv
    eye = torch.eye(grams[0].shape[1], dtype=torch.float64).expand(kv, -1, -1)
    n = eye.clone().requires_grad_()
    start = float(_deviation(eye, grams, group))
    optimizer = torch.optim.LBFGS([n], max_iter=STEPS, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        value = _deviation(n, grams, group)
        value.backward()  # type: ignore[no-untyped-call]
        return value

    optimizer.step(closure)  # type: ignore[no-untyped-call]
    found = n.detach()
    if not bool(torch.isfinite(found).all()) or float(torch.linalg.cond(found).max()) > MAX_CONDITION:
        return None
    return found if float(_deviation(found, grams, group)) < start else None


def grams_of(fa: tuple[torch.Tensor, torch.Tensor, int], fb: tuple[torch.Tensor, torch.Tensor, int],
             ) -> list[torch.Tensor]:
    """The per-query-head (d_h, d_h) Gram matrices the deviation reads, in float64: V_A V_Aᵀ, V_A V_Bᵀ, V_B V_Bᵀ and
    the same of the output factors W_Oᵀ."""
    va, vb, oa, ob = (x.double() for x in (fa[0][2], fb[0][2], fa[1], fb[1]))
    return [x @ y.mT for x, y in ((va, va), (va, vb), (vb, vb), (oa, oa), (oa, ob), (ob, ob))]


def _deviation(n: torch.Tensor, grams: list[torch.Tensor], group: int) -> torch.Tensor:
    """Σ_h ‖ΔO_h ΔV_h‖² = Σ_h tr(ΔO_hᵀΔO_h · ΔV_hΔV_hᵀ), from the heads' (d_h, d_h) Gram matrices: V → N V and
    W_Oᵀ → N⁻ᵀ W_Oᵀ, the KV head's N on each query head of its group."""
    vv_aa, vv_ab, vv_bb, oo_aa, oo_ab, oo_bb = grams
    nq = n.repeat_interleave(group, 0)
    inv = torch.linalg.inv(nq)
    dv = vv_aa - vv_ab @ nq.mT - nq @ vv_ab.mT + nq @ vv_bb @ nq.mT
    do = oo_aa - oo_ab @ inv - inv.mT @ oo_ab.mT + inv.mT @ oo_bb @ inv
    return (do * dv).sum()


def on_the_path(result: MatchResult, a: State, b: State, cfg: ModelConfig) -> MatchResult:
    """Weight matching's ``result`` with each layer's v/o maps replaced by the path's (B is moved by the result
    first, so the maps are found between matched heads); the objective stays the matching's."""
    began = time.perf_counter()
    arch = get_arch(cfg.family)
    maps = ov_path_maps(a, apply(b, arch.spec, result.transform, cfg.heads), arch.spec, cfg.depth, cfg.heads)
    transform = compose(Transform(cfg.depth, ov=maps), result.transform)
    refused = sum(m is None for m in maps)
    return dataclasses.replace(result, transform=transform, seconds=result.seconds + time.perf_counter() - began,
                               info={**result.info, "ov_path_refused_layers": refused})
