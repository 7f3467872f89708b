"""What every matching method shares: gathering a group's tensors by axis kind, and the match result."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from glmc.core.spec import HEADS, QKV, AxisKind, K, Q, SpecTable, V, expand
from glmc.errors import ConfigError, NonFiniteError
from glmc.symmetry import groups
from glmc.symmetry.transforms import Transform

if TYPE_CHECKING:
    from torch.utils.data import Dataset


@dataclass
class MatchResult:
    """The transform that maps B towards A, with the objective after each sweep (lower is better)."""

    transform: Transform
    objective: list[float] = field(default_factory=list)
    seconds: float = 0.0
    info: dict[str, object] = field(default_factory=dict)


def kind_first(x: torch.Tensor, axes: tuple[AxisKind | None, ...], kind: AxisKind) -> torch.Tensor:
    """``x`` as an (n, m) matrix: its axis of ``kind`` first, the others flattened."""
    x = x.movedim(axes.index(kind), 0)
    return x.reshape(x.shape[0], -1)


def gather(
    state: Mapping[str, torch.Tensor], spec: SpecTable, depth: int, kind: AxisKind, layer: int | None = None,
) -> torch.Tensor:
    """Every tensor with an axis of ``kind`` (in ``layer``), that axis first, concatenated as (n_kind, m)."""
    blocks = []
    for name, (lay, template) in expand(spec, depth).items():
        axes = spec[template]
        if kind not in axes or name not in state or (layer is not None and lay != layer):
            continue
        blocks.append(kind_first(state[name], axes, kind))
    return torch.cat(blocks, dim=1)


def scatter(like: Mapping[str, torch.Tensor], spec: SpecTable, depth: int, kind: AxisKind, layer: int,
            x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inverse of :func:`gather`: ``x`` (n_kind, m) cut back into the tensors of ``like`` it is gathered from,
    each in its own shape and dtype."""
    out, start = {}, 0
    for name, (lay, template) in expand(spec, depth).items():
        axes = spec[template]
        if kind not in axes or name not in like or lay != layer:
            continue
        moved = like[name].movedim(axes.index(kind), 0)
        width = moved[0].numel()
        out[name] = x[:, start:start + width].reshape(moved.shape).movedim(0, axes.index(kind)).to(like[name].dtype)
        start += width
    return out


