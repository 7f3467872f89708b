"""Weight matching's sweeps without repeated work (paper §4.1), reading only the spec.

A sweep pairs A with B rotated by the residual map Q (for the unit assignments), then A with B moved by the unit
maps (for the next Q), and measures ‖A − T(B)‖². Only the tensors that a unit map touches change from sweep to
sweep. The others (embeddings, the head, the stream's biases) enter through (d, d) products computed once, in
float64, so a 50,257-row vocabulary costs two products per matching rather than two per sweep. The distance of the
unit-touched tensors comes from the products of the next Procrustes step too (‖X_A‖² + ‖X_B‖² − 2⟨Q, X_A U(X_B)ᵀ⟩),
so no sweep materialises T(B). An MLP's residual product is kept while its permutation (and signs) stay, and its
assignment is not solved again, nor its tensors rotated, while a margin certificate proves that the optimum cannot
have moved (the cost is linear in Q). The results are those of solving every assignment afresh: the certificate
only skips solves whose answer is known.

Cost matrices are built where the states live (a GPU included); only (n, n) matrices go to the CPU, for scipy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from glmc.core.spec import HEADS, MLP, MLP_GATE, MLP_IN, QKV, RES, AxisKind, K, Q, SpecTable, V, expand, gated
from glmc.core.state import State
from glmc.match.common import cross, kind_first, sq_distance, sq_norm
from glmc.symmetry import groups
from glmc.symmetry.transforms import Transform, apply, require_folded

HEAD_KINDS: tuple[AxisKind, ...] = (QKV, Q, K, V, HEADS)
MLP_KINDS: tuple[AxisKind, ...] = (MLP, MLP_GATE, MLP_IN)
# Entries of a float32 cost are off by far less than this share of ‖a_i‖·‖b_j‖; a certificate must beat it.
ROUNDING = 1e-4


def _sub(state: Mapping[str, torch.Tensor], names: list[str]) -> State:
    return {n: state[n] for n in names}


def _same(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
    """Whether two optional tensors are equal (both None included)."""
    return x is y or (x is not None and y is not None and torch.equal(x, y))


def _or_identity(q: torch.Tensor | None, width: int, like: torch.Tensor) -> torch.Tensor:
    """``q`` (None is the identity) as a (d, d) matrix in ``like``'s dtype and device."""
    return torch.eye(width, dtype=like.dtype, device=like.device) if q is None else q.to(like.device, like.dtype)


@dataclass
class Fixed:
    """The tensors no unit map touches, reduced to (d, d) matrices over their residual-side ones: Σ X_A X_Bᵀ / m
    (the Procrustes input, search dtype), Σ X_A X_Bᵀ and Σ X_B X_Bᵀ (float64, for the distance) and the squared
    norms; and the squared distance of those without a residual axis, which no map moves."""

    scaled: torch.Tensor
    cross: torch.Tensor
    gram: torch.Tensor
    norms: float
    unmoved: float
    # stream-to-stream maps (both axes residual, as BERT's MLM transform): (A, B) in float64, whose distance
    # ‖A − Q B Qᵀ‖² is quadratic in Q; they count in the distance exactly, and in the Procrustes input linearised at
    # the current Q (:meth:`linearised`)
    quadratic: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def linearised(self, q: torch.Tensor) -> torch.Tensor:
        """Σ (A Q Bᵀ + Aᵀ Q B) / 2d over the stream-to-stream maps, the gradient of ⟨A, Q B Qᵀ⟩ at Q halved and
        weighted per entry as the other tensors are: their part of the next Procrustes input, in Q's dtype."""
        total = torch.zeros_like(q)
        q64 = q.double()
        for xa, xb in self.quadratic:
            total += ((xa @ q64 @ xb.T + xa.T @ q64 @ xb) / (2 * xa.shape[1])).to(q.dtype)
        return total

    def distance(self, q: torch.Tensor | None) -> float:
        """Σ ‖X_A − Q X_B‖² + the unmoved distance, in float64: ‖X_A‖² + ‖X_B‖² − 2⟨Σ X_A X_Bᵀ, Q⟩ plus the
        ⟨Σ X_B X_Bᵀ, QᵀQ − I⟩ that a Q orthogonal only to float32 precision adds."""
        eye = torch.eye(self.cross.shape[0], dtype=self.cross.dtype, device=self.cross.device)
        q64 = _or_identity(q, eye.shape[0], eye)
        drift = float((self.gram * (q64.T @ q64 - eye)).sum())
        both = sum(float(((xa - q64 @ xb @ q64.T) ** 2).sum()) for xa, xb in self.quadratic)
        return self.norms + drift - 2 * float((self.cross * q64).sum()) + self.unmoved + both


