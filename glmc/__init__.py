"""glmc: generalized linear mode connectivity for Transformers (ViT, GPT-2), in one library.

The library aligns Transformers through their symmetries (residual orthogonal maps,
head and MLP permutations, within-head maps), merges them and measures loss barriers.
It never imports Flower; the Flower apps in ``server/`` and ``client/`` are thin shells.

On live models (timm ``VisionTransformer``, Hugging Face ``GPT2LMHeadModel`` and ``ViTForImageClassification``):
``glmc.align``,
``glmc.merge``, ``glmc.barrier`` and ``glmc.check`` (:mod:`glmc.api`, imported on first use).
"""

from __future__ import annotations

import sys
import types
from typing import Any

__version__ = "0.1.0"

API = ("align", "merge", "barrier", "check")  # functions of glmc.api, named like the modules that implement them


class _Package(types.ModuleType):
    """The package, whose API names stay the API's functions: importing the submodule of the same name (glmc.align,
    ...) would otherwise replace ``glmc.align`` by the module (submodules stay importable by their full name)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in API and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


def __getattr__(name: str) -> Any:
    if name in API:
        from glmc import api

        return getattr(api, name)
    raise AttributeError(f"module 'glmc' has no attribute {name!r}")


sys.modules[__name__].__class__ = _Package
__all__ = ["__version__", *API]
