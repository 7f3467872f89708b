"""glmc: generalized linear mode connectivity for Transformers (ViT, GPT-2), in one library.

The library aligns Transformers through their symmetries (residual orthogonal maps,
head and MLP permutations, within-head maps), merges them and measures loss barriers.
It never imports Flower; the Flower apps in ``server/`` and ``client/`` are thin shells.

On live models (timm ``VisionTransformer``, Hugging Face ``GPT2LMHeadModel`` and ``ViTForImageClassification``):
``glmc.align``, ``glmc.merge``, ``glmc.barrier`` and ``glmc.check`` (:mod:`glmc.api`, imported on first use, so
that ``import glmc`` and the command line's ``--help`` load no torch). No module of the package shares their names.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

API = ("align", "merge", "barrier", "check")  # the functions of glmc.api


def __getattr__(name: str) -> Any:
    if name in API:
        from glmc import api

        return getattr(api, name)
    raise AttributeError(f"module 'glmc' has no attribute {name!r}")


__all__ = ["__version__", *API]