def head_factors(state: Mapping[str, torch.Tensor], spec: SpecTable, depth: int, layer: int, heads: int,
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(3, H, d_h, m) q|k|v factors [W | b] per query head (a KV head's k and v repeated for each query of its
    group), (H, d_h, d) output factors W_Oᵀ, and the number of KV heads, of one layer: fused (QKV) or separate
    (Q, K, V) projections alike."""
    out = gather(state, spec, depth, HEADS, layer)
    out = out.reshape(heads, -1, out.shape[1])
    if any(QKV in axes for template, axes in spec.items() if template.startswith("blocks.")):
        qkv = gather(state, spec, depth, QKV, layer)
        return qkv.reshape(3, heads, -1, qkv.shape[1]), out, heads
    q, k, v = (gather(state, spec, depth, kind, layer) for kind in (Q, K, V))
    head_dim = out.shape[1]
    kv = k.shape[0] // head_dim
    q = q.reshape(heads, head_dim, -1)
    k, v = (x.reshape(kv, head_dim, -1).repeat_interleave(heads // kv, 0) for x in (k, v))
    return torch.stack([q, k, v]), out, kv


def kv_factors(qkv: torch.Tensor, out: torch.Tensor, kv: int,
               ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Per KV head, the factors its within-head maps act on, from :func:`head_factors`' output: ((q, k), (v, o)),
    each (H_kv, d_h, ·); q is the group's queries side by side, which M moves (k takes M⁻ᵀ), o the group's output
    factors W_Oᵀ, which take N⁻ᵀ where v takes N."""
    first = torch.arange(0, qkv.shape[1], qkv.shape[1] // kv)  # a group's k and v, once
    return (_by_group(qkv[0], kv), qkv[1, first]), (qkv[2, first], _by_group(out, kv))


def put_head_factors(like: Mapping[str, torch.Tensor], spec: SpecTable, depth: int, layer: int,
                     qkv: torch.Tensor, out: torch.Tensor, kv: int) -> dict[str, torch.Tensor]:
    """The inverse of :func:`head_factors`: one layer's head tensors of ``like`` (names, shapes, dtypes) holding the
    (3, H, d_h, m) q|k|v factors [W | b] and (H, d_h, d) output factors W_Oᵀ (a KV head's k and v read from the
    first query head of its group)."""
    heads = scatter(like, spec, depth, HEADS, layer, out.reshape(-1, out.shape[-1]))
    if any(QKV in axes for template, axes in spec.items() if template.startswith("blocks.")):
        return heads | scatter(like, spec, depth, QKV, layer, qkv.reshape(-1, qkv.shape[-1]))
    first = torch.arange(0, qkv.shape[1], qkv.shape[1] // kv)
    parts = (qkv[0], qkv[1, first], qkv[2, first])
    return heads | {name: x for kind, part in zip((Q, K, V), parts, strict=True)
                    for name, x in scatter(like, spec, depth, kind, layer, part.reshape(-1, part.shape[-1])).items()}


def from_kv_factors(qk: tuple[torch.Tensor, torch.Tensor], vo: tuple[torch.Tensor, torch.Tensor],
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`kv_factors`: (3, H, d_h, m) q|k|v factors per query head and (H, d_h, d) output
    factors, from a KV head's ((q, k), (v, o)) with its group's queries and outputs side by side."""
    (q, k), (v, o) = qk, vo
    kv, m = k.shape[0], k.shape[-1]
    g = q.shape[-1] // m
    per_query = [_by_query(x, kv, g) for x in (q, o)]
    k, v = (x.repeat_interleave(g, 0) for x in (k, v))
    return torch.stack([per_query[0], k, v]), per_query[1]


def _by_query(x: torch.Tensor, kv: int, g: int) -> torch.Tensor:
    """(H_kv, d_h, G·m), a group's queries side by side → (H, d_h, m) per query head (inverse of :func:`_by_group`)."""
    return x.reshape(kv, x.shape[1], g, -1).permute(0, 2, 1, 3).reshape(kv * g, x.shape[1], -1)


def _by_group(x: torch.Tensor, kv: int) -> torch.Tensor:
    """(H, d_h, m) per query head → (H_kv, d_h, G·m): a group's queries side by side."""
    return x.reshape(kv, -1, *x.shape[1:]).permute(0, 2, 1, 3).reshape(kv, x.shape[1], -1)


def head_circuits(state: Mapping[str, torch.Tensor], spec: SpecTable, depth: int, layer: int, heads: int,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (H, m, m) QK circuits Q̃ᵀK̃ and (H, d, m) OV circuits O Ṽ, one per query head, over x̃ = [x; 1]
    (m = d + 1 with biases, else d; paper §3.2.2)."""
    f, out, _ = head_factors(state, spec, depth, layer, heads)
    return torch.einsum("hae,haf->hef", f[0], f[1]), torch.einsum("had,hae->hde", out, f[2])


def grouped_assignment(score: torch.Tensor, kv: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The KV heads' permutation and each group's query permutation maximising a (H, H) query-head score: an inner
    assignment for every pair of groups, an outer one on their totals (G = 1: one assignment, no groups)."""
    if kv == score.shape[0]:
        return groups.assignment(score), None
    g = score.shape[0] // kv
    blocks = score.reshape(kv, g, kv, g).permute(0, 2, 1, 3)  # (i, j, a, b): query a of A's group i, b of B's j
    inner = [[groups.assignment(blocks[i, j]) for j in range(kv)] for i in range(kv)]
    totals = torch.tensor([[float(blocks[i, j, torch.arange(g), inner[i][j]].sum()) for j in range(kv)]
                           for i in range(kv)], dtype=torch.float64)
    perm = groups.assignment(totals)
    return perm, torch.stack([inner[i][int(perm[i])] for i in range(kv)])


def matched_order(perm: torch.Tensor, group: torch.Tensor | None, heads: int) -> torch.Tensor:
    """For every query head of A, the query head of B assigned to it by a KV-head and in-group permutation."""
    g = heads // len(perm)
    return perm.repeat_interleave(g) * g + (torch.arange(heads) % g if group is None else group.reshape(-1))


def cross(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], spec: SpecTable, depth: int,
    kinds: tuple[AxisKind, ...], layer: int | None = None,
) -> torch.Tensor:
    """Σ_p X_A,p X_B,pᵀ over the tensors of ``kinds``, each with that axis first: (n, n), no concatenation, summed
    in place (an MLP's (f, f) sum would otherwise allocate and fault in a new matrix per tensor)."""
    total: torch.Tensor | None = None
    for name, (lay, template) in expand(spec, depth).items():
        axes = spec[template]
        for kind in kinds:
            if kind not in axes or name not in a or (layer is not None and lay != layer):
                continue
            xa, xb = kind_first(a[name], axes, kind), kind_first(b[name], axes, kind)
            total = xa @ xb.T if total is None else total.addmm_(xa, xb.T)
    if total is None:
        raise ValueError(f"no tensor has an axis of kind {kinds}")
    return total


def require_finite(state: Mapping[str, torch.Tensor], model: str) -> None:
    """NonFiniteError naming ``model``'s first tensor that holds NaN or inf (a diverged run, a bad cast), before a
    solver meets it as an SVD that does not converge."""
    for name, x in state.items():
        if bool(torch.isfinite(x.sum())):  # every entry finite (NaN and inf propagate); no tensor-size temporary
            continue
        bad = int((~torch.isfinite(x)).sum())
        if bad:
            raise NonFiniteError(f"model {model}: tensor {name!r} holds {bad} NaN or inf value(s) of {x.numel()}")


def sq_norm(x: torch.Tensor, chunk: int = 1 << 20) -> float:
    """‖x‖², squares of x's dtype summed in float64, over chunks of entries: no full-size temporary, which for a
    50,257-row vocabulary would be as large as the embedding itself."""
    flat = x.reshape(-1)
    return sum(float(torch.sum(flat[i:i + chunk].square(), dtype=torch.float64)) for i in range(0, len(flat), chunk))


def sq_difference(x: torch.Tensor, y: torch.Tensor, chunk: int = 1 << 20) -> float:
    """‖x − y‖², each chunk of entries widened to float64 before it is subtracted and squared: exact for any input
    dtype (a bfloat16 difference is not rounded first), and no temporary larger than a chunk."""
    fx, fy = x.reshape(-1), y.reshape(-1)
    return sum(float((fx[i:i + chunk].double() - fy[i:i + chunk]).square_().sum()) for i in range(0, len(fx), chunk))


def sq_distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """‖θ_A − θ_B‖² over every shared parameter."""
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in a))


def require_data(data: Dataset | None) -> Dataset:
    """The data a data-driven method reads, or a ConfigError saying it needs some."""
    if data is None:
        raise ConfigError("this method reads data: pass training samples (--data, --data-file or --generated)")
    return data
