"""Forward passes with hooks on canonical sites: how REPAIR and RegMean read a model's activations.

A hook may end a pass early by raising :class:`AllSitesRecorded` once every site it waits for has been reached,
so the layers after the last site are not run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from glmc.archs import Arch

Site = tuple[str, int | None]  # a canonical module prefix (``blocks.{l}.mlp.fc1``, ``head``) and its layer
Hook = Callable[[nn.Module, tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor | None]  # may replace the output


class AllSitesRecorded(Exception):
    """Raised from the hook of the last site a forward pass needs, to skip the rest of the network."""


def hooked_passes(arch: Arch, model: nn.Module, hooks: Mapping[Site, Hook], chunks: Iterable[torch.Tensor],
                  before_each: Callable[[], None] = lambda: None) -> None:
    """A forward pass of each chunk through ``model`` with ``hooks`` on their sites' modules; a hook ends a pass
    early by raising :class:`AllSitesRecorded`. The hooks are removed afterwards, whatever happens."""
    handles = [arch.module(model, site, layer).register_forward_hook(hook) for (site, layer), hook in hooks.items()]
    param = next(model.parameters())
    try:
        with torch.no_grad():
            for chunk in chunks:
                before_each()
                with contextlib.suppress(AllSitesRecorded):  # inputs go where the model is, images in its dtype
                    x = chunk.to(param.device, param.dtype) if chunk.is_floating_point() else chunk.to(param.device)
                    arch.logits(model, x)
    finally:
        for handle in handles:
            handle.remove()
