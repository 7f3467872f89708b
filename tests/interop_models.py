"""Small models built by timm and transformers themselves, saved and reloaded the way their own users do."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import timm
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, ViTConfig, ViTForImageClassification

VIT_BASE: dict[str, Any] = dict(model_name="vit_tiny_patch16_224", img_size=16, patch_size=4, in_chans=1, embed_dim=24,
                                depth=2, num_heads=3, mlp_ratio=2.5, num_classes=5)
# Named timm variants: every option glmc's spec covers, alone and together.
VIT_VARIANTS: dict[str, dict[str, Any]] = {
    "vit-plain": {},
    "vit-no-cls-avg": dict(class_token=False, global_pool="avg"),
    "vit-registers": dict(reg_tokens=3),
    "vit-layer-scale": dict(init_values=0.1),
    "vit-no-qkv-bias": dict(qkv_bias=False, act_layer="relu"),
    "vit-avg-no-fc-norm": dict(global_pool="avg", fc_norm=False),
    "vit-dinov2-like": dict(reg_tokens=2, no_embed_class=True, init_values=0.1, img_size=20, patch_size=5,
                            in_chans=3, num_classes=7, mlp_ratio=3.0),
}
HF_VIT_BASE: dict[str, Any] = dict(hidden_size=24, num_hidden_layers=2, num_attention_heads=3, intermediate_size=60,
                                   image_size=16, patch_size=4, num_channels=1, num_labels=5)
GPT2_BASE: dict[str, Any] = dict(vocab_size=19, n_positions=10, n_embd=24, n_layer=2, n_head=3, n_inner=50,
                                 bos_token_id=None, eos_token_id=None)


def perturb(model: nn.Module, seed: int) -> nn.Module:
    """Every parameter moved by noise (LayerNorm gains and biases too, so folding them is never trivial); tied
    parameters stay tied (each is one Parameter)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.eval()


def vit_kwargs(name: str) -> dict[str, Any]:
    return {**VIT_BASE, **VIT_VARIANTS[name]}


def gpt2(tied: bool, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return perturb(GPT2LMHeadModel(GPT2Config(**GPT2_BASE, tie_word_embeddings=tied)), seed)  # type: ignore[return-value]


def hf_vit(seed: int = 0, **config: Any) -> ViTForImageClassification:
    torch.manual_seed(seed)
    return perturb(ViTForImageClassification(ViTConfig(**HF_VIT_BASE | config)), seed)  # type: ignore[return-value]


def vit(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return perturb(timm.create_model(**vit_kwargs(name)), seed)


@dataclass(frozen=True)
class Library:
    """How a model's own library saves and reloads it, and what its inputs are."""

    suffix: str
    save: Callable[[nn.Module, Path, dict[str, Any]], None]
    load: Callable[[Path], nn.Module]
    inputs: Callable[[nn.Module], torch.Tensor]


def _save_hf(model: nn.Module, path: Path, kwargs: dict[str, Any]) -> None:
    model.save_pretrained(str(path))  # type: ignore[operator]


def _save_timm(model: nn.Module, path: Path, kwargs: dict[str, Any]) -> None:
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    path.with_suffix(".json").write_text(json.dumps(kwargs))


def _save_timm_folder(model: nn.Module, path: Path, kwargs: dict[str, Any]) -> None:
    from timm.models._hub import save_for_hf

    save_for_hf(model, str(path), safe_serialization=True)  # timm records the create_model kwargs itself


def load_timm(path: Path) -> nn.Module:
    model = timm.create_model(**json.loads(path.with_suffix(".json").read_text()))
    model.load_state_dict(load_file(str(path)), strict=True)
    return model.eval()


def _vit_inputs(model: nn.Module) -> torch.Tensor:
    size = model.patch_embed.img_size  # type: ignore[union-attr]
    g = torch.Generator().manual_seed(3)
    return torch.randn(4, model.patch_embed.proj.in_channels, *size, generator=g)  # type: ignore[union-attr]


def _hf_vit_inputs(model: nn.Module) -> torch.Tensor:
    config: Any = model.config
    size = config.image_size
    return torch.randn(4, config.num_channels, size, size, generator=torch.Generator().manual_seed(3))


def _gpt2_inputs(model: nn.Module) -> torch.Tensor:
    return torch.randint(0, GPT2_BASE["vocab_size"], (3, GPT2_BASE["n_positions"]),
                         generator=torch.Generator().manual_seed(3))


HF = Library("", _save_hf, lambda p: GPT2LMHeadModel.from_pretrained(str(p)).eval(), _gpt2_inputs)
TIMM = Library(".safetensors", _save_timm, load_timm, _vit_inputs)
HF_VIT = Library("", _save_hf, lambda p: ViTForImageClassification.from_pretrained(str(p)).eval(), _hf_vit_inputs)
TIMM_FOLDER = Library("", _save_timm_folder, lambda p: timm.create_model(f"local-dir:{p}", pretrained=True).eval(),
                      _vit_inputs)


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's logits, in its own dtype, without gradients."""
    with torch.no_grad():
        out = model.eval()(x if not x.is_floating_point() else x.to(next(model.parameters()).dtype))
    return out.logits if hasattr(out, "logits") else out
