"""Canonical forms: LayerNorm folding (standard), the rmsnorm form and the circuit form.

``standard``: every LayerNorm gain, and every bias its reader can absorb, is folded into the next linear
layer; the model stays a standard timm / HF model. ``rmsnorm``: writers are also centred, so LayerNorm
equals RMSNorm and the residual group grows to the full O(d). ``circuit``: every head is multiplied out
into its QK and OV circuits, so interpolating weights interpolates circuits (paper §3.2.2).
``circuit-rmsnorm``: both, as the official GLMC code interpolates. All but the first change the architecture
and are for offline merging only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, get_args

import torch
from torch import nn

from glmc.archs import Arch, get_arch
from glmc.core.config import ModelConfig
from glmc.core.spec import HEADS, QKV, RES, block_linears, expand
from glmc.core.state import HALF, Lazy, State, cast
from glmc.errors import CheckpointError, ConfigError, NonFiniteError
from glmc.symmetry import groups

Form = Literal["standard", "rmsnorm", "circuit", "circuit-rmsnorm"]
FORMS: tuple[Form, ...] = get_args(Form)
# What each form changes, as data: the stream centred with LayerNorm run as RMSNorm, and heads as circuits.
CENTRED: frozenset[Form] = frozenset({"rmsnorm", "circuit-rmsnorm"})
CIRCUITS: frozenset[Form] = frozenset({"circuit", "circuit-rmsnorm"})


def forms_for(arch: Arch) -> tuple[Form, ...]:
    """The forms a family has: the centred ones for a pre-LayerNorm stream (an RMSNorm stream needs no centring; a
    post-LayerNorm family's norms cannot fold), the circuit ones where q|k|v are fused in thirds (the circuit layout;
    separate projections, which the rotary families have, have none): all four for ViT and GPT-2, standard and
    rmsnorm for GPT-NeoX, standard alone for the Llama families and BERT."""
    centred, circuits = arch.norm == "layer", any(QKV in axes for axes in arch.spec.values())
    return tuple(f for f in FORMS if (centred or f not in CENTRED) and (circuits or f not in CIRCUITS))


def residual_group(form: Form, arch: Arch) -> groups.ResidualGroup:
    """The residual maps of ``form``: those fixing 1 for a pre-LayerNorm stream not centred; all of O(d) for a centred
    one, as an RMSNorm family has in its standard form (a circuit form is aligned as its form without circuits); the
    permutations for a post-LayerNorm family (:data:`glmc.symmetry.groups.ResidualGroup`)."""
    if arch.norm == "post":
        return "permutation"
    return "fix-ones" if arch.norm == "layer" and form not in CENTRED else "orthogonal"


def fixes_ones(form: Form, arch: Arch) -> bool:
    """Whether the residual maps of ``form`` must fix 1 (:func:`residual_group` is ``fix-ones``)."""
    return residual_group(form, arch) == "fix-ones"


def fold_scales(arch: Arch, state: Mapping[str, torch.Tensor], depth: int) -> State:
    """A LayerScale γ ⊙ (W y + c) on a writer becomes (diag γ W) y + γ ⊙ c, with γ → 1 (timm's ``init_values``)."""
    out = dict(state)
    for scale, (layer, template) in expand(arch.scales, depth).items():
        if f"{scale}.g" not in out:
            continue
        gamma, writer = out[f"{scale}.g"], arch.scales[template].format(l=layer)
        out[f"{writer}.w"] = gamma[:, None] * out[f"{writer}.w"]
        out[f"{writer}.b"] = gamma * out[f"{writer}.b"]
        out[f"{scale}.g"] = torch.ones_like(gamma)
    return out


def fold_layernorms(arch: Arch, state: Mapping[str, torch.Tensor], depth: int) -> State:
    """LN(x) = γ⊙n(x) + β read by W y + c becomes (W diag γ) n(x) + (W β + c), with γ → 1 and β → 0."""
    out = dict(state)
    for norm, (layer, template) in expand(arch.folds, depth).items():
        if f"{norm}.w" not in out:  # a norm this variant does not have (a ViT pooling before its fc_norm)
            continue
        gamma, beta = out[f"{norm}.w"], out.get(f"{norm}.b")  # an RMSNorm has no bias
        readers = [r.format(l=layer) for r in arch.folds[template]]
        absorbs_bias = all(f"{r}.b" in out for r in readers)
        for r in readers:
            w = out[f"{r}.w"]
            if absorbs_bias and beta is not None:
                out[f"{r}.b"] = out[f"{r}.b"] + w @ beta
            out[f"{r}.w"] = w * gamma
        out[f"{norm}.w"] = torch.ones_like(gamma)
        if beta is None:
            continue
        # A reader without a bias (GPT-2's lm_head) leaves β in the norm, rescaled so W diag γ (n + β/γ) = W(γn + β).
        out[f"{norm}.b"] = torch.zeros_like(beta) if absorbs_bias else _over_gain(beta, gamma, norm)
    return out


def _over_gain(beta: torch.Tensor, gamma: torch.Tensor, norm: str) -> torch.Tensor:
    """β/γ, refused where γ is 0: there the norm's bias reaches a bias-free reader as a constant that no folded
    (γ → 1) form can hold, and dividing would put inf or NaN into the model."""
    zeros = int((gamma == 0).sum())
    if zeros and bool((beta[gamma == 0] != 0).any()):
        raise NonFiniteError(f"{norm}: {zeros} LayerNorm gain(s) are exactly 0 where a bias-free reader follows; "
                             "its bias there cannot be folded into a standard form")
    return torch.where(gamma == 0, torch.zeros_like(beta), beta / torch.where(gamma == 0, 1, gamma))


def _centre(x: torch.Tensor, axis: int) -> torch.Tensor:
    return x - x.mean(dim=axis, keepdim=True)


def centre_writers(arch: Arch, state: Mapping[str, torch.Tensor], depth: int) -> State:
    """Apply M = I − 11ᵀ/d to everything written into the stream, so the stream has zero mean (paper §3.2.3)."""
    out = dict(state)
    prefixes = tuple(w.format(l=layer) for w in arch.writers for layer in range(depth))
    for name, (_, template) in expand(arch.spec, depth).items():
        if name in out and name.startswith(prefixes):
            out[name] = _centre(out[name], arch.spec[template].index(RES))
    return out


def canonicalize(
    arch: Arch, native: Mapping[str, torch.Tensor], cfg: ModelConfig, form: Form = "standard",
    dtype: torch.dtype | None = None,
) -> State:
    """Native state dict → canonical names, LayerNorms folded; for ``rmsnorm``, writers centred and gains dropped.

    The circuit form changes d_h, so it has its own entry point, :func:`to_circuit`, applied after alignment.
    """
    if form not in (forms := forms_for(arch)):
        why = ("its norms sit on the stream and cannot fold" if arch.norm == "post" else
               "an RMSNorm stream has the whole O(d) without centring, and circuits need q|k|v fused in thirds")
        raise ConfigError(f"a {arch.family} model has only the {' and '.join(forms)} form{'s' * (len(forms) > 1)} "
                          f"(form {form!r}): {why}")
    depth = cfg.depth
    state = arch.to_canonical(native, cfg)
    if dtype is not None:
        state = cast(state, dtype)
    state = fold_layernorms(arch, fold_scales(arch, state, depth), depth)
    if form in CENTRED:
        state = centre_writers(arch, state, depth)
        state = {k: v for k, v in state.items() if not _is_norm_gain(arch, k, depth)}
    return state


def _exact_in(wide: torch.dtype | None, stored: torch.dtype) -> bool:
    """Whether ``wide`` (None: ``stored`` itself) holds every value of ``stored`` exactly."""
    return wide is None or wide == stored or wide == torch.float64 or (wide == torch.float32 and stored in HALF)


class _Folds:
    """Where each canonical tensor's value comes from once norms and LayerScales are folded (:func:`fold_scales`,
    then :func:`fold_layernorms`), as names: read per tensor by :func:`canonical_view`."""

    def __init__(self, arch: Arch, names: set[str], depth: int) -> None:
        self.scale_of: dict[str, str] = {}  # a scaled writer's .w / .b -> its LayerScale's .g
        for scale, (layer, template) in expand(arch.scales, depth).items():
            if f"{scale}.g" in names:
                writer = arch.scales[template].format(l=layer)
                self.scale_of |= {f"{writer}.w": f"{scale}.g", f"{writer}.b": f"{scale}.g"}
        self.norm_of: dict[str, str] = {}  # a reader's .w (and its .b where the readers absorb β) -> the norm
        self.readers: dict[str, tuple[list[str], bool]] = {}  # norm -> (its readers, whether they absorb β)
        for norm, (layer, template) in expand(arch.folds, depth).items():
            if f"{norm}.w" not in names:
                continue
            readers = [r.format(l=layer) for r in arch.folds[template]]
            absorbs = all(f"{r}.b" in names for r in readers)
            self.readers[norm] = readers, absorbs
            for r in readers:
                self.norm_of[f"{r}.w"] = norm
                if absorbs and f"{norm}.b" in names:
                    self.norm_of[f"{r}.b"] = norm
        self.gains = {f"{norm}.w" for norm in self.readers} | set(self.scale_of.values())
        self.scales = set(self.scale_of.values())  # the LayerScales' own gains, folded to ones
        self.shifts = {f"{norm}.b": norm for norm in self.readers if f"{norm}.b" in names}

    def touches(self, name: str) -> bool:
        return name in self.scale_of or name in self.norm_of or name in self.gains or name in self.shifts


def canonical_view(arch: Arch, native: Mapping[str, torch.Tensor], cfg: ModelConfig, form: Form = "standard",
                   dtype: torch.dtype | None = None) -> State | Lazy:
    """:func:`canonicalize`, made one tensor at a time on each read from ``native`` (:class:`Lazy`): renamed, cast to
    ``dtype``, and folded with the same operations in the same order, so each tensor is bit for bit the one
    :func:`canonicalize` holds, and neither a wider copy of the model nor its folded readers are ever held whole.
    A search in another dtype reads a tensor no fold touches straight from ``native`` where that is exact. The
    centred forms, which centre every writer, are made whole by :func:`canonicalize`."""
    if form in CENTRED or form not in forms_for(arch):
        return canonicalize(arch, native, cfg, form, dtype)
    sources = arch.canonical_sources(native, cfg)
    folds = _Folds(arch, set(sources), cfg.depth)

    def read(name: str) -> torch.Tensor:
        value = arch.canonical_tensor(native, name, sources[name], cfg)
        return value if dtype is None else value.detach().to(dtype)

    def scaled(name: str) -> torch.Tensor:  # fold_scales: γ ⊙ (W y + c)
        value = read(name)
        if name in folds.scales:
            return torch.ones_like(value)
        if name not in folds.scale_of:
            return value
        gamma = read(folds.scale_of[name])
        return gamma[:, None] * value if name.endswith(".w") else gamma * value

    def make(name: str) -> torch.Tensor:  # fold_layernorms: W y + c reading γ⊙n(x) + β
        if name in folds.gains:
            return torch.ones_like(scaled(name))
        if name in folds.shifts:
            norm = folds.shifts[name]
            beta = scaled(name)
            if folds.readers[norm][1]:
                return torch.zeros_like(beta)
            return _over_gain(beta, scaled(f"{norm}.w"), norm)
        value = scaled(name)
        read_from = folds.norm_of.get(name)
        if read_from is None:
            return value
        if name.endswith(".w"):
            return value * scaled(f"{read_from}.w")
        weight = scaled(name.removesuffix(".b") + ".w")
        return value + weight @ scaled(f"{read_from}.b")

    def search(name: str, into: torch.dtype) -> torch.Tensor:
        if not folds.touches(name):
            stored = arch.canonical_tensor(native, name, sources[name], cfg)
            if _exact_in(dtype, stored.dtype):  # widening first changes nothing: read it as stored
                return stored.detach().to(into)
        elif name.endswith(".w") and name in folds.norm_of and name not in folds.scale_of:
            # W diag γ: a product of two float32 values is exact in float64, so rounding it to float32 once is the
            # float32 product; no float64 copy of a vocabulary-sized head is made for the search
            weight = arch.canonical_tensor(native, name, sources[name], cfg)
            gain_name = f"{folds.norm_of[name]}.w"
            gain = arch.canonical_tensor(native, gain_name, sources[gain_name], cfg)
            if into == torch.float32 and dtype in (torch.float64, torch.float32) and {weight.dtype, gain.dtype} <= {
                    torch.float32, *HALF}:
                return weight.detach().to(into, copy=True).mul_(gain.detach().to(into))  # one vocabulary made
        return make(name).to(into)

    return Lazy(sources, make, search)


def _is_norm_gain(arch: Arch, name: str, depth: int) -> bool:
    return any(name == f"{norm}.w" for norm in expand(arch.folds, depth))


def _circuit_layer(qkv_w: torch.Tensor, qkv_b: torch.Tensor, proj_w: torch.Tensor, heads: int,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's heads as circuits over x̃ = [x; 1]: q' = √(e/d_h)·QKᵀ x̃, k' = v' = x̃, W_O' = OV (e = d+1)."""
    d = qkv_w.shape[1]
    e = d + 1
    factors = torch.cat([qkv_w, qkv_b[:, None]], 1).reshape(3, heads, -1, e)  # [W | b] per q/k/v head
    scale = (e / factors.shape[2]) ** 0.5  # keeps 1/√d_h of the original attention under 1/√e
    qk = torch.einsum("hae,haf->hfe", factors[0], factors[1]) * scale  # (H, e, e): rows are q' units
    ident = torch.eye(e, dtype=qkv_w.dtype).expand(heads, e, e)
    new = torch.stack([qk, ident, ident])  # (3, H, e, e) acting on x̃
    ov = torch.einsum("dha,hae->dhe", proj_w.reshape(d, heads, -1), factors[2])  # (d, H, e)
    return new[..., :d].reshape(-1, d), new[..., d].reshape(-1), ov.reshape(d, -1)


def to_circuit(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> tuple[State, ModelConfig]:
    """Standard canonical state → circuit form, with the config whose heads have size d+1."""
    spec = get_arch(cfg.family).spec
    (qkv,), (proj,) = block_linears(spec, outputs=(QKV,)), block_linears(spec, inputs=(HEADS,))
    out = dict(state)
    for layer in range(cfg.depth):
        q, p = qkv.format(l=layer), proj.format(l=layer)
        w = state[f"{q}.w"]
        bias = state.get(f"{q}.b", w.new_zeros(w.shape[0]))  # a variant without qkv biases: zeros
        out[f"{q}.w"], out[f"{q}.b"], out[f"{p}.w"] = _circuit_layer(w, bias, state[f"{p}.w"], cfg.heads)
    return out, cfg.replace(head_dim=cfg.width + 1, qkv_bias=True)


class RMSNormBias(nn.Module):
    """x / rms(x) + b: a LayerNorm on a zero-mean stream, with its gain folded away (rmsnorm form)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) + self.bias


def _swap_layernorms(model: nn.Module) -> None:
    """Replace every LayerNorm by an RMSNormBias of the same width and eps."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.LayerNorm):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, RMSNormBias(module.normalized_shape[0], module.eps))


def empty_model(cfg: ModelConfig, form: Form, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A runnable model of ``form``'s architecture (a centred form's LayerNorms as :class:`RMSNormBias`) in ``dtype``
    on ``device``, holding its initialisation until a canonical state is loaded (:func:`load_canonical`)."""
    model = get_arch(cfg.family).build(cfg)
    if form in CENTRED:
        _swap_layernorms(model)
    return model.to(device, dtype).eval()


def load_canonical(model: nn.Module, state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Copy canonical ``state`` into ``model`` one native tensor at a time, every name and shape checked as
    ``load_state_dict(strict=True)`` checks them: a :class:`Lazy` state (a point of a path between lazy models) is
    made tensor by tensor into the model's own parameters and never held whole."""
    native, targets = get_arch(cfg.family).native_view(state, cfg), model.state_dict()
    if set(native) != set(targets):
        missing, unexpected = sorted(set(targets) - set(native)), sorted(set(native) - set(targets))
        raise CheckpointError(f"a {cfg.family} model's state does not fit it: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    with torch.no_grad():
        for key in native:
            value = native[key]
            if value.shape != targets[key].shape:
                raise CheckpointError(f"{key}: shape {tuple(value.shape)} where the model has "
                                      f"{tuple(targets[key].shape)}")
            targets[key].copy_(value)


def to_model(state: Mapping[str, torch.Tensor], cfg: ModelConfig, form: Form = "standard") -> nn.Module:
    """A runnable model holding a canonical state, in the state's dtype and on its device."""
    first = next(iter(state.values()))
    model = empty_model(cfg, form, first.device, first.dtype)
    load_canonical(model, state, cfg)
    return model
