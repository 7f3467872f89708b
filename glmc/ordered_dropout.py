"""FjORD's Ordered Dropout (Horváth et al., "FjORD: Fair and Accurate Federated Learning under heterogeneous targets
with Ordered Dropout", NeurIPS 2021, §3): at every local step a client draws a width p from the discrete uniform
distribution over the widths it may train (the paper's D_P) and takes the step on the leading-p sub-model of its own
model.

The leading-p sub-model is HeteroFL's slice of the client's model (:func:`glmc.merging.heterofl.restrict`): the first
p·d residual coordinates, the first KV heads with their whole groups of query heads, the first MLP units. A step runs
a module of the sub-model's config on those entries of the client's own parameters, gathered with autograd, so the
gradient reaches them alone and every entry outside the slice gets zero. Leading slices nest: the leading-p slice of
a client's model is the leading-p slice of the global model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from glmc.archs import Arch, build_model
from glmc.core.config import ModelConfig
from glmc.errors import ConfigError
from glmc.merging import heterofl

SHAPE_FIELDS = ("width", "kv_heads", "mlp")  # the axes a width tier narrows; every other field is the model's own


class _Logits(nn.Module):
    """``arch.logits`` of ``model`` as a module's forward, whose parameters :func:`torch.func.functional_call` swaps."""

    def __init__(self, arch: Arch, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.logits_of = arch.logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits_of(self.model, x)


def slice_positions(model: nn.Module, own: ModelConfig, narrow: ModelConfig) -> dict[str, torch.Tensor]:
    """Per parameter of ``model`` (at ``own``), the flat indices of its leading slice at ``narrow``, in the narrow
    parameter's shape: :func:`heterofl.restrict` of the indices themselves, so the slice is HeteroFL's by
    construction."""
    index = {k: torch.arange(v.numel()).reshape(v.shape) for k, v in model.state_dict().items()}
    where = heterofl.restrict(index, own, narrow)
    return {name: where[name] for name, _ in model.named_parameters()}


class _SubModel:
    """The leading slice of a model at ``narrow``: a module of that config run on the slice of the model's
    parameters."""

    def __init__(self, model: nn.Module, arch: Arch, own: ModelConfig, narrow: ModelConfig) -> None:
        with torch.random.fork_rng(devices=[]):  # its initial weights are never used: leave the training's RNG be
            self.module = _Logits(arch, build_model(narrow))
        self.where = slice_positions(model, own, narrow)
        self.device = torch.device("cpu")

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The sub-model's logits on ``x``, differentiable in ``model``'s parameters (on their device)."""
        own = dict(model.named_parameters())
        self._follow(next(iter(own.values())).device)
        params = {f"model.{k}": own[k].reshape(-1).index_select(0, where.reshape(-1)).view(where.shape)
                  for k, where in self.where.items()}
        self.module.train(model.training)
        return torch.func.functional_call(self.module, params, (x,))

    def _follow(self, device: torch.device) -> None:
        """Move the module's buffers and the indices to ``device``, where the model went (train moves it)."""
        if device != self.device:
            self.module.to(device)
            self.where = {k: v.to(device) for k, v in self.where.items()}
            self.device = device


class OrderedDropout:
    """Ordered Dropout over ``widths``, the model's own config the widest. Called as ``Arch.logits`` is, each call
    draws a width (seeded by ``seed``) and gives the logits of the model's leading slice at it."""

    def __init__(self, model: nn.Module, arch: Arch, widths: Sequence[ModelConfig], seed: int) -> None:
        own = _own(widths)
        live = arch.config_of(model)
        if live is None or any(getattr(live, f) != getattr(own, f) for f in (*SHAPE_FIELDS, "depth")):
            raise ConfigError(f"ordered dropout over widths up to {own} was given a model of another shape")
        self.arch, self.widths = arch, tuple(widths)
        self.subs = {cfg: _SubModel(model, arch, own, cfg) for cfg in dict.fromkeys(widths) if cfg != own}
        self.generator = torch.Generator().manual_seed(seed)

    def draw(self) -> ModelConfig:
        """A width from the discrete uniform distribution over ``widths`` (FjORD's D_P)."""
        return self.widths[int(torch.randint(len(self.widths), (1,), generator=self.generator))]

    def logits_at(self, width: ModelConfig, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The logits of ``model``'s leading slice at ``width`` (the model itself at its own)."""
        return self.subs[width].logits(model, x) if width in self.subs else self.arch.logits(model, x)

    def __call__(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.logits_at(self.draw(), model, x)


def _own(widths: Sequence[ModelConfig]) -> ModelConfig:
    """The widest of ``widths``; ConfigError unless every other is a leading slice of it."""
    own = max(widths, key=lambda cfg: cfg.width)
    for cfg in widths:
        nested = all(getattr(cfg, f) <= getattr(own, f) for f in SHAPE_FIELDS)
        if not nested or dataclasses.replace(cfg, **{f: getattr(own, f) for f in (*SHAPE_FIELDS, "heads")}) != own:
            raise ConfigError(f"ordered dropout needs leading slices of one model; {cfg} is none of {own}")
    return own
