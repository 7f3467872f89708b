"""Balancing: each model brought to a canonical representative of its orbit under the non-orthogonal part of its
symmetry group, so that a search over the orthogonal part (every matcher's) covers the whole declared group.

Each non-orthogonal class pairs a factor F moved by a map M with a factor G moved by M⁻ᵀ: a head's queries (the
group's, side by side) with its key (the q/k map M); its value with its output columns (the v/o map N); an MLP
unit's ``up`` row (fc1 under ReLU) with its fc2 column (the unit scale s). The pair is balanced when
M F Fᵀ Mᵀ = M⁻ᵀ G Gᵀ M⁻¹. With P = F Fᵀ and Q = G Gᵀ positive definite this holds for X = MᵀM the unique
positive definite solution of X P X = Q, the geometric mean X = P^-½ (P^½ Q P^½)^½ P^-½, so the balanced factors
are unique up to an orthogonal M: exactly what the matchers search. A planted transform is therefore undone by
balancing both models and searching the rest. P and Q are unchanged by the residual maps and the permutations,
so balancing commutes with them (docs/matching.md, "The whole declared group").

Where rotary positions act, M must commute with them: per rotated pair of dimensions a rotation times a scale
c, balanced by c⁴ = ‖G pair‖² / ‖F pair‖²; the dimensions they leave alone are balanced as a block. A gated MLP's
scale may be negative too: its sign is the orthogonal part of the unit's class (±1), which weight matching searches
(:func:`glmc.match.descent.signed_assignment`); balancing still signs it by ⟨up row, gate row⟩ ≥ 0, which the
stream's maps keep, for the matchers that search no sign (activation, learned, dual), although a slight perturbation
flips that rule where the product is near 0. Left unidentified (the maps stay the identity there): a head whose P or
Q is singular (a dead head, the zero heads of an embedded narrow model), a unit with a zero row, and, for those
matchers, a gated unit whose up and gate rows are orthogonal.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Literal

import torch

from glmc.archs import get_arch
from glmc.core.config import ModelConfig
from glmc.core.spec import MLP, MLP_GATE, MLP_IN, SpecTable, gated
from glmc.core.state import Lazy, State
from glmc.match.common import gather, head_factors, kv_factors
from glmc.match.options import MatchOptions
from glmc.match.registry import get_method
from glmc.symmetry.groups import inverse, polar, rotary_halves, rotary_polar
from glmc.symmetry.transforms import Transform, apply, moved

MlpScale = Literal["none", "positive", "nonzero"]
# A Gram whose smallest eigenvalue is below this share of its largest is treated as singular: left unbalanced.
SINGULAR = 1e-10


def mlp_scale(spec: SpecTable, cfg: ModelConfig) -> MlpScale:
    """The per-unit scales an MLP admits: any nonzero one on a gated MLP's ``up`` (with its inverse on fc2), a
    positive one under ReLU, none under GELU or SiLU."""
    if gated(spec):
        return "nonzero"
    return "positive" if cfg.activation == "relu" else "none"


def _sym_power(m: torch.Tensor, power: float) -> torch.Tensor:
    """M^power for symmetric positive definite matrices (batched), by their eigendecomposition."""
    values, vectors = torch.linalg.eigh((m + m.mT) / 2)
    return (vectors * values.clamp_min(0).pow(power).unsqueeze(-2)) @ vectors.mT


def _positive_definite(m: torch.Tensor) -> torch.Tensor:
    """Per matrix of a batch, whether its smallest eigenvalue is above :data:`SINGULAR` of its largest."""
    values = torch.linalg.eigvalsh((m + m.mT) / 2)
    return values[..., 0] > SINGULAR * values[..., -1].clamp_min(torch.finfo(m.dtype).tiny)


def balancing_map(f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The symmetric positive definite M (batched over leading axes) with M F Fᵀ Mᵀ = M⁻ᵀ G Gᵀ M⁻¹ for factors F, G
    (..., n, m): M = X^½ for X the geometric mean of P⁻¹ and Q; the identity where P or Q is singular."""
    p, q = f @ f.mT, g @ g.mT
    ok = _positive_definite(p) & _positive_definite(q)
    eye = torch.eye(p.shape[-1], dtype=p.dtype, device=p.device)
    p, q = torch.where(ok[..., None, None], p, eye), torch.where(ok[..., None, None], q, eye)
    root, inverse_root = _sym_power(p, 0.5), _sym_power(p, -0.5)
    x = inverse_root @ _sym_power(root @ q @ root, 0.5) @ inverse_root
    return torch.where(ok[..., None, None], _sym_power(x, 0.5), eye)


