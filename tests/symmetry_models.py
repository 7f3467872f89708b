"""Small float64 models of both families, with odd sizes and perturbed LayerNorms, for invariance tests."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from glmc.archs import ModelConfig, State, build_model, get_arch, preset

VOCAB = 23

# Odd sizes on purpose: width not a power of 2, three or five heads, MLP width not 2·d, ReLU and GELU.
CONFIGS: dict[str, ModelConfig] = {
    "vit-odd": preset("vit-tiny").replace(width=45, heads=3, mlp=70),
    "vit-relu": preset("vit-tiny").replace(width=30, heads=5, mlp=37, activation="relu", depth=3),
    "gpt2-odd": preset("gpt2-tiny").replace(width=45, heads=3, mlp=70, vocab_size=VOCAB, context=12),
    "gpt2-relu": preset("gpt2-tiny").replace(width=30, heads=5, mlp=37, activation="relu", vocab_size=VOCAB,
                                             context=12),
}


def random_native(cfg: ModelConfig, seed: int) -> State:
    """A float64 native state dict with every parameter perturbed, so LayerNorm folding is not trivial."""
    torch.manual_seed(seed)
    model = build_model(cfg).double()
    return {k: v + 0.1 * torch.randn_like(v) for k, v in model.state_dict().items()}


def inputs(cfg: ModelConfig, n: int = 6, seed: int = 0) -> torch.Tensor:
    """Model inputs: images for a ViT, token ids for GPT-2."""
    g = torch.Generator().manual_seed(seed)
    if cfg.family == "vit":
        return torch.randn(n, cfg.in_chans, cfg.img_size, cfg.img_size, generator=g, dtype=torch.float64)
    return torch.randint(0, cfg.vocab_size, (n, cfg.context), generator=g)


def dataset(cfg: ModelConfig, n: int = 24, seed: int = 0) -> TensorDataset:
    """Inputs with random targets, enough to measure a loss."""
    x = inputs(cfg, n, seed)
    g = torch.Generator().manual_seed(seed + 1)
    if cfg.family == "vit":
        return TensorDataset(x, torch.randint(0, cfg.num_classes, (n,), generator=g))
    return TensorDataset(x, torch.randint(0, cfg.vocab_size, (n, cfg.context), generator=g))


def logits_of(native: State, cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    arch = get_arch(cfg.family)
    model = build_model(cfg).double().eval()
    model.load_state_dict(native)
    with torch.no_grad():
        return arch.logits(model, x)
