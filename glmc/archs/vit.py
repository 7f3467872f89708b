"""timm VisionTransformer: builder from a ModelConfig, key map to canonical names, and its symmetry spec."""

from __future__ import annotations

from functools import partial

import torch
from timm.layers import Attention, LayerNorm
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from glmc.archs.base import Arch, KeyRule, require_inputs
from glmc.archs.config import ModelConfig
from glmc.spec import BLOCK_FOLDS, BLOCK_SPEC, BLOCK_WRITERS, NORM, RES, Axes

_BLOCK_KEYS = {
    "ln1": "norm1",
    "attn.qkv": "attn.qkv",
    "attn.proj": "attn.proj",
    "ln2": "norm2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_TOP_KEYS = {"embed.patch": "patch_embed.proj", "norm": "norm", "head": "head"}
_MODULES = {f"blocks.{{l}}.{c}": f"blocks.{{l}}.{n}" for c, n in _BLOCK_KEYS.items()} | _TOP_KEYS
_MODULES["blocks.{l}"] = "blocks.{l}"

KEYS: dict[str, KeyRule] = {"embed.cls": KeyRule("cls_token"), "embed.pos": KeyRule("pos_embed")}
for canon, native in _MODULES.items():
    if canon != "blocks.{l}":
        KEYS[f"{canon}.w"] = KeyRule(f"{native}.weight")
        KEYS[f"{canon}.b"] = KeyRule(f"{native}.bias")

SPEC: dict[str, Axes] = {
    "embed.patch.w": (RES, None, None, None),
    "embed.patch.b": (RES,),
    "embed.cls": (None, None, RES),
    "embed.pos": (None, None, RES),
    **BLOCK_SPEC,
    "norm.w": (NORM,),
    "norm.b": (RES,),
    "head.w": (None, RES),
    "head.b": (None,),
}


def _attention_with_head_dim(head_dim: int) -> type[Attention]:
    """timm's Attention with d_h fixed apart from d/H (needed for width-heterogeneous embeddings)."""

    class HeadDimAttention(Attention):
        def __init__(self, dim: int, num_heads: int = 8, **kwargs: object) -> None:
            super().__init__(dim, num_heads, attn_head_dim=head_dim, **kwargs)  # type: ignore[arg-type]

    return HeadDimAttention


def build(cfg: ModelConfig) -> VisionTransformer:
    """A standard timm ViT with a class token; d_h may differ from d/H through timm's attn_head_dim."""
    act: type[nn.Module] = nn.GELU if cfg.activation == "gelu" else nn.ReLU
    return VisionTransformer(
        img_size=cfg.img_size,
        patch_size=cfg.patch,
        in_chans=cfg.in_chans,
        num_classes=cfg.num_classes,
        global_pool="token",
        embed_dim=cfg.width,
        depth=cfg.depth,
        num_heads=cfg.heads,
        mlp_ratio=(cfg.mlp + 0.5) / cfg.width,  # timm floors d·ratio; +0.5 makes it exactly cfg.mlp
        act_layer=act,
        norm_layer=partial(LayerNorm, eps=cfg.norm_eps),
        attn_layer=Attention if cfg.attn_dim == cfg.width else _attention_with_head_dim(cfg.head_dim),
        qkv_bias=True,
        drop_rate=cfg.dropout,
        proj_drop_rate=cfg.dropout,
        attn_drop_rate=cfg.dropout,
    )


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) images → (B, classes) logits."""
    return model(x)


def check_inputs(cfg: ModelConfig, batch: torch.Tensor) -> None:
    """Images (N, C, H, W) of the configured channels and size, floating point."""
    want = (cfg.in_chans, cfg.img_size, cfg.img_size)
    fits = batch.dim() == 4 and tuple(batch.shape[1:]) == want and batch.is_floating_point()
    require_inputs(batch, cfg, fits, f"(N, {want[0]}, {want[1]}, {want[2]}) float images")


VIT = Arch(
    family="vit",
    keys=KEYS,
    spec=SPEC,
    folds={**BLOCK_FOLDS, "norm": ("head",)},
    writers=("embed.patch", "embed.cls", "embed.pos", *BLOCK_WRITERS),
    build=build,
    logits=logits,
    module_names=_MODULES,
    check_inputs=check_inputs,
)
