"""Heads merged as circuits in a standard model: each merged head's factors refitted to the mean of its circuits.

Interpolating a head's factors leaves the circuits' path: (λQ_A + (1−λ)Q_B)ᵀ(λK_A + (1−λ)K_B) differs from
λ Q_Aᵀ K_A + (1−λ) Q_Bᵀ K_B by λ(1−λ) ΔQᵀ ΔK, and the same holds for O V. The circuit form interpolates the
circuits themselves but changes the architecture (heads of size d+1). Here every merged head's q|k and v|o
factors are instead the best rank-d_h factors (truncated SVD, Eckart–Young) of the weighted mean of the inputs'
QK and OV circuits over x̃ = [x; 1]: the merge stays a standard model of the same shape, and no factors of rank
d_h come closer to the averaged circuits. Both ends of a path are their own circuits, so they are kept exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from glmc.archs import get_arch
from glmc.core.config import ModelConfig
from glmc.core.spec import HEADS, QKV, block_linears
from glmc.core.state import State
from glmc.errors import ConfigError
from glmc.match.common import head_circuits
from glmc.symmetry.canonical import CIRCUITS, Form, forms_for


def _low_rank(circuit: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(H, m, n) circuits → (H, rank, m) left and (H, rank, n) right factors whose products are their best
    rank-``rank`` approximations, the singular values split evenly between the two."""
    u, s, vh = torch.linalg.svd(circuit, full_matrices=False)
    root = s[:, :rank].sqrt()
    return (u[..., :rank] * root[:, None, :]).transpose(1, 2), vh[:, :rank] * root[..., None]


def _mean(tensors: Sequence[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """Σ_i w_i t_i."""
    return sum(w * t for w, t in zip(weights.tolist(), tensors, strict=True))  # type: ignore[return-value]


def require_circuit_layout(cfg: ModelConfig, form: Form = "standard") -> None:
    """ConfigError unless ``cfg``'s heads can be merged as circuits in ``form``: q|k|v fused in thirds (the circuit
    layout), and a form whose heads are still factors."""
    if "circuit" not in forms_for(get_arch(cfg.family)):
        raise ConfigError(f"merging heads as circuits needs q|k|v fused in thirds (the circuit layout), which a "
                          f"{cfg.family} model does not have")
    if form in CIRCUITS:
        raise ConfigError(f"heads merged as circuits need a form whose heads are factors, not {form!r}")


def merge_circuits(merged: Mapping[str, torch.Tensor], inputs: Sequence[Mapping[str, torch.Tensor]],
                   cfg: ModelConfig, weights: Sequence[float] | None = None) -> State:
    """``merged`` with every head's q, k, v rows and output columns refitted to the ``weights``-mean of the
    ``inputs``' QK and OV circuits (canonical states of ``cfg``, aligned, in the merge's basis); weights are
    normalised to sum 1. Other tensors are ``merged``'s. For fused q|k|v families (GPT-2, ViT)."""
    require_circuit_layout(cfg)
    spec = get_arch(cfg.family).spec
    (qkv_name,), (proj_name,) = block_linears(spec, outputs=(QKV,)), block_linears(spec, inputs=(HEADS,))
    w = torch.tensor([1.0] * len(inputs) if weights is None else list(weights), dtype=torch.float64)
    w = w / w.sum()
    out = dict(merged)
    for layer in range(cfg.depth):
        name, proj = qkv_name.format(l=layer), proj_name.format(l=layer)
        keys = [k for k in (f"{name}.w", f"{name}.b", f"{proj}.w") if k in merged]
        wide = [{k: s[k].double() for k in keys} for s in inputs]  # the layer's heads, in float64 for the SVD
        circuits = [head_circuits(s, spec, cfg.depth, layer, cfg.heads) for s in wide]
        qk, ov = (_mean([c[i] for c in circuits], w) for i in (0, 1))  # (H, e, e) and (H, d, e)
        q, k = _low_rank(qk, cfg.head_dim)
        o, v = _low_rank(ov, cfg.head_dim)  # o: (H, d_h, d), v: (H, d_h, e)
        qkv = torch.stack([q, k, v]).reshape(3 * cfg.heads * cfg.head_dim, -1)
        if f"{name}.b" in merged:  # x̃ = [x; 1]: the last column is the bias
            qkv, out[f"{name}.b"] = qkv[:, :-1], qkv[:, -1].to(merged[f"{name}.b"].dtype)
        out[f"{name}.w"] = qkv.to(merged[f"{name}.w"].dtype)
        out[f"{proj}.w"] = o.permute(2, 0, 1).reshape(o.shape[2], -1).to(merged[f"{proj}.w"].dtype)
    return out
