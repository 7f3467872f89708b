"""Apply, compose and invert symmetry transforms on canonical state dicts, reading only the spec.

A transform acts as: residual stream x → Q x; heads of layer l reordered by ``heads[l]`` (new head i is
old head ``heads[l][i]``), then q_i → M_i q_i, k_i → M_i⁻ᵀ k_i, v_i → N_i v_i with W_O,i → W_O,i N_i⁻¹;
MLP units reordered by ``mlp[l]`` then scaled by ``mlp_scale[l]`` (ReLU only). Every one of these leaves
the network function unchanged (paper §3.2). With grouped-query attention, ``heads[l]`` and the maps act on the
KV heads, and ``group[l]`` (H_kv, G) reorders the query heads inside each group after the groups have moved (new
query j of group i is old query ``group[l][i, j]`` of the moved group i); the group's M acts on each of its queries.

A reordering may also be a dense (n, n) matrix P acting as new = P @ old: a hard permutation matrix with a
straight-through gradient, or a soft (doubly stochastic) one (paper App. D). ``apply`` accepts both forms;
``compose`` and ``invert`` need the index form.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from glmc.core.config import ModelConfig
from glmc.core.spec import HEADS, MLP, MLP_GATE, MLP_IN, NORM, QKV, RES, AxisKind, K, Q, SpecTable, V, expand
from glmc.core.state import HALF, Lazy, State
from glmc.errors import SpecError
from glmc.symmetry import groups

if TYPE_CHECKING:
    from glmc.symmetry.groups import ResidualGroup

Layered = list[torch.Tensor | None]


def _nones(depth: int) -> Layered:
    return [None] * depth


@dataclass
class Transform:
    """One element of the model's symmetry group; ``None`` entries are identities."""

    depth: int
    residual: torch.Tensor | None = None  # (d, d) orthogonal
    heads: Layered = field(default_factory=list)  # per layer (H_kv,) long, or a dense (H_kv, H_kv) matrix
    qk: Layered = field(default_factory=list)  # per layer (H_kv, d_h, d_h) invertible M
    ov: Layered = field(default_factory=list)  # per layer (H_kv, d_h, d_h) invertible N
    mlp: Layered = field(default_factory=list)  # per layer (f,) long, or a dense (f, f) matrix
    mlp_scale: Layered = field(default_factory=list)  # per layer (f,) positive (ReLU) or nonzero (gated)
    group: Layered = field(default_factory=list)  # per layer (H_kv, G) long: queries reordered within each group

    def __post_init__(self) -> None:
        for name in ("heads", "qk", "ov", "mlp", "mlp_scale", "group"):
            if not getattr(self, name):
                setattr(self, name, _nones(self.depth))

    @classmethod
    def identity(cls, depth: int) -> Transform:
        return cls(depth)


def _batched(maps: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Apply per-head maps (H, a, b) to x (H, b, rest) → (H, a, rest)."""
    return torch.einsum("hab,hbr->har", maps.to(x.device, x.dtype), x)


def _reorder(x: torch.Tensor, p: torch.Tensor, axis: int = 0) -> torch.Tensor:
    """Reorder ``axis`` of x: new i = old p[i] for an index tensor, new = P @ old for a dense (n, n) matrix."""
    if p.dim() == 1:
        return x.index_select(axis, p.to(x.device))
    return torch.tensordot(p.to(x.device, x.dtype), x.movedim(axis, 0), dims=1).movedim(0, axis)


def _inv_t(m: torch.Tensor) -> torch.Tensor:
    """M⁻ᵀ per map; M itself where M is orthogonal to this dtype's precision (weight matching's maps, exactly as
    they are). Chosen on the device, not by a host-side test: on a GPU that would be a device sync per call, and a
    learned path applies transforms at every step. A singular map gives non-finite weights."""
    eye = torch.eye(m.shape[-1], dtype=m.dtype, device=m.device)
    deviation = (m @ m.mT - eye).abs().amax((-2, -1), keepdim=True)
    orthogonal = deviation <= (1e-12 if m.dtype == torch.float64 else 1e-5)
    return torch.where(orthogonal, m, groups.inverse(m).mT)


def _maybe_inv_t(m: torch.Tensor | None) -> torch.Tensor | None:
    """M⁻ᵀ, or None for the identity: what k rows take of the q map, and the head outputs of the v map."""
    return None if m is None else _inv_t(m)


def _apply_kv(y: torch.Tensor, t: Transform, layer: int, kind: AxisKind) -> torch.Tensor:
    """y: (H_kv, d_h, rest), one KV head per entry: the heads' permutation, then M⁻ᵀ (k) or N (v)."""
    if t.heads[layer] is not None:
        y = _reorder(y, t.heads[layer])  # type: ignore[arg-type]
    maps = _maybe_inv_t(t.qk[layer]) if kind == K else t.ov[layer]
    return y if maps is None else _batched(maps, y)


