"""Activation matching (Verma & Elbayad, "Merging Text Transformer Models", §3).

Run A and B on the same batch, take the Pearson correlation (Eq. 1) of their MLP hidden features, per-head
attention features and residual-stream features, and solve a linear assignment (Eq. 2) for each: the
residual permutation, each layer's MLP permutation, and each layer's heads in two stages (Eq. 5–6, Alg. 1).
Language models keep their residual stream as it is, as the paper does for masked language modelling (§5.3).
Hooks are placed through the arch's canonical module table: no architecture is named here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from glmc.archs import Arch, get_arch
from glmc.core.config import ModelConfig
from glmc.core.spec import HEADS, MLP_IN, block_linears, gated
from glmc.core.state import State
from glmc.device import device_of
from glmc.match.common import MatchResult, grouped_assignment, matched_order, require_data, sq_distance
from glmc.symmetry import groups
from glmc.symmetry.canonical import Form, to_model
from glmc.symmetry.transforms import Transform, apply

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from glmc.match.options import MatchOptions


log = logging.getLogger(__name__)

# Where each feature is read: the input of the layer that reads the MLP units (MLP hidden), the input of the one that
# reads the heads (concatenated heads, (H, d_h) head-major in timm and HF alike), the output of each block (residual).
RESIDUAL_SITE = "blocks.{l}"

Key = tuple[str, int]  # (feature kind, layer); the residual uses layer -1 (all layers stacked as rows)


class Moments:
    """Running sums over rows of two feature sets (n, p) and (n, q), enough for their (p, q) correlation (Eq. 1)."""

    def __init__(self) -> None:
        self.n = 0
        self.shift: tuple[torch.Tensor, torch.Tensor] | None = None  # first chunk's means, for stable sums
        self.sums: list[torch.Tensor] = []  # Σa, Σb, Σa², Σb², Σ a bᵀ (shifted)

    def update(self, xa: torch.Tensor, xb: torch.Tensor) -> None:
        """Add rows xa (n, p) and xb (n, q), in float64, shifted by the first chunk's means."""
        xa, xb = xa.double(), xb.double()
        if self.shift is None:
            self.shift = (xa.mean(0), xb.mean(0))
        xa, xb = xa - self.shift[0], xb - self.shift[1]
        terms = [xa.sum(0), xb.sum(0), (xa * xa).sum(0), (xb * xb).sum(0), xa.T @ xb]
        self.sums = terms if not self.sums else [s + t for s, t in zip(self.sums, terms, strict=True)]
        self.n += xa.shape[0]

    def correlation(self, eps: float = 1e-12) -> torch.Tensor:
        """corr(X_A, X_B) = E[(X_A − μ_A)ᵀ(X_B − μ_B)] / (σ_A σ_Bᵀ); a unit of zero variance correlates 0."""
        sa, sb, qa, qb, cross = (s / self.n for s in self.sums)
        std_a = (qa - sa * sa).clamp_min(0).sqrt().clamp_min(eps)
        std_b = (qb - sb * sb).clamp_min(0).sqrt().clamp_min(eps)
        return (cross - sa[:, None] * sb[None, :]) / (std_a[:, None] * std_b[None, :])


