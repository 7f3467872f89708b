"""Symmetry specs as data: each canonical parameter template maps to the group acting on each axis.

Canonical names are shared by the families (``blocks.{l}.attn.proj.w`` …) and declared by each in
:mod:`glmc.archs`; linear weights are stored (out, in). The algorithms find a tensor by its axis kinds, never by
its name. Axis kinds:

- ``RES``: the residual stream, x → Q x (orthogonal, so readers and writers transform alike);
- ``QKV``: the fused q|k|v rows, factorised (3, H, d_h): head permutation, then M on q, M⁻ᵀ on k, N on v;
- ``Q``, ``K``, ``V``: separate q, k, v rows. K and V are factorised (H_kv, d_h): the KV heads' permutation, then
  M⁻ᵀ on k and N on v; Q is (H_kv, G, d_h) for G = H / H_kv query heads per KV head (grouped-query attention):
  the KV heads' permutation, the queries' permutation within each group, then the group's M on each of them;
- ``HEADS``: the concatenated head outputs read by ``proj``, factorised (H_kv, G, d_h) like Q: permutations, then
  the group's N⁻ᵀ (G = 1 without grouped queries);
- ``MLP``: hidden units produced by fc1 (SwiGLU's ``up``): permutation, then the per-unit scale s (ReLU or gated);
- ``MLP_GATE``: hidden units produced by a gated MLP's ``gate``: the same permutation, no scale;
- ``MLP_IN``: hidden units read by fc2 (permutation, then 1/s);
- ``NORM``: a LayerNorm or RMSNorm gain; must be folded (all ones) before the residual stream moves.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Literal

import torch

from glmc.errors import SpecError

AxisKind = Literal["RES", "QKV", "Q", "K", "V", "HEADS", "MLP", "MLP_GATE", "MLP_IN", "NORM"]
Axes = tuple[AxisKind | None, ...]
SpecTable = Mapping[str, Axes]

RES: AxisKind = "RES"
QKV: AxisKind = "QKV"
Q: AxisKind = "Q"
K: AxisKind = "K"
V: AxisKind = "V"
HEADS: AxisKind = "HEADS"
MLP: AxisKind = "MLP"
MLP_GATE: AxisKind = "MLP_GATE"
MLP_IN: AxisKind = "MLP_IN"
NORM: AxisKind = "NORM"

def gated(spec: SpecTable) -> bool:
    """Whether the spec's MLP is gated (SwiGLU): its units' up rows and down columns may then flip sign together."""
    return any(MLP_GATE in axes for axes in spec.values())


def block_linears(spec: SpecTable, outputs: Collection[AxisKind] | None = None,
                  inputs: Collection[AxisKind] | None = None) -> tuple[str, ...]:
    """A block's linear layers as canonical prefixes, in the spec's order, which is forward order; only those whose
    output (input) axis is of the kinds ``outputs`` (``inputs``), where given."""
    return tuple(t[:-2] for t, axes in spec.items() if t.startswith("blocks.{l}.") and t.endswith(".w")
                 and len(axes) == 2 and (outputs is None or axes[0] in outputs)
                 and (inputs is None or axes[1] in inputs))


def expand(templates: Mapping[str, object], depth: int) -> Mapping[str, tuple[int | None, str]]:
    """Concrete name → (layer or None, template) for every template, with ``{l}`` over the layers."""
    return _expand(tuple(templates), depth)


@functools.lru_cache(maxsize=64)
def _expand(templates: tuple[str, ...], depth: int) -> Mapping[str, tuple[int | None, str]]:
    """Cached: weight matching expands the same spec hundreds of times per pair (read-only view)."""
    out: dict[str, tuple[int | None, str]] = {}
    for template in templates:
        if "{l}" in template:
            for layer in range(depth):
                out[template.format(l=layer)] = (layer, template)
        else:
            out[template] = (None, template)
    return MappingProxyType(out)


def check_coverage(spec: SpecTable, state: Mapping[str, torch.Tensor], depth: int,
                   optional: Collection[str] = ()) -> None:
    """Raise SpecError naming the first key the spec does not describe, or the first it misses (templates in
    ``optional`` may be missing: parameters some variants of the family go without)."""
    names = expand(spec, depth)
    for key in state:
        if key not in names:
            raise SpecError(f"parameter {key!r} is not covered by the symmetry spec")
    for key, (_, template) in names.items():
        if key not in state and template in optional:
            continue
        if key not in state:
            raise SpecError(f"parameter {key!r} is missing from the state dict")
        if state[key].dim() != len(spec[template]):
            raise SpecError(f"parameter {key!r} has {state[key].dim()} axes, spec says {len(spec[template])}")


def check_same_shapes(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    """Two models can be aligned only if every parameter matches in name and shape; name the first that does not."""
    for key in a:
        if key not in b:
            raise SpecError(f"parameter {key!r} is in the first model only")
        if a[key].shape != b[key].shape:
            raise SpecError(f"parameter {key!r} has shape {tuple(a[key].shape)} vs {tuple(b[key].shape)}")
    for key in b:
        if key not in a:
            raise SpecError(f"parameter {key!r} is in the second model only")