def _apply_grouped(y: torch.Tensor, t: Transform, layer: int, maps: torch.Tensor | None) -> torch.Tensor:
    """y: (H_kv, G, d_h, rest), query heads (or their outputs) by group: the groups' permutation, the queries'
    within each group, then the group's map on each of its queries."""
    if t.heads[layer] is not None:
        y = _reorder(y, t.heads[layer])  # type: ignore[arg-type]
    group = t.group[layer]
    if group is not None:
        y = torch.gather(y, 1, group.to(y.device)[:, :, None, None].expand(y.shape))
    return y if maps is None else torch.einsum("hab,hgbr->hgar", maps.to(y.device, y.dtype), y)


def _kv_heads(t: Transform, layer: int) -> int | None:
    """The number of KV heads of ``layer`` as its entries give it (None: they are all the identity)."""
    for entry in (t.heads[layer], t.qk[layer], t.ov[layer], t.group[layer]):
        if entry is not None:
            return entry.shape[0]
    return None


def _apply_attention(x: torch.Tensor, t: Transform, layer: int, heads: int, kind: AxisKind) -> torch.Tensor:
    """x: (rows, rest) of an attention axis. QKV: 3·H·d_h rows, q heads | k heads | v heads (timm qkv, HF c_attn
    alike); Q and HEADS: H·d_h rows in KV groups; K and V: H_kv·d_h rows."""
    kv = _kv_heads(t, layer)
    if kv is None:
        return x
    rest = x.shape[1]
    if kind == QKV:
        q, k, v = x.reshape(3, kv, -1, rest)
        parts = [_apply_grouped(q[:, None], t, layer, t.qk[layer])[:, 0], _apply_kv(k, t, layer, K),
                 _apply_kv(v, t, layer, V)]
        return torch.stack(parts).reshape(x.shape)
    if kind in (K, V):
        return _apply_kv(x.reshape(kv, -1, rest), t, layer, kind).reshape(x.shape)
    maps = t.qk[layer] if kind == Q else _maybe_inv_t(t.ov[layer])
    return _apply_grouped(x.reshape(kv, heads // kv, -1, rest), t, layer, maps).reshape(x.shape)


def _apply_mlp(x: torch.Tensor, t: Transform, layer: int, kind: AxisKind) -> torch.Tensor:
    """MLP units: the permutation, then the scale on what fc1 (``up``) writes and its inverse on what fc2 reads."""
    perm = t.mlp[layer]
    if perm is not None:
        x = _reorder(x, perm)
    scale, reader = t.mlp_scale[layer], kind == MLP_IN
    if scale is not None and kind != MLP_GATE:
        s = scale.to(x.device, x.dtype).unsqueeze(1)
        x = x / s if reader else x * s
    return x


def _acts(kind: AxisKind | None, t: Transform, layer: int | None) -> bool:
    """Whether ``t`` changes an axis of ``kind`` in ``layer``: :func:`_apply_axis` leaves any other as it is."""
    if kind == RES:
        return t.residual is not None
    if layer is None:
        return False
    if kind in (QKV, Q, K, V, HEADS):
        return _kv_heads(t, layer) is not None
    if kind in (MLP, MLP_GATE, MLP_IN):
        return t.mlp[layer] is not None or (t.mlp_scale[layer] is not None and kind != MLP_GATE)
    return False


def _apply_axis(
    x: torch.Tensor, axis: int, kind: AxisKind | None, t: Transform, layer: int | None, heads: int
) -> torch.Tensor:
    """Transform one axis of one tensor according to its kind in the spec."""
    y = x.movedim(axis, 0)
    shape = y.shape
    y = y.reshape(shape[0], -1)
    if kind == RES and t.residual is not None:
        y = t.residual.to(y.device, y.dtype) @ y
    elif layer is not None and kind in (QKV, Q, K, V, HEADS):
        y = _apply_attention(y, t, layer, heads, kind)
    elif layer is not None and kind in (MLP, MLP_GATE, MLP_IN):
        y = _apply_mlp(y, t, layer, kind)
    return y.reshape(shape).movedim(0, axis)


def require_folded(state: Mapping[str, torch.Tensor], spec: SpecTable, depth: int) -> None:
    """SpecError unless every LayerNorm gain of ``state`` is folded to ones: a rotation of the stream commutes with
    LayerNorm only then."""
    for name, (_, template) in expand(spec, depth).items():
        x = state.get(name)
        if NORM in spec[template] and x is not None and not torch.allclose(x, torch.ones_like(x)):
            raise SpecError(f"{name} is not folded; canonicalise (fold LayerNorms) before rotating the residual")


def apply(state: Mapping[str, torch.Tensor], spec: SpecTable, t: Transform, heads: int, *,
          folded: bool = False) -> State:
    """θ → T(θ) for a canonical state dict; the network function is unchanged. ``folded``: the caller has checked
    the gains (:func:`require_folded`) once, as a learned path does for its endpoints, instead of at every call."""
    if t.residual is not None and not folded:
        require_folded(state, spec, t.depth)
    return {name: _move(state[name], spec[template], t, layer, heads)
            for name, (layer, template) in expand(spec, t.depth).items() if name in state}


def moved(state: Mapping[str, torch.Tensor], spec: SpecTable, t: Transform, heads: int) -> Lazy:
    """:func:`apply`, made one tensor at a time on each read (:class:`Lazy`), bit for bit the tensor :func:`apply`
    returns: B moved by a matching is written tensor by tensor, never held whole. The gains are checked now. A
    search reads a tensor ``t`` leaves alone as it reads ``state`` (a :class:`Lazy` one's stored tensor where that is
    exact), so a balanced model searched holds no copy of its embeddings or of the tensors no balancing map moves."""
    if t.residual is not None:
        require_folded(state, spec, t.depth)
    where = {name: (layer, template) for name, (layer, template) in expand(spec, t.depth).items() if name in state}

    def make(name: str) -> torch.Tensor:
        layer, template = where[name]
        return _move(state[name], spec[template], t, layer, heads)

    def search(name: str, dtype: torch.dtype) -> torch.Tensor:
        layer, template = where[name]
        if isinstance(state, Lazy) and not any(_acts(kind, t, layer) for kind in spec[template]):
            return state.search(name, dtype)
        return make(name).to(dtype)

    return Lazy(where, make, search)


def _move(stored: torch.Tensor, axes: tuple[AxisKind | None, ...], t: Transform, layer: int | None,
          heads: int) -> torch.Tensor:
    """One tensor moved by ``t`` along each of its axes; half precision moved in float32 and rounded once."""
    x = stored.float() if stored.dtype in HALF else stored
    for axis, kind in enumerate(axes):
        if _acts(kind, t, layer):
            x = _apply_axis(x, axis, kind, t, layer, heads)
    return x.to(stored.dtype)


def maps_to(t: Transform, device: torch.device) -> Transform:
    """``t`` with its continuous maps (and dense reorderings) on ``device``; index permutations stay where they
    are, on the host where assignments make them, as weight matching leaves them on a GPU."""
    def on(x: torch.Tensor | None) -> torch.Tensor | None:
        return x if x is None or not x.is_floating_point() else x.to(device)

    return Transform(t.depth, residual=on(t.residual), heads=[on(p) for p in t.heads], qk=[on(m) for m in t.qk],
                     ov=[on(m) for m in t.ov], mlp=[on(p) for p in t.mlp], mlp_scale=[on(s) for s in t.mlp_scale],
                     group=t.group)


def _compose_perm(p2: torch.Tensor | None, p1: torch.Tensor | None) -> torch.Tensor | None:
    """Reordering by p1 then by p2 is reordering by p1[p2]."""
    if p1 is None or p2 is None:
        return p2 if p1 is None else p1
    _require_indices(p1, p2)
    return p1[p2]


def _compose_maps(m2: torch.Tensor | None, m1: torch.Tensor | None, p2: torch.Tensor | None) -> torch.Tensor | None:
    """Per-unit maps after a reorder: unit i carries m2[i] · m1[p2[i]] (matrices) or products (scales)."""
    if m1 is None:
        return m2
    if p2 is not None:
        _require_indices(p2)
    moved = m1 if p2 is None else m1[p2]
    if m2 is None:
        return moved
    return m2 @ moved if m2.dim() == 3 else m2 * moved


def compose(t2: Transform, t1: Transform) -> Transform:
    """T2 ∘ T1: apply T1 first, then T2."""
    residual = t1.residual if t2.residual is None else t2.residual if t1.residual is None else t2.residual @ t1.residual
    layers = range(t1.depth)
    return Transform(
        depth=t1.depth,
        residual=residual,
        heads=[_compose_perm(t2.heads[i], t1.heads[i]) for i in layers],
        qk=[_compose_maps(t2.qk[i], t1.qk[i], t2.heads[i]) for i in layers],
        ov=[_compose_maps(t2.ov[i], t1.ov[i], t2.heads[i]) for i in layers],
        mlp=[_compose_perm(t2.mlp[i], t1.mlp[i]) for i in layers],
        mlp_scale=[_compose_maps(t2.mlp_scale[i], t1.mlp_scale[i], t2.mlp[i]) for i in layers],
        group=[_compose_groups(t2.group[i], t1.group[i], t2.heads[i]) for i in layers],
    )


def _compose_groups(g2: torch.Tensor | None, g1: torch.Tensor | None, p2: torch.Tensor | None,
                    ) -> torch.Tensor | None:
    """Queries reordered by g1 within groups, the groups then moved by p2 and reordered by g2: query j of group i
    is old query g1[p2[i], g2[i, j]]."""
    if g1 is None:
        return g2
    if p2 is not None:
        _require_indices(p2)
    moved = g1 if p2 is None else g1[p2]
    return moved if g2 is None else torch.gather(moved, 1, g2)


def _invert_maps(m: torch.Tensor | None, inv_perm: torch.Tensor | None) -> torch.Tensor | None:
    if m is None:
        return None
    moved = m if inv_perm is None else m[inv_perm]
    return groups.inverse(moved) if moved.dim() == 3 else 1.0 / moved


def _argsort(p: torch.Tensor | None) -> torch.Tensor | None:
    if p is None:
        return None
    _require_indices(p)
    return torch.argsort(p)


def _require_indices(*perms: torch.Tensor) -> None:
    """Composing or inverting a dense (soft) reordering is not defined here; refuse rather than mis-index."""
    if any(p.dim() != 1 for p in perms):
        raise SpecError("compose/invert need index permutations; harden dense ones first")


def invert(t: Transform) -> Transform:
    """T⁻¹, so that compose(invert(T), T) is the identity."""
    layers = range(t.depth)
    head_inv = [_argsort(t.heads[i]) for i in layers]
    mlp_inv = [_argsort(t.mlp[i]) for i in layers]
    return Transform(
        depth=t.depth,
        residual=None if t.residual is None else t.residual.T,
        heads=head_inv,
        qk=[_invert_maps(t.qk[i], head_inv[i]) for i in layers],
        ov=[_invert_maps(t.ov[i], head_inv[i]) for i in layers],
        mlp=mlp_inv,
        mlp_scale=[_invert_maps(t.mlp_scale[i], mlp_inv[i]) for i in layers],
        group=[_invert_group(t.group[i], head_inv[i]) for i in layers],
    )


def _invert_group(group: torch.Tensor | None, inv_perm: torch.Tensor | None) -> torch.Tensor | None:
    """The within-group reordering of T⁻¹: each group's inverse, taken where the inverse moves that group."""
    if group is None:
        return None
    moved = group if inv_perm is None else group[inv_perm]
    return torch.argsort(moved, dim=1)


SYMMETRY_CLASSES = ("residual", "head-perm", "within-head-orthogonal", "within-head-invertible", "mlp-perm",
                    "mlp-scale")


# The orthogonal classes, which the matchers search directly; the others (within-head invertible maps, MLP scales) they
# reach by balancing both models first (glmc.match.balance).
MATCHABLE = ("residual", "head-perm", "within-head-orthogonal", "mlp-perm")


def random_transform(cfg: ModelConfig, classes: tuple[str, ...], generator: torch.Generator,
                     fix_ones: bool | ResidualGroup = True) -> Transform:
    """A random group element of ``cfg``'s sizes made of the named symmetry classes (for invariance checks): maps
    per KV head, queries permuted within their groups, q/k maps commuting with rotary positions where the model
    has them; the residual map drawn from ``fix_ones``' group (:func:`glmc.symmetry.groups.residual_group`)."""
    depth, kv, head_dim, mlp = cfg.depth, cfg.kv_heads, cfg.head_dim, cfg.mlp

    def per_layer(make):  # type: ignore[no-untyped-def]
        return [make() for _ in range(depth)]

    def head_maps(make):  # type: ignore[no-untyped-def]
        return per_layer(lambda: torch.stack([make(head_dim) for _ in range(kv)]))

    t = Transform(depth)
    if "residual" in classes:
        t.residual = groups.random_residual(cfg.width, generator, fix_ones)
    if "head-perm" in classes:
        t.heads = per_layer(lambda: groups.random_permutation(kv, generator))
        if cfg.group > 1:
            t.group = per_layer(lambda: torch.stack([groups.random_permutation(cfg.group, generator)
                                                     for _ in range(kv)]))
    if "within-head-orthogonal" in classes or "within-head-invertible" in classes:
        orth = "within-head-invertible" not in classes
        free = ((lambda n: groups.random_orthogonal(n, generator, fix_ones=False)) if orth
                else (lambda n: groups.random_invertible(n, generator)))
        t.qk = head_maps(lambda n: groups.random_rotary(n, cfg.rotary_dim, generator, orth) if cfg.rotary_dim
                         else free(n))
        t.ov = head_maps(free)
    if "mlp-perm" in classes:
        t.mlp = per_layer(lambda: groups.random_permutation(mlp, generator))
    if "mlp-scale" in classes:
        t.mlp_scale = per_layer(lambda: torch.exp(torch.randn(mlp, generator=generator, dtype=torch.float64)))
    return t