def _rows(x: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Every token position as a row: (..., units) → (rows, units); a block's tuple output gives element 0."""
    x = x[0] if isinstance(x, tuple) else x
    return x.detach().reshape(-1, x.shape[-1])


def _hooks(arch: Arch, model: nn.Module, depth: int, store: dict[Key, torch.Tensor]) -> list[RemovableHandle]:
    """Forward hooks writing each layer's MLP, head and residual features into ``store``."""
    def save_input(key: Key) -> Callable[..., None]:
        return lambda module, args: store.__setitem__(key, _rows(args[0]))

    def save_output(key: Key) -> Callable[..., None]:
        return lambda module, args, out: store.__setitem__(key, _rows(out))

    handles = []
    (mlp_site,), (heads_site,) = block_linears(arch.spec, inputs=(MLP_IN,)), block_linears(arch.spec, inputs=(HEADS,))
    for layer in range(depth):
        handles += [
            arch.module(model, mlp_site, layer).register_forward_pre_hook(save_input(("mlp", layer))),
            arch.module(model, heads_site, layer).register_forward_pre_hook(save_input(("heads", layer))),
            arch.module(model, RESIDUAL_SITE, layer).register_forward_hook(save_output(("residual", layer))),
        ]
    return handles


def _features(arch: Arch, model: nn.Module, depth: int, x: torch.Tensor) -> dict[Key, torch.Tensor]:
    """One forward pass of ``model`` on ``x``, returning its hooked features (rows, units)."""
    store: dict[Key, torch.Tensor] = {}
    handles = _hooks(arch, model, depth, store)
    try:
        with torch.no_grad():
            arch.logits(model, x)
    finally:
        for handle in handles:
            handle.remove()
    return store


def correlations(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], cfg: ModelConfig,
                 batch: torch.Tensor, *, batch_size: int = 64, form: Form = "standard") -> dict[Key, torch.Tensor]:
    """Pearson correlations of A's and B's features over ``batch``, chunk by chunk (bounded memory).

    Keys: ("mlp", l) (f, f); ("heads", l) (H·d_h, H·d_h); ("residual", -1) (d, d) over every block's output.
    """
    arch = get_arch(cfg.family)
    get_arch(cfg.family).check_inputs(cfg, batch)
    models = to_model(a, cfg, form), to_model(b, cfg, form)
    dtype = next(iter(a.values())).dtype
    moments: dict[Key, Moments] = {}
    device = device_of(a)
    for chunk in torch.split(batch, batch_size):
        x = chunk.to(device, dtype) if chunk.is_floating_point() else chunk.to(device)
        fa, fb = (_features(arch, m, cfg.depth, x) for m in models)
        for kind, layer in fa:
            key = (kind, -1) if kind == "residual" else (kind, layer)
            moments.setdefault(key, Moments()).update(fa[kind, layer], fb[kind, layer])
    return {key: m.correlation().cpu() for key, m in moments.items()}  # small; their assignments run on the CPU


