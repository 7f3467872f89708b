"""Heads merged as circuits in a standard model: each merged head's factors refitted to the mean of its circuits.

Interpolating a head's factors leaves the circuits' path: (λQ_A + (1−λ)Q_B)ᵀ(λK_A + (1−λ)K_B) differs from
λ Q_Aᵀ K_A + (1−λ) Q_Bᵀ K_B by λ(1−λ) ΔQᵀ ΔK, and the same holds for O V. The circuit form interpolates the
circuits themselves but changes the architecture (heads of size d+1). Here every merged head's factors are instead
the best low-rank factors (truncated SVD, Eckart–Young) of the weighted mean of the inputs' circuits over
x̃ = [x; 1], per class of the declared group's within-head maps, so the merge stays a standard model of its family:

- a KV head's group of G query heads shares k and v: its QK circuits stacked, [Q_1ᵀK; …; Q_Gᵀ K], and its OV
  circuits stacked, [O_1 V; …; O_G V], each have rank ≤ d_h, and each is refitted by one SVD, keeping one k and v;
- rotary positions pair dimension i with i + r/2, and per pair commute only with a rotation times a scale, a
  complex scalar: with q_c = q_i + i·q_{i+r/2} (likewise k_c) the pair's score at any relative position depends on
  the complex rank-1 circuit conj(q_c)ᵀ k_c alone, which is averaged and refitted by a complex SVD of rank 1;
- the dimensions rotary positions leave alone (all of them without rotary) form one real circuit of rank d_h − r.

Both ends of a path are their own circuits, so they are kept exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from glmc.archs import get_arch
from glmc.core.config import ModelConfig
from glmc.core.state import State
from glmc.errors import ConfigError
from glmc.match.common import from_kv_factors, head_factors, kv_factors, put_head_factors
from glmc.symmetry.canonical import CIRCUITS, Form
from glmc.symmetry.groups import rotary_halves

Factors = tuple[torch.Tensor, torch.Tensor]


def low_rank_mean(left: Sequence[torch.Tensor], right: Sequence[torch.Tensor], weights: Sequence[float],
                  rank: int) -> Factors:
    """(…, rank, n) and (…, rank, m) factors F, G whose Fᴴ G is the best rank-``rank`` approximation of
    Σ_i w_i F_iᴴ G_i (real or complex, batched over leading axes), the singular values split evenly. The sum is
    factored through QRs of the stacked factors, never formed: its SVD is that of a (Σk_i)² core."""
    f = torch.cat([w * x for w, x in zip(weights, left, strict=True)], -2).mH  # (…, n, Σk)
    g = torch.cat(list(right), -2).mH  # (…, m, Σk)
    qf, rf = torch.linalg.qr(f)
    qg, rg = torch.linalg.qr(g)
    u, s, vh = torch.linalg.svd(rf @ rg.mH)
    root = s[..., :rank].sqrt().to(u.dtype)
    return (qf @ (u[..., :rank] * root[..., None, :])).mH, root[..., None] * (vh[..., :rank, :] @ qg.mH)


def _complex(x: torch.Tensor, rotary: int) -> torch.Tensor:
    """(…, d_h, n) rows → (…, r/2, 1, n) complex rows x_i + i·x_{i+r/2}, one per rotary pair."""
    first, second = rotary_halves(rotary)
    return torch.complex(x[..., first, :], x[..., second, :]).unsqueeze(-2)


def merge_pair(left: Sequence[torch.Tensor], right: Sequence[torch.Tensor], weights: Sequence[float],
               rotary: int = 0) -> Factors:
    """(…, d_h, n) and (…, d_h, m) factors of the ``weights``-mean circuit Σ w_i F_iᵀ G_i, refitted per class of
    within-head maps: per rotary pair on the first ``rotary`` dimensions a complex rank-1 circuit, on the others one
    real circuit of their rank."""
    f, g = torch.zeros_like(left[0]), torch.zeros_like(right[0])
    if rotary < f.shape[-2]:
        f[..., rotary:, :], g[..., rotary:, :] = low_rank_mean([x[..., rotary:, :] for x in left],
                                                               [x[..., rotary:, :] for x in right], weights,
                                                               f.shape[-2] - rotary)
    if rotary:
        first, second = rotary_halves(rotary)
        fc, gc = (x.squeeze(-2) for x in low_rank_mean([_complex(x, rotary) for x in left],
                                                        [_complex(x, rotary) for x in right], weights, 1))
        f[..., first, :], f[..., second, :], g[..., first, :], g[..., second, :] = fc.real, fc.imag, gc.real, gc.imag
    return f, g


def require_circuit_layout(cfg: ModelConfig, form: Form = "standard") -> None:
    """ConfigError unless ``cfg``'s heads can be merged as circuits in ``form``: one whose heads are still factors
    (every family's heads are, in the standard and rmsnorm forms)."""
    if form in CIRCUITS:
        raise ConfigError(f"heads merged as circuits need a form whose heads are factors, not {form!r}")


def merge_circuits(merged: Mapping[str, torch.Tensor], inputs: Sequence[Mapping[str, torch.Tensor]],
                   cfg: ModelConfig, weights: Sequence[float] | None = None) -> State:
    """``merged`` with every head's q, k, v rows and output columns refitted to the ``weights``-mean of the
    ``inputs``' QK and OV circuits (canonical states of ``cfg``, aligned, in the merge's basis); weights are
    normalised to sum 1. Other tensors are ``merged``'s. Every family: fused or separate q/k/v, grouped queries,
    rotary positions on all or part of each head."""
    require_circuit_layout(cfg)
    spec = get_arch(cfg.family).spec
    given = [1.0] * len(inputs) if weights is None else [float(x) for x in weights]
    w = [x / sum(given) for x in given]
    out = dict(merged)
    for layer in range(cfg.depth):
        wide = [{k: v.double() for k, v in s.items() if k.startswith(f"blocks.{layer}.")} for s in inputs]
        found = [head_factors(s, spec, cfg.depth, layer, cfg.heads) for s in wide]  # in float64 for the SVDs
        kv = found[0][2]
        pairs = [kv_factors(qkv, o, kv) for qkv, o, _ in found]
        qk = merge_pair([p[0][0] for p in pairs], [p[0][1] for p in pairs], w, cfg.rotary_dim)
        vo = merge_pair([p[1][0] for p in pairs], [p[1][1] for p in pairs], w)
        out.update(put_head_factors(merged, spec, cfg.depth, layer, *from_kv_factors(qk, vo), kv))
    return out
