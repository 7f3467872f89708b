"""timm VisionTransformer: builder from a ModelConfig, key map to canonical names, and its symmetry spec."""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

import torch
from timm.layers import GELU, Attention, LayerNorm
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from glmc.archs.base import Arch, KeyRule, require_inputs
from glmc.archs.prenorm import BLOCK_FOLDS, BLOCK_SPEC, BLOCK_WRITERS
from glmc.core.config import ModelConfig
from glmc.core.spec import NORM, RES, Axes
from glmc.errors import ConfigError

_BLOCK_KEYS = {
    "ln1": "norm1",
    "attn.qkv": "attn.qkv",
    "attn.proj": "attn.proj",
    "ln2": "norm2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_TOP_KEYS = {"embed.patch": "patch_embed.proj", "norm": "norm", "fc_norm": "fc_norm", "head": "head"}
_MODULES = {f"blocks.{{l}}.{c}": f"blocks.{{l}}.{n}" for c, n in _BLOCK_KEYS.items()} | _TOP_KEYS
_MODULES["blocks.{l}"] = "blocks.{l}"
# Parameters only some timm variants have: class and register tokens, qkv biases, LayerScale gains, and the final
# norm either before pooling (``norm``) or after it (``fc_norm``).
_OPTIONAL = {"embed.cls", "embed.reg", "blocks.{l}.attn.qkv.b", "blocks.{l}.ls1.g", "blocks.{l}.ls2.g", "norm.w",
             "norm.b", "fc_norm.w", "fc_norm.b"}

_NATIVE = {"embed.cls": "cls_token", "embed.reg": "reg_token", "embed.pos": "pos_embed",
           "blocks.{l}.ls1.g": "blocks.{l}.ls1.gamma", "blocks.{l}.ls2.g": "blocks.{l}.ls2.gamma"}
for canon, native in _MODULES.items():
    if canon != "blocks.{l}":
        _NATIVE[f"{canon}.w"] = f"{native}.weight"
        _NATIVE[f"{canon}.b"] = f"{native}.bias"
KEYS: dict[str, KeyRule] = {canon: KeyRule(native, optional=canon in _OPTIONAL) for canon, native in _NATIVE.items()}

SPEC: dict[str, Axes] = {
    "embed.patch.w": (RES, None, None, None),
    "embed.patch.b": (RES,),
    "embed.cls": (None, None, RES),
    "embed.reg": (None, None, RES),
    "embed.pos": (None, None, RES),
    **BLOCK_SPEC,
    # LayerScale: a gain on a branch's output, so on the stream; folded into the writer before the stream moves
    "blocks.{l}.ls1.g": (NORM,),
    "blocks.{l}.ls2.g": (NORM,),
    "norm.w": (NORM,),
    "norm.b": (RES,),
    "fc_norm.w": (NORM,),
    "fc_norm.b": (RES,),
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
    """A standard timm ViT of the config's variant; d_h may differ from d/H through timm's attn_head_dim."""
    act: type[nn.Module] = nn.GELU if cfg.activation == "gelu" else nn.ReLU
    return VisionTransformer(
        img_size=cfg.img_size,
        patch_size=cfg.patch,
        in_chans=cfg.in_chans,
        num_classes=cfg.num_classes,
        global_pool=cfg.global_pool,
        class_token=cfg.class_token,
        reg_tokens=cfg.reg_tokens,
        fc_norm=cfg.fc_norm,
        no_embed_class=cfg.no_embed_class,
        init_values=1.0 if cfg.layer_scale else None,
        embed_dim=cfg.width,
        depth=cfg.depth,
        num_heads=cfg.heads,
        mlp_ratio=(cfg.mlp + 0.5) / cfg.width,  # timm floors d·ratio; +0.5 makes it exactly cfg.mlp
        act_layer=act,
        norm_layer=partial(LayerNorm, eps=cfg.norm_eps),
        attn_layer=Attention if cfg.attn_dim == cfg.width else _attention_with_head_dim(cfg.head_dim),
        qkv_bias=cfg.qkv_bias,
        drop_rate=cfg.dropout,
        proj_drop_rate=cfg.dropout,
        attn_drop_rate=cfg.dropout,
    )


def _activation(module: nn.Module) -> Literal["gelu", "relu"]:
    """glmc's name of a timm MLP activation (exact GELU or ReLU); anything else is not covered."""
    if isinstance(module, nn.ReLU):
        return "relu"
    if isinstance(module, GELU) or (isinstance(module, nn.GELU) and module.approximate == "none"):
        return "gelu"
    raise ConfigError(f"unsupported timm ViT activation {type(module).__name__} (glmc covers exact GELU and ReLU)")


def _square(size: tuple[int, ...] | int, what: str) -> int:
    sizes = (size,) * 2 if isinstance(size, int) else tuple(size)
    if len(set(sizes)) != 1:
        raise ConfigError(f"unsupported timm ViT: {what} {sizes} is not square")
    return int(sizes[0])


def config_of(model: nn.Module) -> ModelConfig | None:
    """The ModelConfig of a timm VisionTransformer (None for any other module); ConfigError for a variant glmc's
    spec does not cover (no classifier head, max pooling, a non-square patch)."""
    if not isinstance(model, VisionTransformer):
        return None
    if not isinstance(model.head, nn.Linear):
        raise ConfigError("unsupported timm ViT: it has no classifier head (num_classes=0)")
    if not isinstance(model.patch_embed.proj, nn.Conv2d):  # a timm PatchEmbed always has one; mypy cannot tell
        raise ConfigError("unsupported timm ViT: its patch embedding is not a convolution")
    block: Any = model.blocks[0]
    return ModelConfig(
        "vit", width=model.embed_dim, depth=len(model.blocks), heads=block.attn.num_heads,
        mlp=block.mlp.fc1.out_features, head_dim=block.attn.head_dim, activation=_activation(block.mlp.act),
        norm_eps=block.norm1.eps,
        img_size=_square(model.patch_embed.img_size, "image size"),
        patch=_square(model.patch_embed.patch_size, "patch size"), in_chans=model.patch_embed.proj.in_channels,
        num_classes=model.num_classes, class_token=model.cls_token is not None, reg_tokens=model.num_reg_tokens,
        global_pool=model.global_pool, fc_norm=not isinstance(model.fc_norm, nn.Identity),  # type: ignore[arg-type]
        qkv_bias=block.attn.qkv.bias is not None, layer_scale=not isinstance(block.ls1, nn.Identity),
        no_embed_class=model.no_embed_class)


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
    folds={**BLOCK_FOLDS, "norm": ("head",), "fc_norm": ("head",)},
    writers=("embed.patch", "embed.cls", "embed.reg", "embed.pos", *BLOCK_WRITERS),
    build=build,
    logits=logits,
    module_names=_MODULES,
    check_inputs=check_inputs,
    config_of=config_of,
    modality="image",
    scales={"blocks.{l}.ls1": "blocks.{l}.attn.proj", "blocks.{l}.ls2": "blocks.{l}.mlp.fc2"},
)
