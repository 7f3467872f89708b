"""Models of different widths in one universe (paper App. E): exact embedding of a narrow
standard-form model into a wider architecture, projection back, and least-squares coverage-weighted merging.

A :class:`Placement` says where a narrow model's units sit inside the wide model, one map per axis kind of
the spec: the residual stream through a semi-orthogonal ``E`` (D, d) with ``E·1_d/√d = 1_D/√D``, heads, the
coordinates of a head and MLP units through index maps (the rest are zero heads and dead neurons). Every
function here reads only the spec, the arch's writer and LayerNorm tables, and the configs.

Embedding a standard-form state is exact. A pre-norm stream (LayerNorm or RMSNorm, gains folded): writers take ``E
W``; the centring of a LayerNorm commutes with ``E`` because E maps 1 to 1 (an RMSNorm has none, so it would need
only orthonormal columns), and the root mean square over D of ``E x`` is √(d/D) times the one over d once the eps
becomes ``eps·d/D`` (√(‖x‖²/D + eps·d/D) = √(d/D)·√(‖x‖²/d + eps)), so the norm's output is √(D/d)·E n(x) and its
readers take ``W Eᵀ·√(d/D)``; an LN bias read by a bias-less reader becomes ``√(D/d)·E β``. A post-LayerNorm stream
(x ← γ ⊙ n(x + f(x)) + β, nothing folded) is read as it is, so every residual axis takes E alone, readers ``W Eᵀ``
and the gain and bias ``E γ``, ``E β``: with the same eps·d/D, n(E y) = √(D/d)·E n(y), and ``(E γ) ⊙ √(D/d)·E z =
E(γ ⊙ z)`` holds for every γ only when each row of E has one nonzero, which with E's orthonormal columns and E·1 ∝ 1
means each coordinate repeated D/d times with weight √(d/D), so D must be a multiple of d. A GELU between two
residual-width spaces (a masked-LM head) does not pass that √(d/D) through; an exact embedding would repeat the
stream at scale 1 and the head's norm at d/D, which needs the head's space declared apart from the stream's, so a
post-LayerNorm model changes width only with ReLU. Heads move whole, by KV head (a group's G query heads with it)
and coordinate; zero q/k rows in a head change 1/√d_h, so q is scaled by √(d_h'/d_h), and rotary positions forbid
that (their frequencies and the pairing of i with i + r/2 depend on d_h), so they keep d_h. Gated MLP units move
with their gate rows; a zero ``up`` row makes a dead unit whatever the gate. :func:`widen` instead fills the extra
heads and units with copies of the model's own (Net2Net), also exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from glmc.archs import get_arch
from glmc.core.config import ModelConfig, scale_width
from glmc.core.spec import HEADS, MLP, MLP_GATE, MLP_IN, NORM, QKV, RES, AxisKind, K, Q, V, block_linears, expand
from glmc.core.state import State
from glmc.errors import ConfigError, SpecError
from glmc.match.common import head_factors, kind_first
from glmc.symmetry.groups import ones_complement
from glmc.symmetry.transforms import Transform

# How a narrow model fills the universe's extra heads and MLP units: zero heads and dead neurons (the exact
# embedding), or copies of its own (:func:`widen`).
FILLS = ("zeros", "copies")
# Fields that fix a model's width; every other field must agree for two models to share a universe.
WIDTH_FIELDS = ("width", "heads", "mlp", "head_dim", "norm_eps")
WIDE_SIZES = (("width", "residual width d"), ("heads", "heads H"), ("head_dim", "head size d_h"),
              ("mlp", "MLP width f"))
HEAD_KINDS = (QKV, Q, K, V, HEADS)  # axes that hold heads: they move by KV head and head coordinate
UNIT_KINDS = (MLP, MLP_GATE, MLP_IN)  # axes that hold MLP units


@dataclass
class Placement:
    """Where the units of a ``narrow`` model sit in the ``wide`` universe model.

    ``residual`` (D, d): orthonormal columns, E·1_d/√d = 1_D/√D for an exact embedding (a coordinate
    selection gives HeteroFL's masks instead). ``heads[l]`` (H_kv,) and ``mlp[l]`` (f,): the universe index
    of each of the model's KV heads (with its group of query heads; H_kv = H without grouped queries) and MLP
    units. ``head_dim`` (d_h,): the coordinates of a head it uses.
    """

    narrow: ModelConfig
    wide: ModelConfig
    residual: torch.Tensor
    heads: list[torch.Tensor]
    head_dim: torch.Tensor
    mlp: list[torch.Tensor]

    def projector(self) -> torch.Tensor:
        """P = E Eᵀ (D, D): the orthogonal projector onto the model's residual subspace."""
        return self.residual @ self.residual.T


def require_width_tier(cfg: ModelConfig, mult: float, asked: str, instead: str) -> None:
    """ConfigError (one line) naming what is missing where ``asked`` (e.g. "--width-mult 0.5") would give a ``cfg``
    model a width others of its shape cannot be merged with; ``instead``: what to ask for."""
    try:
        other = scale_width(cfg, mult)
        check_embeddable(*sorted((cfg, other), key=lambda c: c.width))
    except ConfigError as err:
        raise ConfigError(f"{asked}: {cfg.family} models of these widths cannot be merged ({err}); {instead}") from None


def check_embeddable(narrow: ModelConfig, wide: ModelConfig) -> None:
    """ConfigError (one line) unless ``narrow`` fits inside ``wide``: same family, depth and data, no larger size."""
    if narrow.family != wide.family:
        raise ConfigError(f"cannot put a {narrow.family} model in a {wide.family} universe: families differ")
    if narrow.depth != wide.depth:
        raise ConfigError(f"depths differ ({narrow.depth} vs {wide.depth}): depth-heterogeneous merging is out "
                          "of scope; only widths may differ")
    for name, label in (("num_classes", "class counts"), ("vocab_size", "vocabularies")):
        if getattr(narrow, name) != getattr(wide, name):
            raise ConfigError(f"{label} differ ({getattr(narrow, name)} vs {getattr(wide, name)})")
    a, b = narrow.to_dict(), wide.to_dict()
    if diff := [k for k, v in a.items() if b[k] != v and k not in (*WIDTH_FIELDS, "kv_heads")]:
        raise ConfigError(f"models differ in {', '.join(diff)}; only widths may differ")
    if narrow.group != wide.group:
        raise ConfigError(f"query heads per KV head differ ({narrow.group} vs {wide.group}): a narrower model must "
                          "keep its groups")
    if narrow.head_dim != wide.head_dim and wide.rotary_pct > 0:
        raise ConfigError(f"head sizes differ ({narrow.head_dim} vs {wide.head_dim}): rotary positions fix a head's "
                          "size (their frequencies and pairs depend on it)")
    if narrow != wide and get_arch(wide.family).norm == "post":
        _require_repeatable(narrow, wide)
    for name, label in WIDE_SIZES:
        if getattr(narrow, name) > getattr(wide, name):
            raise ConfigError(f"the target is narrower than an input: {label} {getattr(wide, name)} < "
                              f"{getattr(narrow, name)}")


def _require_repeatable(narrow: ModelConfig, wide: ModelConfig) -> None:
    """ConfigError unless a post-LayerNorm ``narrow`` embeds exactly by :func:`repeated_embedding`: D a multiple of
    d, and no layer that reads and writes the stream's width (BERT's MLM head) applies an activation that the
    embedding's √(d/D) does not pass through (ReLU does)."""
    if wide.width % narrow.width:
        raise ConfigError(f"a post-LayerNorm stream's norm statistics change with the width unless each coordinate "
                          f"is repeated: residual width {wide.width} is not a multiple of {narrow.width}")
    if wide.activation != "relu" and (RES, RES) in get_arch(wide.family).spec.values():
        raise ConfigError(f"a post-LayerNorm {wide.family}'s {wide.activation} at the stream's width (its head) does "
                          "not commute with the embedding's √(d/D) scale: only a relu one changes width")


def residual_embedding(d: int, big: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """E (D, d) with orthonormal columns and E·1_d/√d = 1_D/√D: E = 1_D 1_dᵀ/√(Dd) + B⊥_D[:, :d−1] B⊥_dᵀ."""
    if d == big:
        return torch.eye(d, dtype=dtype)
    ones = torch.ones(big, d, dtype=torch.float64) / (big * d) ** 0.5
    return (ones + ones_complement(big)[:, : d - 1] @ ones_complement(d).T).to(dtype)


def repeated_embedding(d: int, big: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """E (D, d) repeating each coordinate D/d times with weight √(d/D) (D a multiple of d): the one embedding
    whose rows have a single nonzero, so that it commutes with a post-LayerNorm's gains (module docstring)."""
    return torch.eye(d, dtype=dtype).repeat_interleave(big // d, 0) * (d / big) ** 0.5


def stream_embedding(narrow: ModelConfig, wide: ModelConfig, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The residual map of the default placement: :func:`repeated_embedding` on a post-LayerNorm stream, else
    :func:`residual_embedding`."""
    post = get_arch(wide.family).norm == "post"
    return (repeated_embedding if post else residual_embedding)(narrow.width, wide.width, dtype)


def place(narrow: ModelConfig, wide: ModelConfig, dtype: torch.dtype = torch.float64) -> Placement:
    """The default placement: residual by :func:`stream_embedding`, the first H_kv KV heads (with their query
    heads), d_h coordinates, f units."""
    check_embeddable(narrow, wide)
    first = [torch.arange(narrow.kv_heads) for _ in range(narrow.depth)]  # heads move by KV head, as transforms do
    return Placement(narrow, wide, stream_embedding(narrow, wide, dtype), first,
                     torch.arange(narrow.head_dim), [torch.arange(narrow.mlp) for _ in range(narrow.depth)])


def principal_place(state: Mapping[str, torch.Tensor], narrow: ModelConfig, wide: ModelConfig) -> Placement:
    """The placement keeping most of a wide canonical ``state`` (data-free): per layer the KV groups of largest
    Σ ‖W_O W_V‖ over their heads and the MLP units of largest ‖fc1 row‖·‖fc2 column‖, and the residual subspace
    spanned by 1 and the top eigenvectors of the weights' residual Gram (a post-LayerNorm stream keeps
    :func:`repeated_embedding`: no other commutes with its gains). HeteroFL's first-k slice ignores where the weight
    is."""
    check_embeddable(narrow, wide)
    d_h = torch.arange(narrow.head_dim)
    heads = [_top(_head_energy(state, wide, layer).reshape(wide.kv_heads, -1).sum(1), narrow.kv_heads)
             for layer in range(wide.depth)]
    mlp = [_top(_unit_energy(state, wide, layer), narrow.mlp) for layer in range(wide.depth)]
    post = get_arch(wide.family).norm == "post"
    residual = stream_embedding(narrow, wide) if post else _principal_residual(state, narrow.width, wide)
    return Placement(narrow, wide, residual, heads, d_h, mlp)


def _top(energy: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k largest entries, in increasing order (the first k when all are equal)."""
    return torch.sort(torch.argsort(-energy, stable=True)[:k]).values


def _head_energy(state: Mapping[str, torch.Tensor], cfg: ModelConfig, layer: int) -> torch.Tensor:
    """(H,) ‖W_O,h W_V,h‖_F: what each head can write into the residual stream (its weights sum to one)."""
    factors, out, _ = head_factors(state, get_arch(cfg.family).spec, cfg.depth, layer, cfg.heads)
    v = factors[2][..., :cfg.width]  # the weights, not the bias column
    return torch.stack([torch.linalg.matrix_norm(out[h].T @ v[h]) for h in range(cfg.heads)])


def _unit_energy(state: Mapping[str, torch.Tensor], cfg: ModelConfig, layer: int) -> torch.Tensor:
    """(f,) ‖fc1 row‖·‖fc2 column‖ of every MLP unit (the weights that write and read it, biases aside)."""
    spec = get_arch(cfg.family).spec
    read, written = (torch.linalg.vector_norm(kind_first(state[f"{name.format(l=layer)}.w"], spec[f"{name}.w"], kind),
                                              dim=1)
                     for name, kind in ((block_linears(spec, outputs=(MLP,))[0], MLP),
                                        (block_linears(spec, inputs=(MLP_IN,))[0], MLP_IN)))
    return read * written


def _principal_residual(state: Mapping[str, torch.Tensor], d: int, wide: ModelConfig) -> torch.Tensor:
    """E (D, d) mapping 1 to 1 whose other columns span the top d−1 eigenvectors, within 1⊥, of Σ RᵀR/‖R‖²
    over every weight matrix R with a residual axis (rows against the residual)."""
    if d == wide.width:
        return torch.eye(d, dtype=torch.float64)
    spec = get_arch(wide.family).spec
    gram = torch.zeros(wide.width, wide.width, dtype=torch.float64)
    for name, (_, template) in expand(spec, wide.depth).items():
        if name not in state:  # a parameter this variant does not have
            continue
        axes = spec[template]
        rows = _as_rows(state[name].double(), axes)
        energy = float(rows.square().sum())
        if RES in axes and rows.shape[0] > 1 and energy > 0:
            gram += rows.T @ rows / energy
    basis = ones_complement(wide.width)
    _, vectors = torch.linalg.eigh(basis.T @ gram @ basis)
    top = basis @ vectors.flip(1)[:, : d - 1]
    ones = torch.ones(wide.width, d, dtype=torch.float64) / (wide.width * d) ** 0.5
    return ones + top @ ones_complement(d).T


def embedding_config(p: Placement) -> ModelConfig:
    """The wide config in which the embedding is exact: LayerNorm eps scaled by d/D."""
    return p.wide.replace(norm_eps=p.narrow.norm_eps * p.narrow.width / p.wide.width)


def _residual_scale(p: Placement, template: str) -> float:
    """How a residual axis scales besides E: 1 for writers and on a post-LayerNorm stream, √(d/D) for readers of a
    pre-norm, √(D/d) for LN biases."""
    arch = get_arch(p.wide.family)
    prefix = template.rsplit(".", 1)[0]
    ratio = p.narrow.width / p.wide.width
    if template in arch.writers or prefix in arch.writers or arch.norm == "post":
        return 1.0
    return ratio**-0.5 if prefix in arch.folds else ratio**0.5


def _unit_shape(kind: AxisKind, cfg: ModelConfig) -> tuple[int, int, int, int]:
    """A head axis as (blocks, H_kv, G, d_h): fused QKV rows (3, H, 1, d_h), Q rows and HEADS columns
    (1, H_kv, G, d_h), K and V rows (1, H_kv, 1, d_h)."""
    if kind == QKV:
        return (3, cfg.heads, 1, cfg.head_dim)
    return (1, cfg.kv_heads, 1 if kind in (K, V) else cfg.group, cfg.head_dim)


def _head_units(x: torch.Tensor, kind: AxisKind, p: Placement, layer: int, embed: bool) -> torch.Tensor:
    """Scatter (embed) or gather (project) the head rows of x (n, rest), KV head by KV head; q is rescaled by
    √(d_h'/d_h)."""
    src, dst = (p.narrow, p.wide) if embed else (p.wide, p.narrow)
    y = x.reshape(*_unit_shape(kind, src), -1)
    heads, coords = p.heads[layer].to(x.device), p.head_dim.to(x.device)
    if embed:
        within = y.new_zeros(*y.shape[:3], p.wide.head_dim, y.shape[-1])
        within[:, :, :, coords] = y
        out = y.new_zeros(*_unit_shape(kind, dst), y.shape[-1])
        out[:, heads] = within
    else:
        out = y[:, heads][:, :, :, coords]
    scale = (p.wide.head_dim / p.narrow.head_dim) ** (0.5 if embed else -0.5)
    if kind == QKV:
        out[0] = out[0] * scale
    elif kind == Q:
        out = out * scale
    return out.reshape(-1, x.shape[1])


def _mlp_units(x: torch.Tensor, p: Placement, layer: int, embed: bool) -> torch.Tensor:
    """Dead neurons: embed scatters the f rows into F zero rows; project gathers them back."""
    if not embed:
        return x[p.mlp[layer]]
    out = x.new_zeros(p.wide.mlp, x.shape[1])
    out[p.mlp[layer]] = x
    return out


def _map_axis(x: torch.Tensor, kind: AxisKind, p: Placement, layer: int | None, scale: float,
              embed: bool) -> torch.Tensor:
    """One axis (first, x is (n, rest)) moved between the narrow and wide models."""
    if kind == RES:
        e = p.residual.to(x.device, x.dtype)
        return e @ x * scale if embed else e.T @ x / scale
    if kind == NORM:
        if not torch.allclose(x, torch.ones_like(x)):
            raise SpecError("a LayerNorm gain is not folded; canonicalise (standard form) before changing widths")
        return x.new_ones(p.wide.width if embed else p.narrow.width, x.shape[1])
    assert layer is not None
    if kind in HEAD_KINDS:
        return _head_units(x, kind, p, layer, embed)
    return _mlp_units(x, p, layer, embed)


def _map_state(state: Mapping[str, torch.Tensor], p: Placement, embed: bool) -> State:
    """Every tensor, every axis of a known kind, moved by the placement (embed) or back (project)."""
    spec = get_arch(p.wide.family).spec
    out: State = {}
    for name, (layer, template) in expand(spec, p.wide.depth).items():
        if name not in state:
            continue
        x = state[name]
        for axis, kind in enumerate(spec[template]):
            if kind is None:
                continue
            y = x.movedim(axis, 0)
            moved = _map_axis(y.reshape(y.shape[0], -1), kind, p, layer, _residual_scale(p, template), embed)
            x = moved.reshape(-1, *y.shape[1:]).movedim(0, axis)
        out[name] = x
    return out


def embed(state: Mapping[str, torch.Tensor], p: Placement) -> State:
    """The narrow standard-form canonical state as a wide one computing the same function.

    Exact in the architecture of :func:`embedding_config` (LayerNorm eps scaled by d/D).
    """
    return _map_state(state, p, embed=True)


def project(state: Mapping[str, torch.Tensor], p: Placement) -> State:
    """A wide canonical state restricted to the model's subspace: exact for MLP units and heads, Eᵀ for the
    residual. ``project(embed(θ, p), p) = θ``; this is the downlink to a narrow client."""
    return _map_state(state, p, embed=False)


def widen(state: Mapping[str, torch.Tensor], cfg: ModelConfig, wide: ModelConfig) -> tuple[State, ModelConfig]:
    """Net2Net widening (Chen et al., 2016) of a narrow canonical state to the wide model's head and MLP counts at
    its own residual width and head size: slot k copies head (unit) k mod H (f), and the copies of one share
    its output. Exact; embedded, the copies fill the heads and units that :func:`embed` leaves zero, so that
    they have a partner to interpolate with."""
    check_embeddable(cfg, wide)
    wider = cfg.replace(heads=wide.heads, kv_heads=wide.kv_heads, mlp=wide.mlp, head_dim=cfg.head_dim)
    sources = {HEADS: torch.arange(wide.kv_heads) % cfg.kv_heads, MLP: torch.arange(wide.mlp) % cfg.mlp}
    spec = get_arch(cfg.family).spec
    out: State = {}
    for name, (_, template) in expand(spec, cfg.depth).items():
        if name not in state:
            continue
        x = state[name]
        for axis, kind in enumerate(spec[template]):
            if kind in (*HEAD_KINDS, *UNIT_KINDS):
                x = _copy_units(x.movedim(axis, 0), kind, cfg, sources).movedim(0, axis)
        out[name] = x
    return out, wider


def _copy_units(x: torch.Tensor, kind: AxisKind, cfg: ModelConfig, sources: dict[AxisKind, torch.Tensor],
                ) -> torch.Tensor:
    """The unit axis (first) of x gathered from its sources (heads by KV head, with their groups); the reading side
    (HEADS, MLP_IN) divided by each source's number of copies."""
    heads = kind in HEAD_KINDS
    src = sources[HEADS if heads else MLP]
    share = 1.0 / torch.bincount(src)[src].to(x.dtype)
    if heads:
        units = x.reshape(*_unit_shape(kind, cfg), -1)[:, src]
        units = units * share[None, :, None, None, None] if kind == HEADS else units
    else:
        units = x.reshape(x.shape[0], -1)[src]
        units = units * share[:, None] if kind == MLP_IN else units
    return units.reshape(-1, *x.shape[1:])


def _as_indices(perm: torch.Tensor) -> torch.Tensor:
    """A reordering as an index tensor (new i = old perm[i]); a dense matrix must be a hard permutation."""
    if perm.dim() == 1:
        return perm
    hard = perm.argmax(1)
    if not torch.equal(perm, torch.eye(len(hard), dtype=perm.dtype, device=perm.device)[hard]):
        raise ConfigError("a soft permutation does not move a placement; harden it first")
    return hard.cpu()  # placements live on the CPU, whatever device the states are matched on


def _moved(index: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """Where units now sit after a reordering in which new unit i is old unit perm[i]."""
    return index if perm is None else torch.argsort(_as_indices(perm).cpu())[index]


def move(p: Placement, t: Transform) -> Placement:
    """The placement of a model after the universe model it sits in is transformed by ``t``.

    Within-head maps keep a head's subspace only when the model fills the whole head (d_h = d_h').
    """
    partial_heads = p.narrow.head_dim < p.wide.head_dim
    if partial_heads and any(m is not None for m in (*t.qk, *t.ov)):
        raise ConfigError("within-head maps mix a narrower head's zero rows; merging models of different head "
                          "sizes needs a method without them (none or weight-perm)")
    residual = p.residual if t.residual is None else t.residual.to(p.residual.device, p.residual.dtype) @ p.residual
    return dataclasses.replace(p, residual=residual,
                               heads=[_moved(h, t.heads[i]) for i, h in enumerate(p.heads)],
                               mlp=[_moved(m, t.mlp[i]) for i, m in enumerate(p.mlp)])


def axis_mask(kind: AxisKind, p: Placement, layer: int | None) -> torch.Tensor | None:
    """(n,) 0/1 coverage of a non-residual axis in the universe, or None where the model covers all of it."""
    if kind in HEAD_KINDS and layer is not None:
        blocks, kv, group, d_h = _unit_shape(kind, p.wide)
        mask = torch.zeros(kv, d_h, dtype=torch.float64)
        mask[p.heads[layer][:, None], p.head_dim[None, :]] = 1.0
        return mask[None, :, None, :].expand(blocks, kv, group, d_h).flatten()
    if kind in UNIT_KINDS and layer is not None:
        return torch.zeros(p.wide.mlp, dtype=torch.float64).index_fill_(0, p.mlp[layer], 1.0)
    return None


def _row_mask(shape: torch.Size, axes: tuple[AxisKind | None, ...], p: Placement, layer: int | None,
              ) -> torch.Tensor:
    """Coverage of every row (all axes but the residual one, flattened in order) as a 0/1 vector."""
    mask = torch.ones((), dtype=torch.float64)
    for size, kind in zip(shape, axes, strict=True):
        if kind == RES:
            continue
        axis = axis_mask(kind, p, layer) if kind is not None else None
        axis = torch.ones(size, dtype=torch.float64) if axis is None else axis
        mask = (mask[..., None] * axis).flatten()
    return mask.reshape(-1)


UNCOVERED_TOL = 1e-8  # a residual direction counts as uncovered when the coverage's projector misses it by more
# Residual directions whose coverage Σ c_i P_i is under this share of its largest count as uncovered. Narrow models
# aligned apart span subspaces at small angles; their difference along the thin directions between them, divided by
# a tiny coverage, blew a merge of narrow clients alone (vit-fl tiers 0.5 and 0.25, untrained restrictions of one
# model) up to 22× the model's norm; at 1% it lands within 0.07 of it. A full-width input covers every direction.
MIN_COVERAGE = 1e-2


def _lstsq_rows(rows: Sequence[torch.Tensor], masks: torch.Tensor, projectors: Sequence[torch.Tensor],
                weights: torch.Tensor, fill: torch.Tensor | None = None) -> torch.Tensor:
    """Each row r: w* = (Σ c_ir w_ir P_i)(Σ c_ir P_i)⁺ with c_ir = n_i·mask_ir, solved once per coverage pattern; with
    ``fill`` (the same rows of an anchor), what no model covers (rows, or residual directions outside the span of
    Σ c_ir P_i) keeps the anchor's value, as HeteroFL keeps the global value of an entry no client held."""
    coverage = masks * weights[:, None]  # (N, rows)
    patterns, group = torch.unique(coverage.T, dim=0, return_inverse=True)
    out = torch.zeros_like(rows[0]) if fill is None else fill.clone()
    for g, c in enumerate(patterns):
        idx = (group == g).nonzero().flatten()
        if float(c.sum()) == 0.0:
            continue  # no model covers these rows: the anchor's, else zero (dead units, or a direction nobody uses)
        total = sum(float(c[i]) * projectors[i] for i in range(len(rows)) if c[i] > 0)
        numerator = sum(float(c[i]) * rows[i][idx] @ projectors[i] for i in range(len(rows)) if c[i] > 0)
        inverse = torch.linalg.pinv(total, hermitian=True, rtol=MIN_COVERAGE)
        merged = numerator @ inverse
        if fill is not None:
            uncovered = torch.eye(len(inverse), dtype=inverse.dtype, device=inverse.device) - inverse @ total
            if float(uncovered.abs().max()) > UNCOVERED_TOL:  # else bit for bit the merge without an anchor
                merged = merged + fill[idx] @ uncovered
        out[idx] = merged
    return out


def _as_rows(x: torch.Tensor, axes: tuple[AxisKind | None, ...]) -> torch.Tensor:
    """(rows, D) with the residual axis last, or (rows, 1) for a tensor without one."""
    if RES not in axes:
        return x.reshape(-1, 1)
    return x.movedim(axes.index(RES), -1).reshape(-1, x.shape[axes.index(RES)])


def _from_rows(rows: torch.Tensor, like: torch.Tensor, axes: tuple[AxisKind | None, ...]) -> torch.Tensor:
    if RES not in axes:
        return rows.reshape(like.shape)
    moved = like.movedim(axes.index(RES), -1)
    return rows.reshape(moved.shape).movedim(-1, axes.index(RES))


def lstsq_merge(states: Sequence[Mapping[str, torch.Tensor]], placements: Sequence[Placement],
                weights: Sequence[float] | None = None, anchor: Mapping[str, torch.Tensor] | None = None) -> State:
    """Least-squares coverage-weighted merge of wide canonical states.

    For a reader W: W* = (Σ n_i W_i P_i)(Σ n_i P_i)⁺ with P_i model i's projector in the universe basis
    (the residual's E Eᵀ times the 0/1 coverage of heads and units); writers are mirrored. At equal widths
    (every P_i = I) it is the weighted mean; with coordinate masks it is HeteroFL's count-weighted average.
    With an ``anchor`` (a state of the universe, e.g. the previous global model), what no model covers keeps its
    value: a round whose clients are all narrow leaves the rest of the model as it was, instead of zeroing it.
    """
    wide = placements[0].wide
    spec = get_arch(wide.family).spec
    n = torch.tensor([1.0] * len(states) if weights is None else list(weights), dtype=torch.float64)
    n = n / n.sum()
    device = next(iter(states[0].values())).device  # the placements' projectors join the states there
    res_projectors = [p.projector().to(device) for p in placements]
    scalar = [torch.ones(1, 1, dtype=torch.float64, device=device) for _ in placements]
    merged: State = {}
    for name, (layer, template) in expand(spec, wide.depth).items():
        if name not in states[0]:
            continue
        axes, like = spec[template], states[0][name]
        rows = [_as_rows(s[name].double(), axes) for s in states]
        masks = torch.stack([_row_mask(like.shape, axes, p, layer) for p in placements])
        projectors = res_projectors if RES in axes else scalar
        fill = _as_rows(anchor[name].to(device, torch.float64), axes) if anchor is not None else None
        merged[name] = _from_rows(_lstsq_rows(rows, masks, projectors, n, fill), like, axes).to(like.dtype)
    return merged
