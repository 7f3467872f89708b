"""Small float64 models of every family, with odd sizes, for invariance tests."""

from __future__ import annotations

import math

import torch
from torch.utils.data import TensorDataset

from glmc.archs import build_model, get_arch
from glmc.archs import random_inputs as inputs
from glmc.core.config import ModelConfig, preset
from glmc.core.state import State
from glmc.symmetry.canonical import canonicalize
from glmc.symmetry.exactness import random_native
from tests.conftest import synthetic_images, synthetic_text

VOCAB = 23

# Odd sizes on purpose: width not a power of 2, three or five heads, MLP width not 2·d, ReLU and GELU.
CONFIGS: dict[str, ModelConfig] = {
    "vit-odd": preset("vit-tiny").replace(width=45, heads=3, mlp=70),
    "vit-relu": preset("vit-tiny").replace(width=30, heads=5, mlp=37, activation="relu", depth=3),
    "gpt2-odd": preset("gpt2-tiny").replace(width=45, heads=3, mlp=70, vocab_size=VOCAB, context=12),
    "gpt2-relu": preset("gpt2-tiny").replace(width=30, heads=5, mlp=37, activation="relu", vocab_size=VOCAB,
                                             context=12),
}

# The RMSNorm families (Llama, Mistral, Qwen2): grouped queries (3 KV heads of 2), one KV head with head_dim set apart
# from width/heads, q/k/v biases.
RMS_CONFIGS: dict[str, ModelConfig] = {
    "llama-gqa": preset("llama-tiny").replace(width=36, heads=6, kv_heads=3, mlp=70, vocab_size=VOCAB, context=12),
    "mistral-mqa": preset("llama-tiny").replace(family="mistral", width=45, heads=3, kv_heads=1, head_dim=8, mlp=37,
                                                vocab_size=VOCAB, context=12),
    "qwen2-bias": preset("llama-tiny").replace(family="qwen2", width=30, heads=5, kv_heads=5, mlp=37, qkv_bias=True,
                                               vocab_size=VOCAB, context=12, depth=3),
}
# GPT-NeoX (q|k|v fused per head): parallel and sequential residuals, rotary on a quarter, all and 6 of 12 head
# dimensions (two pairs at 0.25, so pairing i with i + r/2 rather than i + d_h/2 is tested), attention biases off,
# ReLU.
NEOX_CONFIGS: dict[str, ModelConfig] = {
    "neox-parallel": preset("neox-tiny").replace(width=48, heads=3, mlp=70, vocab_size=VOCAB, context=12),
    "neox-sequential": preset("neox-tiny").replace(width=30, heads=5, mlp=37, rotary_pct=1.0, activation="relu",
                                                   parallel_residual=False, vocab_size=VOCAB, context=12, depth=3),
    "neox-nobias": preset("neox-tiny").replace(width=36, heads=3, mlp=37, rotary_pct=0.5, qkv_bias=False,
                                               vocab_size=VOCAB, context=12),
}
# The post-LayerNorm BERT: a permutation residual; odd sizes, GELU and ReLU.
BERT_CONFIGS: dict[str, ModelConfig] = {
    "bert-odd": preset("bert-tiny").replace(width=45, heads=3, mlp=70, vocab_size=VOCAB, context=12),
    "bert-relu": preset("bert-tiny").replace(width=30, heads=5, mlp=37, activation="relu", vocab_size=VOCAB,
                                             context=12, depth=3),
}
ALL_CONFIGS = CONFIGS | RMS_CONFIGS | NEOX_CONFIGS | BERT_CONFIGS

# Two-block models, for the corrections of a merge (REPAIR, refit).
MERGE_CONFIGS: dict[str, ModelConfig] = {
    "vit": preset("vit-bench").replace(depth=2, img_size=8, patch=4, in_chans=1, num_classes=3),
    "gpt2": preset("gpt2-bench").replace(depth=2, vocab_size=VOCAB, context=12, width=48, heads=3, mlp=70),
    # q|k|v fused per head: refit's hooks on q, k and v each see and replace their part of the module's output
    "neox": preset("neox-tiny").replace(vocab_size=VOCAB, context=12, width=48, heads=3, mlp=70),
}

__all__ = ["ALL_CONFIGS", "BERT_CONFIGS", "CONFIGS", "MERGE_CONFIGS", "NEOX_CONFIGS", "RMS_CONFIGS", "canonical",
           "dataset", "inputs", "logits_of", "merge_data", "random_native"]


def canonical(cfg: ModelConfig, seed: int) -> State:
    """A random model of ``cfg`` in the standard canonical form, float64."""
    return canonicalize(get_arch(cfg.family), random_native(cfg, seed), cfg, dtype=torch.float64)


def merge_data(cfg: ModelConfig) -> TensorDataset:
    """Learnable synthetic data for a MERGE_CONFIGS model: row-band images, or cyclic text."""
    return synthetic_images(64) if cfg.family == "vit" else synthetic_text(32, vocab=VOCAB)


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


def planted(turns: list[float], width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rotation by ``turns`` (degrees) in the first planes of a random orthonormal basis, and that basis."""
    q = torch.eye(width, dtype=torch.float64)
    for i, degrees in enumerate(turns):
        c, s = math.cos(math.radians(degrees)), math.sin(math.radians(degrees))
        q[2 * i:2 * i + 2, 2 * i:2 * i + 2] = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    basis, _ = torch.linalg.qr(torch.randn(width, width, generator=torch.Generator().manual_seed(seed),
                                           dtype=torch.float64))
    return basis @ q @ basis.T, basis
