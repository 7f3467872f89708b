"""Small float64 models of both families, with odd sizes, for invariance tests."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from glmc.archs import ModelConfig, State, build_model, get_arch, preset
from glmc.check import random_inputs as inputs
from glmc.check import random_native

VOCAB = 23

# Odd sizes on purpose: width not a power of 2, three or five heads, MLP width not 2·d, ReLU and GELU.
CONFIGS: dict[str, ModelConfig] = {
    "vit-odd": preset("vit-tiny").replace(width=45, heads=3, mlp=70),
    "vit-relu": preset("vit-tiny").replace(width=30, heads=5, mlp=37, activation="relu", depth=3),
    "gpt2-odd": preset("gpt2-tiny").replace(width=45, heads=3, mlp=70, vocab_size=VOCAB, context=12),
    "gpt2-relu": preset("gpt2-tiny").replace(width=30, heads=5, mlp=37, activation="relu", vocab_size=VOCAB,
                                             context=12),
}

__all__ = ["CONFIGS", "dataset", "inputs", "logits_of", "random_native"]


def dataset(cfg: ModelConfig, n: int = 24, seed: int = 0) -> TensorDataset:
    """Inputs with random targets, enough to measure a loss."""
    x = inputs(cfg, n, seed)
    g = torch.Generator().manual_seed(seed + 1)
    if cfg.family == "vit":
        return TensorDataset(x, torch.randint(0, cfg.num_classes, (n,), generator=g))
    return TensorDataset(x, torch.randint(0, cfg.vocab_size, (n, cfg.context), generator=g))


def logits_of(native: State, cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """Logits of the native (timm / HF) model holding ``native``."""
    arch = get_arch(cfg.family)
    model = build_model(cfg).double().eval()
    model.load_state_dict(native)
    with torch.no_grad():
        return arch.logits(model, x)
