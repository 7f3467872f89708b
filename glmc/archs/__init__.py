"""Architecture families (timm ViT; HF GPT-2, Llama, Mistral, Qwen2, GPT-NeoX, BERT), their presets, and building a
model from a config."""

from torch import nn

from glmc.archs.base import Arch, KeyRule, State, cast, search_view
from glmc.archs.bert import BERT
from glmc.archs.config import PRESETS, ModelConfig, preset, scale_width
from glmc.archs.gpt2 import GPT2
from glmc.archs.llama import LLAMA, MISTRAL, QWEN2
from glmc.archs.neox import NEOX
from glmc.archs.vit import VIT
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


__all__ = ["ARCHS", "PRESETS", "Arch", "KeyRule", "ModelConfig", "State", "build_model", "cast", "get_arch",
           "preset", "scale_width", "search_view"]
