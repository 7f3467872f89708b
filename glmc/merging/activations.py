"""Forward passes with hooks on canonical sites: how REPAIR and RegMean read a model's activations.

A hook may end a pass early by raising :class:`AllSitesRecorded` once every site it waits for has been reached,
so the layers after the last site are not run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from glmc.archs import get_arch
from glmc.core.config import ModelConfig

Site = tuple[str, int | None]  # a canonical module prefix (``blocks.{l}.mlp.fc1``, ``head``) and its layer
Hook = Callable[[nn.Module, tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor | None]  # may replace the output


class AllSitesRecorded(Exception):
    """Raised from the hook of the last site a forward pass needs, to skip the rest of the network."""


def _on_part(hook: Hook, cfg: ModelConfig, site: str) -> Hook:
    """``hook`` for a canonical layer that is a part of its native module (q of a fused q|k|v): it sees, and may
    replace, only its part of the module's output. Hooks on one module run in the order they were registered, each
    on the output the previous one left."""
    part = get_arch(cfg.family).output_part(site)
    if part is None:
        return hook

    def on_part(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor | None:
        replaced = hook(module, args, part.take(out, cfg.heads, axis=-1))
        return None if replaced is None else part.put(out, replaced, cfg.heads, axis=-1)
    return on_part


def hooked_passes(cfg: ModelConfig, model: nn.Module, hooks: Mapping[Site, Hook], chunks: Iterable[torch.Tensor],
                  before_each: Callable[[], None] = lambda: None) -> None:
    """A forward pass of each chunk through ``model`` (of ``cfg``) with ``hooks`` on their sites' modules; a hook ends
    a pass early by raising :class:`AllSitesRecorded`. The hooks are removed afterwards, whatever happens."""
    arch = get_arch(cfg.family)
    handles = [arch.module(model, site, layer).register_forward_hook(_on_part(hook, cfg, site))
               for (site, layer), hook in hooks.items()]
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
