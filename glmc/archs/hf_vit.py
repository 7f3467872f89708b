"""Hugging Face ``ViTForImageClassification`` as glmc's ViT: its config and weights mapped onto the timm
``VisionTransformer`` that :mod:`glmc.archs.vit` declares the symmetries of, and back.

A transformers ViT is a timm ViT with a class token, token pooling, no LayerScale and separate q/k/v projections:
the map below is a renaming plus one concatenation, checked on every read by comparing the two models' logits.
"""

from __future__ import annotations

import copy
import itertools
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from glmc.archs import get_arch
from glmc.core.config import ModelConfig
from glmc.core.state import State
from glmc.errors import ConfigError

ARCHITECTURE = "ViTForImageClassification"
TOP = {"vit.embeddings.cls_token": "cls_token", "vit.embeddings.position_embeddings": "pos_embed",
       "vit.embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
       "vit.embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
       "vit.layernorm.weight": "norm.weight", "vit.layernorm.bias": "norm.bias",
       "classifier.weight": "head.weight", "classifier.bias": "head.bias"}
BLOCK = {"layernorm_before": "norm1", "attention.o_proj": "attn.proj", "layernorm_after": "norm2",
         "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}  # HF module → timm module, in block i of each
QKV = ("attention.q_proj", "attention.k_proj", "attention.v_proj")  # concatenated, in this order, into attn.qkv
ACTIVATIONS = {"gelu": "gelu", "relu": "relu"}  # HF hidden_act → glmc's (exact GELU only: gelu_new is tanh)
READ_TOLERANCE = 1e-6  # max |logit difference| (float64) between the HF model and its timm rebuild


def is_hf_vit(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ViTForImageClassification (transformers is never imported for this:
    without it in memory, no model can be one)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.ViTForImageClassification)


def config_of(hf: Any, classes: int) -> ModelConfig:
    """glmc's config of a transformers ViTConfig (``classes``: the classifier's rows); ConfigError for an option
    the timm ViT does not have."""
    if hf.hidden_act not in ACTIVATIONS:
        raise ConfigError(f"unsupported Hugging Face ViT activation {hf.hidden_act!r} (glmc covers exact gelu and "
                          "relu)")
    if hf.hidden_size % hf.num_attention_heads:
        raise ConfigError(f"unsupported Hugging Face ViT: {hf.num_attention_heads} heads do not divide "
                          f"{hf.hidden_size}")
    return ModelConfig("vit", width=hf.hidden_size, depth=hf.num_hidden_layers, heads=hf.num_attention_heads,
                       mlp=hf.intermediate_size, head_dim=hf.hidden_size // hf.num_attention_heads,
                       activation=ACTIVATIONS[hf.hidden_act], norm_eps=hf.layer_norm_eps,  # type: ignore[arg-type]
                       img_size=hf.image_size, patch=hf.patch_size, in_chans=hf.num_channels, num_classes=classes,
                       class_token=True, global_pool="token", fc_norm=False, qkv_bias=hf.qkv_bias)


def _pairs(depth: int) -> Iterator[tuple[str, str]]:
    """(HF name, timm name) of every parameter but the q/k/v projections (:func:`_qkv`)."""
    yield from TOP.items()
    for i, (hf, timm), p in itertools.product(range(depth), BLOCK.items(), ("weight", "bias")):
        yield f"vit.layers.{i}.{hf}.{p}", f"blocks.{i}.{timm}.{p}"


def _qkv(depth: int) -> Iterator[tuple[list[str], str]]:
    """(the HF q, k and v names, the timm qkv name they concatenate into) of every block's weight and bias."""
    for i, p in itertools.product(range(depth), ("weight", "bias")):
        yield [f"vit.layers.{i}.{name}.{p}" for name in QKV], f"blocks.{i}.attn.qkv.{p}"


def to_timm(hf_state: Mapping[str, torch.Tensor], depth: int) -> State:
    """The timm names of a transformers ViT's state dict (q, k, v concatenated into qkv; no biases without
    qkv_bias)."""
    state = {timm: hf_state[hf] for hf, timm in _pairs(depth)}
    qkv = {timm: torch.cat([hf_state[n] for n in names]) for names, timm in _qkv(depth) if names[0] in hf_state}
    return state | qkv


def from_timm(state: Mapping[str, torch.Tensor], depth: int) -> State:
    """A transformers ViT's state dict from timm names: :func:`to_timm` reversed."""
    hf = {name: state[timm] for name, timm in _pairs(depth)}
    for names, timm in _qkv(depth):
        if timm in state:
            hf |= dict(zip(names, state[timm].chunk(3), strict=True))
    return hf


def timm_module(model: nn.Module) -> nn.Module:
    """The timm ViT computing a transformers ViT's logits, checked on random images (float64); ConfigError if
    they differ (an option that changes the function without changing a shape)."""
    from glmc.archs import random_inputs

    hf: Any = model.config
    head: Any = model.classifier
    cfg = config_of(hf, head.out_features)
    timm = get_arch("vit").build(cfg).double().eval()
    timm.load_state_dict(to_timm({k: v.detach().double() for k, v in model.state_dict().items()}, cfg.depth),
                         strict=True)
    x = random_inputs(cfg, n=2).double()
    with torch.no_grad():
        error = (copy.deepcopy(model).double().eval()(pixel_values=x).logits - timm(x)).abs().max().item()
    if error > READ_TOLERANCE:
        raise ConfigError(f"unsupported Hugging Face ViT variant: glmc's timm rebuild of it computes other logits "
                          f"(max |Δ| {error:.2g})")
    return timm.to(next(model.parameters()).dtype)


def hf_config(cfg: ModelConfig, saved: Mapping[str, Any] | None) -> Any:
    """A transformers ViTConfig of ``cfg``: the one read (if any) at the config's sizes; ConfigError for a
    variant a transformers ViT cannot hold."""
    from transformers import ViTConfig

    lacks = [what for what, has in (("a class token", cfg.class_token), ("token pooling", cfg.global_pool == "token"),
                                    ("no register tokens", not cfg.reg_tokens), ("no LayerScale", not cfg.layer_scale),
                                    ("no fc_norm", not cfg.fc_norm), ("position embeddings on the class token",
                                                                      not cfg.no_embed_class),
                                    ("heads of width/heads", cfg.attn_dim == cfg.width)) if not has]
    if lacks:
        raise ConfigError(f"a Hugging Face ViT needs {lacks[0]}; write this ViT as --format timm or glmc")
    sizes = dict(hidden_size=cfg.width, num_hidden_layers=cfg.depth, num_attention_heads=cfg.heads,
                 intermediate_size=cfg.mlp, hidden_act=cfg.activation, layer_norm_eps=cfg.norm_eps,
                 image_size=cfg.img_size, patch_size=cfg.patch, num_channels=cfg.in_chans, qkv_bias=cfg.qkv_bias)
    config = ViTConfig.from_dict({**(saved or {}), **sizes})
    if config.num_labels != cfg.num_classes:
        config.num_labels = cfg.num_classes
    config.architectures = [ARCHITECTURE]
    return config


def hf_module(native: Mapping[str, torch.Tensor], cfg: ModelConfig, saved: Mapping[str, Any] | None) -> nn.Module:
    """The ViTForImageClassification holding a glmc ViT's native (timm-named) state."""
    from transformers import ViTForImageClassification

    model = ViTForImageClassification(hf_config(cfg, saved))
    model.load_state_dict(from_timm(native, cfg.depth), strict=True)
    return model.eval()