def _permutation_matrix(perm: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """P with P[i, perm[i]] = 1, so x → P x puts old unit perm[i] at position i."""
    return torch.eye(len(perm), dtype=dtype)[perm]


def _matched(corr: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """corr[i, perm[i]] for every row i."""
    return corr[torch.arange(len(perm)), perm]


def solve_heads(corr: torch.Tensor, heads: int, kv: int | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Two-stage head LAP (Eq. 5–6, Alg. 1) on a (H·d_h, H·d_h) correlation of the query heads' outputs.

    With grouped queries (``kv`` KV heads below ``heads``) a KV head moves with its group: the outer assignment is
    over KV heads, on the totals of in-group query assignments, and each KV head's dimensions get one permutation,
    its v being shared by the group, solved on the group's matched correlations summed. Returns the KV-head
    permutation (H_kv,), the in-group query permutation (H_kv, G) or None, each KV head's dimension permutation
    (H_kv, d_h) and the matched correlations (H, d_h).
    """
    kv = kv or heads
    d_h, g = corr.shape[0] // heads, heads // kv
    blocks = corr.reshape(heads, d_h, heads, d_h).transpose(1, 2)  # (H_A, H_B, d_h, d_h)
    inner = [[groups.assignment(blocks[i, j]) for j in range(heads)] for i in range(heads)]
    score = torch.tensor([[float(_matched(blocks[i, j], inner[i][j]).sum()) for j in range(heads)]
                          for i in range(heads)])
    perm, group = grouped_assignment(score, kv)
    order = matched_order(perm, group, heads)
    shared = torch.stack([inner[k][int(order[k])] if g == 1 else groups.assignment(
        torch.stack([blocks[i, int(order[i])] for i in range(k * g, (k + 1) * g)]).sum(0)) for k in range(kv)])
    values = torch.stack([_matched(blocks[i, int(order[i])], shared[i // g]) for i in range(heads)])
    return perm, group, shared, values


def signed_units(corr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The units' permutation maximising Σ |corr[i, p(i)]| and each pair's sign: a gated unit whose up row and down
    column flip together negates its feature, so a pair correlated at −1 computes the same feature."""
    perm = groups.assignment(corr.abs())
    return perm, torch.where(_matched(corr, perm) < 0, -1.0, 1.0)


def _solve(corr: Mapping[Key, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype, residual: bool,
           signs: bool = False) -> tuple[Transform, dict[str, float]]:
    """Every LAP from the correlations: the residual permutation (if ``residual``), MLP permutations (with the
    units' signs if ``signs``), heads with within-head maps."""
    t = Transform(cfg.depth)
    res = torch.arange(cfg.width)
    if residual:
        res = groups.assignment(corr["residual", -1])
        t.residual = _permutation_matrix(res, dtype)
    mlp, head = [], []
    for layer in range(cfg.depth):
        perm, sign = signed_units(corr["mlp", layer]) if signs else (groups.assignment(corr["mlp", layer]), None)
        t.mlp[layer], t.mlp_scale[layer] = perm, None if sign is None else sign.to(dtype)
        mlp.append(_matched(corr["mlp", layer], perm) * (1.0 if sign is None else sign))
        t.heads[layer], t.group[layer], inner, values = solve_heads(corr["heads", layer], cfg.heads, cfg.kv_heads)
        t.ov[layer] = torch.stack([_permutation_matrix(p, dtype) for p in inner])
        head.append(values.flatten())
    info = {"corr_residual": float(_matched(corr["residual", -1], res).mean()),
            "corr_mlp": float(torch.cat(mlp).mean()), "corr_heads": float(torch.cat(head).mean())}
    return t, info


def activation_match(a: State, b: State, cfg: ModelConfig, batch: torch.Tensor, *, batch_size: int = 64,
                     residual: bool | None = None, form: Form = "standard", signs: bool = False) -> MatchResult:
    """Find T with T(θ_B) ≡ θ_B as a function and its features correlated with A's (Verma & Elbayad §3).

    ``a``, ``b``: canonical states of ``cfg`` in ``form``; ``batch``: model input (images or token ids);
    ``residual``: permute the residual stream too (default: the family's ``activation_residual``); ``signs``: a
    gated MLP's units matched with their signs (the orthogonal part of their scale, which the whole group holds).
    The objective is ‖θ_A − T(θ_B)‖², comparable with weight matching; ``info`` holds mean matched correlations.
    """
    start = time.perf_counter()
    corr = correlations(a, b, cfg, batch, batch_size=batch_size, form=form)
    dtype = next(iter(b.values())).dtype
    residual = get_arch(cfg.family).activation_residual if residual is None else residual
    t, info = _solve(corr, cfg, dtype, residual, signs and gated(get_arch(cfg.family).spec))
    objective = sq_distance(a, apply(b, get_arch(cfg.family).spec, t, cfg.heads))
    log.info("activation matching: ‖A − T(B)‖² = %.6g, correlations %s", objective, info)
    return MatchResult(t, [objective], time.perf_counter() - start, dict(info))


# The registry's entry points (glmc.match.registry): canonical states a, b of cfg, the training data, MatchOptions.
def pairwise(a: State, b: State, cfg: ModelConfig, data: Dataset | None, options: MatchOptions) -> MatchResult:
    """Activation matching on the first ``options.activation.batch`` inputs of ``data``; a gated MLP's unit signs
    searched where the whole group is."""
    from glmc.data.tasks import inputs_of

    return activation_match(a, b, cfg, inputs_of(require_data(data), options.activation.batch), form=options.form,
                            signs=options.symmetry.group == "whole")