def _products(xa: torch.Tensor, xb: torch.Tensor, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(X_A X_Bᵀ, X_B X_Bᵀ, m) in float64 for (d, m) matrices: products of the search dtype over chunks of m (bounded
    memory for a vocabulary), summed in float64. The cross products meet a near-equal ‖X_A‖² + ‖X_B‖² in the
    distance, so the distance is as exact as the search dtype's products (about 1e-7 of ‖A‖² in float32), as it is
    for the unit-touched tensors (:class:`Products`)."""
    cross_ab = torch.zeros(xa.shape[0], xa.shape[0], dtype=torch.float64, device=xa.device)
    for start in range(0, xa.shape[1], chunk):
        cross_ab += (xa[:, start:start + chunk] @ xb[:, start:start + chunk].T).double()
    return cross_ab, (xb @ xb.T).double(), xa.shape[1]


def fixed_part(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], spec: SpecTable, depth: int,
               names: list[str], width: int, squares: Callable[[str], float]) -> Fixed:
    """The :class:`Fixed` reduction of ``names`` (tensors without a unit axis), computed once per matching;
    ``squares(name)`` is ‖A[name]‖² + ‖B[name]‖²."""
    like = a[names[0]]
    cross_ab = torch.zeros(width, width, dtype=torch.float64, device=like.device)
    gram_b, scaled = torch.zeros_like(cross_ab), torch.zeros_like(cross_ab)
    norms, unmoved = 0.0, 0.0
    quadratic = []
    for name, (_, template) in expand(spec, depth).items():
        axes = spec[template]
        if name not in names:
            continue
        if axes.count(RES) > 1:
            quadratic.append((a[name].double(), b[name].double()))
            continue
        if RES not in axes:
            unmoved += float(((a[name] - b[name]).double() ** 2).sum())
            continue
        # not bound here: the pair is dropped before the next is read (two vocabularies at a time, not four)
        c, g, m = _products(kind_first(a[name], axes, RES), kind_first(b[name], axes, RES))
        cross_ab, gram_b, scaled = cross_ab + c, gram_b + g, scaled + c / m
        norms += squares(name)
    return Fixed(scaled.to(like.dtype), cross_ab, gram_b, norms, unmoved, quadratic)


@dataclass
class Certificate:
    """Why an MLP permutation found at the residual map ``q`` stays optimal near it: each row's best column is
    its assigned one by ``margin``; moving Q by δ (Frobenius) changes cost entry (i, j) by at most ‖a_i‖·δ·‖b_j‖,
    so the assignment stands while every margin exceeds twice that (plus rounding). A signed one's entries
    gate + |updown| move no more (|x| is 1-Lipschitz, and ‖g_a‖‖g_b‖ + ‖u_a‖‖u_b‖ ≤ ‖a‖‖b‖), nor its signs' margins."""

    q: torch.Tensor | None
    perm: torch.Tensor
    margin: torch.Tensor  # (f,)
    row_norms: torch.Tensor  # (f,) ‖a_i‖
    col_norm: float  # max_j ‖b_j‖
    signs: torch.Tensor | None = None  # (f,) ±1 of a gated MLP's signed assignment

    def holds(self, q: torch.Tensor | None) -> bool:
        """Whether the permutation is still the unique optimum at the residual map ``q``."""
        ref = q if q is not None else self.q
        delta = 0.0
        if ref is not None:
            width = ref.shape[0]
            delta = float(torch.linalg.matrix_norm(_or_identity(q, width, ref) - _or_identity(self.q, width, ref)))
        bound = self.row_norms * self.col_norm * (2 * delta + ROUNDING)
        return bool((self.margin > bound).all())


def _row_norms(state: Mapping[str, torch.Tensor], spec: SpecTable, depth: int) -> torch.Tensor:
    """‖x_i‖ over the tensors of ``state`` that have an MLP axis, that axis first (rows joined across tensors)."""
    total = None
    for name, (_, template) in expand(spec, depth).items():
        axes = spec[template]
        if name in state and any(k in axes for k in MLP_KINDS):
            kind = next(k for k in MLP_KINDS if k in axes)
            sq = kind_first(state[name], axes, kind).square().sum(1)
            total = sq if total is None else total + sq
    if total is None:
        raise ValueError("no tensor has an MLP axis")
    return total.sqrt().double()


def certified_assignment(cost: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The permutation maximising Σ cost[i, p(i)]. When every row's strict maximum lies in a distinct column, that
    permutation is the unique optimum (no solver needed) and each row's margin over its runner-up comes with it;
    otherwise scipy's assignment and None."""
    if cost.shape[1] < 2:
        return groups.assignment(cost), None
    top = cost.topk(2, dim=1)
    best, margin = top.indices[:, 0], top.values[:, 0] - top.values[:, 1]
    if bool((margin > 0).all()) and int(torch.unique(best).numel()) == cost.shape[0]:
        return best.cpu(), margin.double()
    return groups.assignment(cost), None


def signed_assignment(gate: torch.Tensor, updown: torch.Tensor,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The signed permutation maximising Σ gate[i, p(i)] + s_i·updown[i, p(i)] (a gated unit's up row and down
    column may flip sign together): p by the cost gate + |updown|, s_i the sign of updown[i, p(i)]; the margin
    (:func:`certified_assignment`) also no more than 2|updown[i, p(i)]|, how far each sign is from flipping."""
    perm, margin = certified_assignment(gate + updown.abs())
    chosen = updown.gather(1, perm.to(updown.device)[:, None])[:, 0].double()
    signs = torch.where(chosen < 0, -1.0, 1.0).to(chosen)
    return perm, signs, None if margin is None else torch.minimum(margin, 2 * chosen.abs())


@dataclass
class Products:
    """What a group of unit-touched tensors adds to a sweep's residual step, for unit maps U at the residual map
    Q: Σ X_A U(X_B)ᵀ / m over its residual-side tensors (the Procrustes input), the same unscaled in float64 and
    ‖X_A‖² + ‖X_B‖² (so ‖X_A − Q U(X_B)‖² = norms − 2⟨Q, cross⟩), and the distance of its tensors without a
    residual axis (biases), which Q leaves alone."""

    scaled: torch.Tensor
    cross: torch.Tensor
    norms: float
    unaxed: float

    def distance(self, q: torch.Tensor | None) -> float:
        return self.norms - 2 * float((self.cross * _or_identity(q, self.cross.shape[0], self.cross)).sum()) \
            + self.unaxed


@dataclass
class Layer:
    """One layer's tensors that unit maps touch, split by the map they share, and what its MLP keeps."""

    index: int
    heads: list[str] = field(default_factory=list)
    mlp: list[str] = field(default_factory=list)
    mlp_products: tuple[torch.Tensor, torch.Tensor | None, Products] | None = None  # (perm, signs, their Products)
    certificate: Certificate | None = None
    norms: tuple[torch.Tensor, float] | None = None  # A's MLP rows' norms, the largest of B's (for certificates)


class Descent:
    """A canonical pair (in the search dtype) prepared for weight matching's sweeps: its tensors sorted into the
    fixed ones and each layer's unit groups, and the products kept between sweeps. ``signs``: a gated MLP's units
    are assigned with their signs (:func:`signed_assignment`)."""

    def __init__(self, a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], spec: SpecTable, depth: int,
                 heads: int, rotary: int = 0, signs: bool = False) -> None:
        self.a, self.b, self.spec, self.depth, self.heads, self.rotary = a, b, spec, depth, heads, rotary
        self.signs = signs and gated(spec)
        self.layers = [Layer(layer) for layer in range(depth)]
        self.fixed_names: list[str] = []
        for name, (layer, template) in expand(spec, depth).items():
            axes = spec[template]
            if name not in a:
                continue
            if layer is not None and any(k in axes for k in HEAD_KINDS):
                self.layers[layer].heads.append(name)
            elif layer is not None and any(k in axes for k in MLP_KINDS):
                self.layers[layer].mlp.append(name)
            else:
                self.fixed_names.append(name)
        self.width = next(kind_first(a[n], spec[t], RES).shape[0] for n, (_, t) in expand(spec, depth).items()
                          if n in a and RES in spec[t])
        self._fixed: Fixed | None = None
        self._squares: dict[str, float] = {}

    @property
    def fixed(self) -> Fixed:
        """The fixed tensors' products, computed on first use (a permutation-only matching never needs them); only
        a residual map reads them, and rotating the stream needs every LayerNorm folded: checked here, once."""
        if self._fixed is None:
            require_folded(self.b, self.spec, self.depth)
            self._fixed = fixed_part(self.a, self.b, self.spec, self.depth, self.fixed_names, self.width,
                                     self._norms)
        return self._fixed

    def fixed_distance(self, q: torch.Tensor | None) -> float:
        """‖A − Q(B)‖² over the fixed tensors; rotating the stream needs every LayerNorm folded (SpecError)."""
        if q is None:
            return sq_distance(_sub(self.a, self.fixed_names), _sub(self.b, self.fixed_names))
        return self.fixed.distance(q)

    def rotated(self, names: list[str], q: torch.Tensor | None) -> tuple[State, State]:
        """These tensors of A as they are and of B with the residual map ``q`` applied."""
        return _sub(self.a, names), apply(_sub(self.b, names), self.spec, Transform(self.depth, residual=q),
                                          self.heads)

    def mlp_permutation(self, layer: Layer, q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The MLP permutation maximising ⟨X_A, P Q(X_B)⟩ (Eq. 3), with its units' signs where they are searched
        (else None), unless the layer's certificate proves the last still optimal at ``q`` (then B's MLP tensors
        are not even rotated)."""
        if layer.certificate is not None and layer.certificate.holds(q):
            return layer.certificate.perm, layer.certificate.signs
        a, moved = self.rotated(layer.mlp, q)
        signs = None
        if self.signs:
            perm, signs, margin = signed_assignment(*(cross(a, moved, self.spec, self.depth, kinds, layer.index)
                                                      for kinds in ((MLP_GATE,), (MLP, MLP_IN))))
        else:
            perm, margin = certified_assignment(cross(a, moved, self.spec, self.depth, MLP_KINDS, layer.index))
        if margin is None:
            layer.certificate = None
        else:
            if layer.norms is None:  # B's rows unrotated: Q keeps their norms
                cols = _row_norms(_sub(self.b, layer.mlp), self.spec, self.depth)
                layer.norms = _row_norms(a, self.spec, self.depth), float(cols.max())
            layer.certificate = Certificate(q, perm, margin, *layer.norms, signs)
        return perm, signs

    def residual_step(self, t: Transform) -> tuple[torch.Tensor, float]:
        """The unit-touched tensors' part of the next Procrustes input, Σ X_A U(X_B)ᵀ / m over their residual-side
        ones (U the unit maps of ``t``; each (d, m) block divided by m so that every tensor counts per entry; the
        fixed tensors' part is ``fixed.scaled``), and ‖A − T(B)‖² at ``t``."""
        # the fixed products first, so that their pair of vocabularies is never read beside the layers' products
        q = t.residual
        fixed = None if q is None else self.fixed
        units = Transform(self.depth, heads=t.heads, qk=t.qk, ov=t.ov, mlp=t.mlp, mlp_scale=t.mlp_scale,
                          group=t.group)
        stacked, distance = self._stacked_parts(units, q)
        scaled = stacked.sum(0)
        if q is not None and fixed is not None and fixed.quadratic:
            scaled = scaled + fixed.linearised(q.to(scaled.device, scaled.dtype))
        distance += self.fixed_distance(q)
        return scaled, max(distance, 0.0)  # a distance; below the products' rounding it reads 0

    def _stacked_parts(self, units: Transform, q: torch.Tensor | None) -> tuple[torch.Tensor, float]:
        """Every layer's heads' and MLP's ``scaled`` stacked (2·depth, d, d), and Σ of their distances at ``q``, in
        layer order: layers side by side a wave (as many as torch has threads) at a time, each part's products
        dropped once it is stacked and its distance taken (unless kept: :meth:`_layer_products`), never all held
        beside their stacked copy."""
        stacked: torch.Tensor | None = None
        distance = 0.0
        wave = max(torch.get_num_threads(), 1)
        for first in range(0, self.depth, wave):
            made = groups.side_by_side(functools.partial(self._layer_products, units=units),
                                       self.layers[first:first + wave])
            for index, part in enumerate((part for pair in made for part in pair), 2 * first):
                if stacked is None:
                    stacked = part.scaled.new_empty(2 * self.depth, *part.scaled.shape)
                stacked[index] = part.scaled
                distance += part.distance(q)  # on the caller's threads, as the sum it replaces
        if stacked is None:
            raise ValueError("no layer has unit-touched tensors")
        return stacked, distance

    def _layer_products(self, layer: Layer, units: Transform) -> tuple[Products, Products]:
        """A layer's heads' and MLP's :class:`Products` at ``units``; the MLP's kept while its permutation and signs
        stay."""
        heads = self._products(layer.heads, units)
        perm, signs, kept = units.mlp[layer.index], units.mlp_scale[layer.index], layer.mlp_products
        if kept is not None and perm is not None and torch.equal(kept[0], perm) and _same(kept[1], signs):
            return heads, kept[2]
        mlp = self._products(layer.mlp, units)
        layer.mlp_products = None if perm is None else (perm, signs, mlp)
        return heads, mlp

    def _products(self, names: list[str], units: Transform) -> Products:
        moved = apply(_sub(self.b, names), self.spec, units, self.heads)
        like = self.a[names[0]]
        scaled = torch.zeros(self.width, self.width, dtype=like.dtype, device=like.device)
        raw = torch.zeros(self.width, self.width, dtype=torch.float64, device=like.device)
        norms, unaxed = 0.0, 0.0
        for name, (_, template) in expand(self.spec, self.depth).items():
            axes = self.spec[template]
            if name not in moved:
                continue
            if RES not in axes:
                unaxed += float(((self.a[name] - moved[name]).double() ** 2).sum())
                continue
            xa, xb = kind_first(self.a[name], axes, RES), kind_first(moved[name], axes, RES)
            product = xa @ xb.T
            scaled, raw = scaled + product / xa.shape[1], raw + product.double()
            norms += self._norms(name)
        return Products(scaled, raw, norms, unaxed)

    @functools.cached_property
    def resolution(self) -> float:
        """The smallest ‖A − T(B)‖² that the search dtype's products resolve: 64 ulps of ‖A‖² + ‖B‖²."""
        return 64 * torch.finfo(next(iter(self.a.values())).dtype).eps * sum(self._norms(name) for name in self.a)

    def _norms(self, name: str) -> float:
        """‖A[name]‖² + ‖B[name]‖² in float64, once per tensor: unit maps and Q are orthogonal, so they keep B's."""
        if name not in self._squares:
            self._squares[name] = sq_norm(self.a[name]) + sq_norm(self.b[name])
        return self._squares[name]
