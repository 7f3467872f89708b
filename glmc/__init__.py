"""glmc: generalized linear mode connectivity for Transformers (ViT, GPT-2), in one library.

The library aligns Transformers through their symmetries (residual orthogonal maps,
head and MLP permutations, within-head maps), merges them and measures loss barriers.
It never imports Flower; the Flower apps in ``server/`` and ``client/`` are thin shells.
"""

__version__ = "0.1.0"