def _pair_scales(f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per row pair of (…, n, m) factors: (‖G‖² / ‖F‖²)^¼ over the pair's rows, 1 where either is zero."""
    fs, gs = f.square().sum(-1), g.square().sum(-1)
    ok = (fs > 0) & (gs > 0)
    return torch.where(ok, (gs / torch.where(ok, fs, 1)).pow(0.25), torch.ones_like(fs))


def qk_map(f: torch.Tensor, g: torch.Tensor, rotary: int) -> torch.Tensor:
    """The q/k balancing maps (H_kv, d_h, d_h) for query factors ``f`` and key factors ``g`` (H_kv, d_h, m): a
    scale per rotated pair on the first ``rotary`` dimensions, a block map on the others."""
    if rotary == 0:
        return balancing_map(f, g)
    first, second = rotary_halves(rotary)
    scale = _pair_scales(*(torch.cat([x[:, first], x[:, second]], -1) for x in (f, g)))  # a pair's rows as one
    m = torch.eye(f.shape[1], dtype=f.dtype, device=f.device).repeat(f.shape[0], 1, 1)
    dims = torch.arange(rotary)
    m[:, dims, dims] = torch.cat([scale, scale], -1)
    if rotary < f.shape[1]:
        m[:, rotary:, rotary:] = balancing_map(f[:, rotary:], g[:, rotary:])
    return m


def mlp_scales(state: Mapping[str, torch.Tensor], spec: SpecTable, depth: int, layer: int,
               kind: MlpScale) -> torch.Tensor | None:
    """One layer's unit scales s (f,), up rows × s and fc2 columns ÷ s balanced (None: the MLP has none); on a
    gated MLP signed so that ⟨up row, gate row⟩ ≥ 0 after, for the matchers that search no sign (weight matching
    searches it: the rule is unstable where the product is near 0)."""
    if kind == "none":
        return None
    up, down = (gather(state, spec, depth, k, layer).double() for k in (MLP, MLP_IN))
    scale = _pair_scales(up, down)
    if kind == "nonzero":
        gate = gather(state, spec, depth, MLP_GATE, layer).double()
        if gate.shape == up.shape:
            scale = torch.where((up * gate).sum(1) < 0, -scale, scale)
    return scale


def balancing(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> Transform:
    """The symmetry D with D(θ) balanced in every non-orthogonal class of the family (canonical ``state``)."""
    spec = get_arch(cfg.family).spec
    t = Transform(cfg.depth)
    kind = mlp_scale(spec, cfg)
    for layer in range(cfg.depth):
        qkv, out, kv = head_factors(state, spec, cfg.depth, layer, cfg.heads)
        (q, k), (v, o) = kv_factors(qkv.double(), out.double(), kv)
        t.qk[layer], t.ov[layer] = qk_map(q, k, cfg.rotary_dim), balancing_map(v, o)
        t.mlp_scale[layer] = mlp_scales(state, spec, cfg.depth, layer, kind)
    return t


def balance(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> tuple[State, Transform]:
    """``state`` balanced (:func:`balancing`), in its own dtype, and the map that did it; a state made on each read
    (:class:`Lazy`) is balanced on each read too."""
    t = balancing(state, cfg)
    move = moved if isinstance(state, Lazy) else apply
    return typing.cast(State, move(state, get_arch(cfg.family).spec, t, cfg.heads)), t


def balances(method: str, options: MatchOptions) -> bool:
    """Whether ``method`` searches the whole declared group with ``options``: it reads the symmetry section (the
    permutation-only ablations do not) and the section asks for the whole group."""
    return "symmetry" in get_method(method).options and options.symmetry.group == "whole"


def nearer(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], found: Transform,
           cfg: ModelConfig) -> Transform:
    """``found`` (B's whole map, searched between the balanced models) with each KV head's q/k and v/o maps and each
    MLP unit's scale replaced by the orthogonal choice (the Procrustes maps between A and B moved by ``found``'s
    permutations and residual map; scale 1) where that leaves the head or unit nearer A: both are exact, and ‖A −
    T(B)‖, which every matcher lowers, decides. A planted transform keeps the balanced maps (distance 0); seeds
    trained apart may sit nearer in their own frames than in their balanced ones."""
    spec = get_arch(cfg.family).spec
    bare = Transform(cfg.depth, residual=found.residual, heads=found.heads, mlp=found.mlp, group=found.group)
    b_moved = moved(b, spec, bare, cfg.heads)  # made per tensor as each layer reads it
    kind = mlp_scale(spec, cfg)
    out = Transform(cfg.depth, residual=found.residual, heads=found.heads, mlp=found.mlp, group=found.group)
    for layer in range(cfg.depth):
        (qa, ka), (va, oa) = _pairs(a, spec, cfg, layer)
        (qb, kb), (vb, ob) = _pairs(b_moved, spec, cfg, layer)
        out.qk[layer] = _nearer_maps(found.qk[layer], rotary_polar(torch.cat([qa, ka], -1) @ torch.cat([qb, kb], -1).mT,
                                                                   cfg.rotary_dim), (qa, ka), (qb, kb))
        out.ov[layer] = _nearer_maps(found.ov[layer], polar(torch.cat([va, oa], -1) @ torch.cat([vb, ob], -1).mT),
                                     (va, oa), (vb, ob))
        out.mlp_scale[layer] = _nearer_scales(found.mlp_scale[layer], a, b_moved, spec, cfg.depth, layer, kind)
    return out


def _pairs(state: Mapping[str, torch.Tensor], spec: SpecTable, cfg: ModelConfig,
           layer: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """One layer's ((q, k), (v, o)) factors per KV head in float64 (:func:`glmc.match.common.kv_factors`)."""
    qkv, out, kv = head_factors(state, spec, cfg.depth, layer, cfg.heads)
    return kv_factors(qkv.double(), out.double(), kv)


def _nearer_maps(found: torch.Tensor | None, orthogonal: torch.Tensor, fa: tuple[torch.Tensor, torch.Tensor],
                 fb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Per KV head, whichever map M (F → M F, G → M⁻ᵀ G) leaves (F_B, G_B) nearer (F_A, G_A)."""
    if found is None:
        return orthogonal
    found = found.to(orthogonal)

    def distance(m: torch.Tensor) -> torch.Tensor:
        inv_t = inverse(m).mT  # on one thread: MKL's threaded batched LU fails on two (groups.inverse)
        return (fa[0] - m @ fb[0]).square().sum((-2, -1)) + (fa[1] - inv_t @ fb[1]).square().sum((-2, -1))

    keep = distance(found) <= distance(orthogonal)
    return torch.where(keep[:, None, None], found, orthogonal)


def _nearer_scales(found: torch.Tensor | None, a: Mapping[str, torch.Tensor], moved: Mapping[str, torch.Tensor],
                   spec: SpecTable, depth: int, layer: int, kind: MlpScale) -> torch.Tensor | None:
    """Per MLP unit, the scale ``found`` or 1, whichever leaves the unit's up row and fc2 column nearer A's."""
    if found is None or kind == "none":
        return None
    up_a, down_a, up_b, down_b = (gather(state, spec, depth, k, layer).double()
                                  for state in (a, moved) for k in (MLP, MLP_IN))
    s = found.to(up_a)
    scaled = (up_a - s[:, None] * up_b).square().sum(1) + (down_a - down_b / s[:, None]).square().sum(1)
    plain = (up_a - up_b).square().sum(1) + (down_a - down_b).square().sum(1)
    return torch.where(scaled <= plain, s, torch.ones_like(s))
