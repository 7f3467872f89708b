"""Data-free weight matching (paper §4.1): coordinate descent between the residual
orthogonal map (Procrustes) and, given it, the head permutations with within-head maps and the MLP
permutations (linear assignment). Reads only the spec: no architecture is named here.

The descent is non-convex, so where it starts matters. Two independently trained models share no residual
basis, so the identity is an arbitrary first guess; the ``relaxed`` start, the default, solves the same objective
with every unit map relaxed to the full orthogonal group of its axis first (:func:`relaxed_residual`). The relaxation
is tight at an exact symmetry, so a transformed copy is recovered from it; from the identity, a trained vit-tiny's
copy can end in a local optimum (a swapped pair of heads with a reflected residual direction) at a quarter of
random transforms.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from glmc.archs import get_arch
from glmc.core.spec import HEADS, MLP, MLP_GATE, MLP_IN, QKV, RES, AxisKind, K, Q, SpecTable, V, expand
from glmc.core.state import State, restrict, search_view
from glmc.errors import ConfigError
from glmc.match.common import (
    MatchResult,
    gather,
    grouped_assignment,
    head_factors,
    kind_first,
    kv_factors,
    matched_order,
    require_finite,
)
from glmc.match.descent import Descent, Layer
from glmc.match.options import Start, WeightOptions
from glmc.match.ov_path import on_the_path
from glmc.symmetry import groups
from glmc.symmetry.canonical import residual_group
from glmc.symmetry.transforms import Transform, apply, compose

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from glmc.core.config import ModelConfig
    from glmc.core.state import State
    from glmc.match.options import MatchOptions


log = logging.getLogger(__name__)

# Block-ascent steps of the relaxed start. In a float64 trial on three vit-bench pairs, 3, 10 and 100 steps gave
# 12.8%, 13.0% and 12.6% of the vanilla barrier (identity: 15.0%); the bench's float32 search with 3 steps gives
# 14.3% against the identity's 15.2% (simulations/results/weight-starts).
RELAXED_STEPS = 3
RELAXED_TOL = 1e-4  # Q moved by less than this (‖ΔQ‖/‖Q‖, above float32 noise): the ascent has converged


def without_stream_biases(state: Mapping[str, torch.Tensor], spec: SpecTable, depth: int,
                          ) -> Mapping[str, torch.Tensor]:
    """``state`` without its tensors of the residual axis alone (the stream's biases), for a matching that reads
    weights only (``WeightOptions.biases`` skip): they then count neither in the Procrustes nor in the distance. A
    :class:`glmc.core.state.Lazy` state stays lazy."""
    return restrict(state, [name for name, (_, template) in expand(spec, depth).items() if spec[template] != (RES,)])


def embedding_residual(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], spec: SpecTable, depth: int,
                       fix_ones: bool | groups.ResidualGroup) -> torch.Tensor:
    """The official code's first residual step: Procrustes on the residual tensors outside the blocks alone (the
    embeddings and the head), each (d, m) block divided by m as in the sweeps' Procrustes; one pair of blocks read
    at a time (two vocabularies in the search dtype, not four)."""
    names = [(name, axes) for name, layer, axes in _residual_side(a, spec, depth) if layer is None]
    if not names:
        raise ConfigError("the embeddings start needs a residual-side tensor outside the blocks (an embedding)")
    return groups.procrustes(_scaled_cross(a, b, names), fix_ones)


Block = tuple[torch.Tensor, torch.Tensor, float]  # (X_A, X_B, 1/m): views of the states, A's weight kept apart


def _block(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], name: str,
           axes: tuple[AxisKind | None, ...]) -> Block:
    """Tensor ``name`` of both states as (d, m) matrices, residual axis first, and its weight 1/m."""
    xa, xb = kind_first(a[name], axes, RES), kind_first(b[name], axes, RES)
    return xa, xb, 1 / xb.shape[1]


def _unit_kind(axes: tuple[AxisKind | None, ...]) -> AxisKind | None:
    """The unit axis of a tensor (heads, MLP), None where no unit map touches it."""
    return next((kind for kind in axes if kind not in (None, RES)), None)


def _residual_side(a: Mapping[str, torch.Tensor], spec: SpecTable, depth: int,
                   ) -> list[tuple[str, int | None, tuple[AxisKind | None, ...]]]:
    """(name, layer, axes) of the tensors with one residual axis (a stream-to-stream map is quadratic in Q: left
    out of the relaxed start)."""
    return [(name, layer, spec[template]) for name, (layer, template) in expand(spec, depth).items()
            if name in a and spec[template].count(RES) == 1]


def _scaled_cross(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor],
                  names: list[tuple[str, tuple[AxisKind | None, ...]]]) -> torch.Tensor:
    """Σ X_A X_Bᵀ / m over the (d, m) blocks of ``names``, one pair read at a time (a vocabulary is made, used and
    dropped before the next)."""
    def product(name: str, axes: tuple[AxisKind | None, ...]) -> torch.Tensor:  # its frame alone holds the pair
        xa, xb, weight = _block(a, b, name, axes)
        return (xa @ xb.T) * weight

    return functools.reduce(torch.add, (product(name, axes) for name, axes in names))


def _shared_blocks(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor],
                   names: list[tuple[str, tuple[AxisKind | None, ...]]]) -> list[list[Block]]:
    """One layer's unit-touched tensors ``names`` as (d, m) pairs grouped by the unit map they share (q and k; v and
    the head outputs; the MLP), the unit axis as columns."""
    shared: defaultdict[tuple[str, int], list[Block]] = defaultdict(list)
    for name, axes in names:
        xa, xb, weight = _block(a, b, name, axes)
        unit = _unit_kind(axes)
        if unit == QKV:  # the fused axis is (3, H, d_h): q and k share a map, v shares the head outputs'
            (qa, ka, va), (qb, kb, vb) = xa.chunk(3, 1), xb.chunk(3, 1)
            shared["qk", qa.shape[1]] += [(qa, qb, weight), (ka, kb, weight)]
            shared["vo", va.shape[1]].append((va, vb, weight))
        else:  # separate q and k share a relaxed map where they are as wide (no grouped queries), as v and o do
            share = "qk" if unit in (Q, K) else "vo" if unit in (V, HEADS) else "mlp"
            shared[share, xa.shape[1]].append((xa, xb, weight))
    return list(shared.values())


def _gram(xs: list[torch.Tensor], scales: list[float]) -> torch.Tensor:
    """X Xᵀ in float64 for X the (d, n) blocks ``xs`` stacked, block i scaled by ``scales[i]``: each pair of blocks
    multiplied once (the Gram is symmetric) and nothing stacked."""
    width = xs[0].shape[0]
    gram = torch.empty(len(xs) * width, len(xs) * width, dtype=torch.float64, device=xs[0].device)
    for i, j in itertools.combinations_with_replacement(range(len(xs)), 2):
        block = (xs[i] @ xs[j].T).double() * (scales[i] * scales[j])
        gram[i * width:(i + 1) * width, j * width:(j + 1) * width] = block
        gram[j * width:(j + 1) * width, i * width:(i + 1) * width] = block.T
    return gram


def _factor(xs: list[torch.Tensor], scales: list[float], out: torch.Tensor) -> None:
    """L with L Lᵀ = X Xᵀ for the stacked, scaled blocks X (k, n) of :func:`_gram`, written to ``out`` (k, k);
    X = L Qᵀ for some orthonormal (n, k) Q. Cholesky in float64, or, for a rank-deficient X, the eigenvectors scaled
    by the root of their eigenvalues, those at rounding level set to zero (zero columns of L: they meet nothing in
    the gradient)."""
    gram = _gram(xs, scales)
    factor, info = torch.linalg.cholesky_ex(gram)
    if int(info) != 0:
        values, vectors = torch.linalg.eigh(gram)
        keep = values > values.max() * gram.shape[0] * torch.finfo(xs[0].dtype).eps
        factor = vectors * torch.where(keep, values.clamp_min(0).sqrt(), 0)
    out.copy_(factor)


def _low_rank(blocks: list[Block]) -> bool:
    """Whether the K stacked (d, n) blocks have fewer rows than units, so the group's polar factor comes from a
    (K·d)-square core (:class:`_RelaxedGroup`)."""
    width, units = blocks[0][0].shape
    return len(blocks) * width < units


class _RelaxedGroup:
    """The residual-side blocks (X_A,k, X_B,k), each (d, n), that share one unit map relaxed to O(n), and that
    map's part of the residual gradient at Q: Σ_k X_A,k P X_B,kᵀ with P the polar factor of M = Σ_k X_A,kᵀ Q X_B,k.

    When the K stacked blocks have fewer rows than n (an MLP: 2d against 4d units), M = Q_A (L_Aᵀ Q L_B) Q_Bᵀ with
    X = L Qᵀ (:func:`_factor`, once per matching), so the polar factor and the gradient come from the (2d, 2d)
    core alone: L_A polar(L_Aᵀ Q L_B) L_Bᵀ, on the blocks' diagonal. The same gradient as the (n, n) polar factor
    (its part outside M's range meets only zeros), at an eighth of the SVD's cost; a ``factored`` group keeps L_A
    and L_B (2, K·d, K·d) and drops its blocks, so the ascent never holds the folded MLP tensors of either model."""

    def __init__(self, blocks: list[Block], factored: bool) -> None:
        self.blocks = blocks
        self.factors: tuple[torch.Tensor, torch.Tensor] | None = None
        if factored:
            width, rows = blocks[0][0].shape[0], len(blocks) * blocks[0][0].shape[0]
            store = blocks[0][0].new_empty(2, rows, rows)
            _factor([xa for xa, _, _ in blocks], [weight for _, _, weight in blocks], store[0])
            _factor([xb for _, xb, _ in blocks], [1.0] * len(blocks), store[1])
            self.factors = store[0].reshape(len(blocks), width, -1), store[1].reshape(len(blocks), width, -1)
            self.blocks = []

    def gradient(self, q: torch.Tensor) -> torch.Tensor:
        if self.factors is None:
            p = groups.polar(torch.stack([(xa.T @ q @ xb) * w for xa, xb, w in self.blocks]).sum(0))
            return torch.stack([(xa @ p @ xb.T) * w for xa, xb, w in self.blocks]).sum(0)
        la, lb = self.factors
        w = groups.polar((la.mT @ q @ lb).sum(0))
        return (la @ w @ lb.mT).sum(0)


def _relaxed_groups(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], spec: SpecTable,
                    depth: int) -> list[_RelaxedGroup]:
    """One :class:`_RelaxedGroup` per unit map, read a layer at a time (layers side by side), the low-rank groups
    factored as they are read: the ascent holds their factors and the head groups' blocks, never every layer's
    tensors of both models at once."""
    layers: defaultdict[int | None, list[tuple[str, tuple[AxisKind | None, ...]]]] = defaultdict(list)
    for name, layer, axes in _residual_side(a, spec, depth):
        if _unit_kind(axes) is not None:
            layers[layer].append((name, axes))

    def read(names: list[tuple[str, tuple[AxisKind | None, ...]]]) -> list[_RelaxedGroup]:
        return [_RelaxedGroup(blocks, _low_rank(blocks)) for blocks in _shared_blocks(a, b, names)]

    return [group for made in groups.side_by_side(read, list(layers.values())) for group in made]


def relaxed_residual(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], spec: SpecTable, depth: int,
                     fix_ones: bool | groups.ResidualGroup, steps: int = RELAXED_STEPS, tol: float = RELAXED_TOL,
                     linear: torch.Tensor | None = None) -> torch.Tensor:
    """A residual start that assumes nothing of B's basis: the residual objective with each unit map relaxed from
    (permutation × within-head maps) to the full orthogonal group of its axis, where it has a closed form (a polar
    factor). Block ascent from the Procrustes solution of the tensors no unit map touches, for ``steps`` at most:
    it ends early once Q moves by less than ``tol`` (relative Frobenius), as it does at once on a transformed copy
    whose embeddings fix Q. ``linear``: Σ X_A X_Bᵀ / m over the tensors that no unit map touches, where the caller
    has it (weight matching's :attr:`Descent.fixed`: a vocabulary is multiplied once per matching)."""
    if linear is None:
        fixed = [(name, axes) for name, _, axes in _residual_side(a, spec, depth) if _unit_kind(axes) is None]
        if not fixed:
            raise ConfigError("the relaxed start needs a residual-side tensor that no unit map touches (an embedding)")
        linear = _scaled_cross(a, b, fixed)
    relaxed = _relaxed_groups(a, b, spec, depth)
    q = groups.procrustes(linear, fix_ones)
    for _ in range(steps):
        grad = functools.reduce(torch.add, groups.side_by_side(functools.partial(_RelaxedGroup.gradient, q=q),
                                                               relaxed), linear)
        q, last = groups.procrustes(grad, fix_ones), q
        if float(torch.linalg.matrix_norm(q - last)) <= tol * q.shape[0] ** 0.5:
            break
    return q


def _circuit_gram(x: torch.Tensor, y: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """⟨X_iᵀ U_i, Y_jᵀ V_j⟩ for all head pairs i, j, through (d_h × d_h) products: (H, H)."""
    return (torch.einsum("iae,jbe->ijab", x, y) * torch.einsum("iaf,jbf->ijab", u, v)).sum((2, 3))


def _circuit_norms(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """‖X_iᵀ U_i‖² for every head i, the diagonal of ``_circuit_gram(x, x, u, u)`` at 1/H of its cost: (H,)."""
    return (x @ x.mT * (u @ u.mT)).sum((1, 2))


def head_cost(fa: tuple[torch.Tensor, torch.Tensor], fb: tuple[torch.Tensor, torch.Tensor],
              squared: bool = True) -> torch.Tensor:
    """‖QK_i^A − QK_j^B‖² + ‖OV_i^A − OV_j^B‖² on the (bias-augmented) circuits, or the sum of the unsquared
    norms: (H, H)."""
    (qkv_a, o_a), (qkv_b, o_b) = fa, fb
    cost = torch.zeros(qkv_a.shape[1], qkv_b.shape[1], dtype=qkv_a.dtype, device=qkv_a.device)
    pairs = ((qkv_a[0], qkv_a[1], qkv_b[0], qkv_b[1]), (qkv_a[2], o_a, qkv_b[2], o_b))
    for xa, ya, xb, yb in pairs:
        # QK_i = X_iᵀ Y_i; OV_i = O_i V_i with O_iᵀ stored as the second factor.
        term = _circuit_norms(xa, ya)[:, None] + _circuit_norms(xb, yb)[None, :] - 2 * _circuit_gram(xa, xb, ya, yb)
        cost += term if squared else term.clamp_min(0).sqrt()
    return cost


def _within_head(fa: list[torch.Tensor], fb: list[torch.Tensor], rotary: int = 0) -> torch.Tensor:
    """Per-head orthogonal maps R_i = argmin ‖F_A,i − R_i F_B,i‖ for each pair of stacked factors (H, d_h, m_k),
    solved in one batched SVD: (K, H, d_h, d_h); the first map (q, k) commuting with rotary positions on the
    first ``rotary`` dimensions."""
    maps = groups.polar(torch.stack([x @ y.mT for x, y in zip(fa, fb, strict=True)]))
    if rotary:
        maps[0] = groups.rotary_polar(fa[0] @ fb[0].mT, rotary)
    return maps


def solve_heads(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], spec: SpecTable, depth: int,
                layer: int, heads: int, within: bool, options: WeightOptions = WeightOptions(), rotary: int = 0,
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Head permutation by LAP on circuit distances (KV heads and the queries within their groups), then the
    within-head orthogonal maps M (q, k) and N (v, o), one per KV head."""
    (qkv_a, o_a, kv), (qkv_b, o_b, _) = (head_factors(s, spec, depth, layer, heads) for s in (a, b))
    perm, group = grouped_assignment(-head_cost((qkv_a, o_a), (qkv_b, o_b), squared=options.head_cost == "squared"),
                                     kv)
    if not within:
        return perm, group, None, None
    order = matched_order(perm, group, heads)
    qkv_b, o_b = qkv_b[:, order], o_b[order]

    def stacked(qkv: torch.Tensor, out: torch.Tensor) -> list[torch.Tensor]:
        """Per KV head, the factors its q/k map and its v/o map act on: its queries and k; v and its outputs."""
        (q, k), (v, o) = kv_factors(qkv, out, kv)
        return [torch.cat([q, k], -1), torch.cat([v, o], -1)]

    qk, ov = _within_head(stacked(qkv_a, o_a), stacked(qkv_b, o_b), rotary)
    return perm, group, qk, ov


def _unit_rows(state: Mapping[str, torch.Tensor], spec: SpecTable, depth: int, layer: int) -> torch.Tensor:
    """Each MLP unit's fc1 row, bias and fc2 column as one row of unit L2 norm: (f, m)."""
    rows = torch.cat([gather(state, spec, depth, kind, layer) for kind in (MLP, MLP_GATE, MLP_IN)
                      if any(kind in axes for axes in spec.values())], dim=1)
    return F.normalize(rows, dim=1)


def l1_mlp_permutation(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], spec: SpecTable, depth: int,
                       layer: int) -> torch.Tensor:
    """The MLP permutation minimising the L1 distance between matched units' normalised rows (the official cost;
    the inner-product one is :meth:`glmc.match.descent.Descent.mlp_permutation`)."""
    return groups.assignment(-torch.cdist(_unit_rows(a, spec, depth, layer), _unit_rows(b, spec, depth, layer), p=1))


Solved = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor,
               torch.Tensor | None]


def _solve_layer(work: Descent, layer: Layer, residual: torch.Tensor | None, within: bool, options: WeightOptions,
                 ) -> Solved:
    """Given the residual map, one layer's head and query permutations and within-head maps, and its MLP
    permutation with its units' signs (None where none are searched: the L1 cost searches none)."""
    i = layer.index
    heads = solve_heads(*work.rotated(layer.heads, residual), work.spec, work.depth, i, work.heads, within, options,
                        work.rotary)
    mlp = (work.mlp_permutation(layer, residual) if options.mlp_cost == "inner"
           else (l1_mlp_permutation(*work.rotated(layer.mlp, residual), work.spec, work.depth, i), None))
    return (*heads, *mlp)


def _solve_units(work: Descent, residual: torch.Tensor | None, within: bool, options: WeightOptions) -> Transform:
    """Given the residual map, every layer's heads and MLP units: independent LAPs, layers side by side."""
    t = Transform(work.depth, residual=residual)
    solve = functools.partial(_solve_layer, work, residual=residual, within=within, options=options)
    solved = groups.side_by_side(solve, work.layers)
    for layer, (heads, group, qk, ov, mlp, signs) in zip(work.layers, solved, strict=True):
        i = layer.index
        t.heads[i], t.group[i], t.qk[i], t.ov[i], t.mlp[i], t.mlp_scale[i] = heads, group, qk, ov, mlp, signs
    return t


def _converged(work: Descent, last: Transform, new: Transform, before: float, after: float, tol: float) -> bool:
    """Whether the descent has ended: the objective improved by less than ``tol`` (relative) where the products
    resolve it; below their resolution (a copy matched to the search dtype's precision), once a sweep leaves every
    assignment as it was and moves Q by no more than 10 ulps (RMS entry)."""
    if after > work.resolution:
        return after > before * (1 - tol)
    if any(not torch.equal(x, y) for x, y in zip(last.heads + last.mlp + last.mlp_scale,
                                                  new.heads + new.mlp + new.mlp_scale, strict=True)
           if x is not None and y is not None):
        return False
    if last.residual is None or new.residual is None:
        return last.residual is None and new.residual is None
    moved = float(torch.linalg.matrix_norm(new.residual - last.residual)) / new.residual.shape[0]
    return moved <= 10 * torch.finfo(new.residual.dtype).eps


def _exact(t: Transform, fix_ones: bool | groups.ResidualGroup, rotary: int) -> Transform:
    """Re-project the continuous maps in float64, so a search in float32 still yields an exact group element."""
    residual = None if t.residual is None else groups.procrustes(t.residual.double(), fix_ones)
    qk = [None if m is None else groups.rotary_polar(m.double(), rotary) for m in t.qk]
    ov = [None if m is None else groups.polar(m.double()) for m in t.ov]
    return Transform(t.depth, residual=residual, heads=t.heads, qk=qk, ov=ov, mlp=t.mlp, mlp_scale=t.mlp_scale,
                     group=t.group)


def _start_residual(work: Descent, fix_ones: bool | groups.ResidualGroup, start: Start | torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor | None:
    """The residual map the first sweep assumes (None: the identity)."""
    if isinstance(start, torch.Tensor):
        return start.to(dtype)
    if start == "identity":
        return None
    if start == "relaxed":
        return relaxed_residual(work.a, work.b, work.spec, work.depth, fix_ones, linear=work.fixed.scaled)
    return embedding_residual(work.a, work.b, work.spec, work.depth, fix_ones)


def weight_match(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], spec: SpecTable, depth: int, heads: int,
    *, fix_ones: bool | groups.ResidualGroup = True, permutations_only: bool = False, max_sweeps: int = 15,
    tol: float = 1e-3,
    dtype: torch.dtype = torch.float32, start: torch.Tensor | None = None,
    options: WeightOptions | None = None, rotary: int = 0, permute_stream: bool = False, signs: bool = False,
) -> MatchResult:
    """Find T with T(θ_B) ≈ θ_A; ``permutations_only`` searches head and MLP permutations alone, the stream left as
    it is (the paper's ablation), or with ``permute_stream`` permutations of the stream too (the residual group
    becomes the permutation matrices: each Procrustes step a linear assignment).
    ``rotary``: the head dimensions rotary positions rotate, where the q/k maps must commute with them.
    ``fix_ones``: the residual group (:func:`glmc.symmetry.groups.residual_group`: True the orthogonal maps fixing 1,
    False all of O(d), or ``permutation``, where each Procrustes step is a linear assignment).
    ``signs``: a gated MLP's units are matched with their signs too (up row and down column flipped together, the
    orthogonal part of a unit's scale), as the whole group needs: balancing signs each unit by ⟨up, gate⟩ ≥ 0, which
    a slight perturbation flips where that product is near 0.

    ``options``: the start, the costs and the stopping rule (:class:`glmc.match.options.WeightOptions`). The start is
    the residual map the first sweep assumes: the ``relaxed`` solution (:func:`relaxed_residual`, the default), the
    identity, or the ``embeddings``' Procrustes (:func:`embedding_residual`); ``start``, a given map, replaces it.
    Each can end in another local optimum (``simulations.analyses.weight_starts`` measures how far apart they are).

    The search runs in ``dtype`` (float32 halves its cost); the result is re-projected in float64, so it is
    exact. Sweeps stop when ‖A − T(B)‖² improves by less than ``tol`` (relative), after ``max_sweeps`` at most.
    """
    began = time.perf_counter()
    options = options or WeightOptions()
    if options.biases == "skip":
        a, b = (without_stream_biases(s, spec, depth) for s in (a, b))
    a, b = (search_view(s, dtype) for s in (a, b))  # a half-precision model is widened tensor by tensor
    require_finite(a, "A")  # as searched: a lazy model's vocabulary is not made in float64 for the check
    require_finite(b, "B")
    work = Descent(a, b, spec, depth, heads, rotary, signs=signs and not permutations_only)
    group, within = ("permutation", False) if permutations_only else (fix_ones, True)
    frozen = permutations_only and not permute_stream  # the stream left as it is: one sweep of assignments
    if frozen and isinstance(start, torch.Tensor):
        raise ConfigError("permutation-only weight matching leaves the residual alone: it takes no start map")
    residual = None if frozen else _start_residual(work, group, options.start if start is None else start, dtype)
    if residual is not None and isinstance(start, torch.Tensor):
        residual = groups.procrustes(residual, group)  # a given start, onto the group searched
    t = _solve_units(work, residual, within, options)
    step, value = work.residual_step(t)
    objective = [value]
    for sweep in range(1, 1 if frozen else max_sweeps):
        # Q = argmax ⟨X_A, Q U(X_B)⟩ over the residual group: Procrustes on every residual-side matrix (Eq. 4).
        candidate = _solve_units(work, groups.procrustes(work.fixed.scaled + step, group), within, options)
        candidate_step, value = work.residual_step(candidate)
        log.info("weight matching sweep %d: ‖A − T(B)‖² = %.6g", sweep, value)
        if options.stop == "converged" and _converged(work, t, candidate, objective[-1], value, tol):
            if value < objective[-1] or value <= work.resolution:
                t, objective = candidate, [*objective, value]
            break
        t, step, objective = candidate, candidate_step, [*objective, value]
    return MatchResult(_exact(t, group, rotary), objective, time.perf_counter() - began, {"sweeps": len(objective)})


def warm_start(a: State, b: State, cfg: ModelConfig, options: MatchOptions, *, permutations_only: bool = False,
               permute_stream: bool = False, signs: bool = False) -> MatchResult:
    """Weight matching of canonical B to A in ``options.form`` with ``options.weight``: the weight methods' search,
    and where the learned methods start (permutations only: the residual left alone, or permuted too with
    ``permute_stream``; ``signs``: a gated MLP's unit signs searched too, which the learned methods carry as flips
    of B: :func:`learned_start`)."""
    arch = get_arch(cfg.family)
    return weight_match(a, b, arch.spec, cfg.depth, cfg.heads, fix_ones=residual_group(options.form, arch),
                        permutations_only=permutations_only, options=options.weight, rotary=cfg.rotary_dim,
                        permute_stream=permute_stream, signs=signs)


@dataclasses.dataclass
class LearnedStart:
    """Where the learned methods start: weight matching over the group their options name, with a gated MLP's unit
    flips (which their latents, permutations and within-head maps, do not hold) applied to B beforehand."""

    b: State  # B with the flips applied
    match: MatchResult  # the start on that B: the search's transform without its flips
    flips: Transform | None  # the flips in B's unit order; None where none were searched

    def carried(self, transform: Transform) -> Transform:
        """A transform of the flipped B as one of the given B."""
        return transform if self.flips is None else compose(transform, self.flips)


def _by_b_unit(perm: torch.Tensor | None, sign: torch.Tensor | None) -> torch.Tensor | None:
    """A matching's unit signs (of A's unit i and B's unit perm[i]) in B's unit order."""
    if sign is None or perm is None:
        return sign
    return sign.new_ones(len(sign)).index_copy(0, perm.to(sign.device), sign)


def learned_start(a: State, b: State, cfg: ModelConfig, options: MatchOptions, *,
                  permutations_only: bool = False) -> LearnedStart:
    """:func:`warm_start` with a gated MLP's unit signs searched where the whole group is, carried as flips of B."""
    init = warm_start(a, b, cfg, options, permutations_only=permutations_only,
                      signs=options.symmetry.group == "whole")
    pairs = list(zip(init.transform.mlp, init.transform.mlp_scale, strict=True))
    if all(sign is None for _, sign in pairs):
        return LearnedStart(b, init, None)
    flips = Transform(cfg.depth, mlp_scale=[_by_b_unit(perm, sign) for perm, sign in pairs])
    unsigned = dataclasses.replace(init, transform=dataclasses.replace(init.transform, mlp_scale=[]))
    return LearnedStart(apply(b, get_arch(cfg.family).spec, flips, cfg.heads), unsigned, flips)


# The registry's entry points (glmc.match.registry): canonical states a, b of cfg, the training data, MatchOptions.
def pairwise(a: State, b: State, cfg: ModelConfig, data: Dataset | None, options: MatchOptions) -> MatchResult:
    """Weight matching of B to A over every symmetry class of the family (then the path's v/o maps, if chosen); a
    gated MLP's unit signs searched where the whole group is."""
    result = warm_start(a, b, cfg, options, signs=options.symmetry.group == "whole")
    return result if options.weight.ov_maps == "orthogonal" else on_the_path(result, a, b, cfg)


def pairwise_permutations(a: State, b: State, cfg: ModelConfig, data: Dataset | None,
                          options: MatchOptions) -> MatchResult:
    """Weight matching restricted to head and MLP permutations, the residual stream left alone."""
    return warm_start(a, b, cfg, options, permutations_only=True)


def pairwise_stream_permutations(a: State, b: State, cfg: ModelConfig, data: Dataset | None,
                                 options: MatchOptions) -> MatchResult:
    """Weight matching restricted to permutations, of the residual stream, heads and MLP units."""
    return warm_start(a, b, cfg, options, permutations_only=True, permute_stream=True)
