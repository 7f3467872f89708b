"""Data-free repair of a merge's variance collapse: give every unit of the merged model back its inputs' norm.

Averaging units that are only approximately aligned cancels their misaligned parts, so the merged units are
shorter than any input's: pre-activations and attention logits shrink, the "variance collapse" that REPAIR
(Jordan et al., 2022) measures in activations and mends with data. Here the weights alone are used: each
merged unit is rescaled so that its norm is the weighted mean of the inputs' norms of that unit. The units are
the MLP neurons, read by fc1's rows [w | b] and written by fc2's columns, and the heads, whose QK and OV
circuits over x̃ = [x; 1] set the q rows and the proj columns. An input that does not hold a unit (a narrower
model embedded in the universe, whose unit is zero) is left out of that unit's mean.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from glmc.archs import ModelConfig, State

# A unit family: the merged state and one layer → a (units,) norm per unit, and the rescaling by (units,) factors.
Norms = Callable[[Mapping[str, torch.Tensor], int, ModelConfig], torch.Tensor]
Scale = Callable[[State, int, ModelConfig, torch.Tensor], None]


def _augmented(state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """[W | b] of a linear layer (out, in + 1); b is zero for a layer without one (a ViT without qkv biases)."""
    w = state[f"{name}.w"]
    return torch.cat([w, state.get(f"{name}.b", w.new_zeros(w.shape[0]))[:, None]], 1)


def _heads(state: Mapping[str, torch.Tensor], layer: int, cfg: ModelConfig) -> torch.Tensor:
    """(3, H, d_h, d + 1): the q, k and v factors of every head, bias column last."""
    return _augmented(state, f"blocks.{layer}.attn.qkv").reshape(3, cfg.heads, -1, cfg.width + 1)


def _mlp_in_norms(state: Mapping[str, torch.Tensor], layer: int, cfg: ModelConfig) -> torch.Tensor:
    return _augmented(state, f"blocks.{layer}.mlp.fc1").norm(dim=1)


def _mlp_out_norms(state: Mapping[str, torch.Tensor], layer: int, cfg: ModelConfig) -> torch.Tensor:
    return state[f"blocks.{layer}.mlp.fc2.w"].norm(dim=0)


def _qk_norms(state: Mapping[str, torch.Tensor], layer: int, cfg: ModelConfig) -> torch.Tensor:
    f = _heads(state, layer, cfg)
    return torch.einsum("hae,haf->hef", f[0], f[1]).flatten(1).norm(dim=1)


def _ov_norms(state: Mapping[str, torch.Tensor], layer: int, cfg: ModelConfig) -> torch.Tensor:
    proj = state[f"blocks.{layer}.attn.proj.w"].reshape(cfg.width, cfg.heads, -1)
    return torch.einsum("dha,hae->hde", proj, _heads(state, layer, cfg)[2]).flatten(1).norm(dim=1)


def _scale_rows(state: State, name: str, factor: torch.Tensor) -> None:
    """Scale each output row of linear layer ``name``, weight and bias alike."""
    state[f"{name}.w"] = state[f"{name}.w"] * factor[:, None]
    if f"{name}.b" in state:
        state[f"{name}.b"] = state[f"{name}.b"] * factor


def _scale_mlp_in(state: State, layer: int, cfg: ModelConfig, s: torch.Tensor) -> None:
    _scale_rows(state, f"blocks.{layer}.mlp.fc1", s)


def _scale_mlp_out(state: State, layer: int, cfg: ModelConfig, s: torch.Tensor) -> None:
    name = f"blocks.{layer}.mlp.fc2.w"
    state[name] = state[name] * s[None, :]


def _scale_q(state: State, layer: int, cfg: ModelConfig, s: torch.Tensor) -> None:
    """Scale head h's q rows (the first third of qkv, head by head) by s[h]; k and v stay."""
    q = s.repeat_interleave(state[f"blocks.{layer}.attn.qkv.w"].shape[0] // (3 * cfg.heads))
    ones = torch.ones(2 * q.numel(), dtype=s.dtype, device=s.device)
    _scale_rows(state, f"blocks.{layer}.attn.qkv", torch.cat([q, ones]))


def _scale_proj(state: State, layer: int, cfg: ModelConfig, s: torch.Tensor) -> None:
    name = f"blocks.{layer}.attn.proj.w"
    w = state[name].reshape(cfg.width, cfg.heads, -1)
    state[name] = (w * s[None, :, None]).reshape(cfg.width, -1)


UNITS: tuple[tuple[Norms, Scale], ...] = (
    (_mlp_in_norms, _scale_mlp_in),
    (_mlp_out_norms, _scale_mlp_out),
    (_qk_norms, _scale_q),
    (_ov_norms, _scale_proj),
)


def target_norms(inputs: Sequence[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """Per unit, the weighted mean of the inputs' norms over the inputs that hold the unit (norm > 0)."""
    norms = torch.stack(list(inputs))  # (N, units)
    held = (norms > 0).to(norms.dtype) * weights.to(norms.device)[:, None]
    return (held * norms).sum(0) / held.sum(0).clamp_min(torch.finfo(norms.dtype).tiny)


def restore_norms(merged: Mapping[str, torch.Tensor], inputs: Sequence[Mapping[str, torch.Tensor]],
                  cfg: ModelConfig, weights: Sequence[float] | None = None) -> State:
    """``merged`` with every MLP neuron and head rescaled to the weighted mean norm of that unit in ``inputs``
    (canonical states in the merged model's basis and width, e.g. universe matching's aligned models)."""
    n = torch.tensor([1.0] * len(inputs) if weights is None else list(weights), dtype=torch.float64)
    out = dict(merged)
    for layer in range(cfg.depth):
        for norms, scale in UNITS:
            have = norms(out, layer, cfg)
            want = target_norms([norms(s, layer, cfg) for s in inputs], n).to(have.dtype)
            scale(out, layer, cfg, torch.where(have > 0, want / have.clamp_min(torch.finfo(have.dtype).tiny), 1.0))
    return out
