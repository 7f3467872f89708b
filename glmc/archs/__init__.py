"""Architecture families (timm ViT; HF GPT-2, Llama, Mistral, Qwen2, GPT-NeoX, BERT) by name, building a model from a
config, and inputs for it."""

import torch
from torch import nn

from glmc.archs.base import Arch, KeyRule
from glmc.archs.bert import BERT
from glmc.archs.gpt2 import GPT2
from glmc.archs.llama import LLAMA, MISTRAL, QWEN2
from glmc.archs.neox import NEOX
from glmc.archs.vit import VIT
from glmc.core.config import ModelConfig
from glmc.errors import ConfigError

ARCHS: dict[str, Arch] = {"vit": VIT, "gpt2": GPT2, "llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2,
                          "neox": NEOX, "bert": BERT}


def get_arch(family: str) -> Arch:
    """The registered family, or a ConfigError naming the supported ones."""
    if family not in ARCHS:
        raise ConfigError(f"unsupported architecture {family!r}; supported: {', '.join(ARCHS)}")
    return ARCHS[family]


def build_model(cfg: ModelConfig) -> nn.Module:
    """A fresh standard model of the config's family (random init, no downloads)."""
    return get_arch(cfg.family).build(cfg)


def random_inputs(cfg: ModelConfig, n: int = 6, seed: int = 0) -> torch.Tensor:
    """Model inputs: images for an image model, token ids for a language model."""
    g = torch.Generator().manual_seed(seed)
    if get_arch(cfg.family).modality == "image":
        return torch.randn(n, cfg.in_chans, cfg.img_size, cfg.img_size, generator=g, dtype=torch.float64)
    return torch.randint(0, cfg.vocab_size, (n, cfg.context), generator=g)


__all__ = ["ARCHS", "Arch", "KeyRule", "build_model", "get_arch", "random_inputs"]
