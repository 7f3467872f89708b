"""The fused pre-LayerNorm block that timm's ViT and Hugging Face's GPT-2 share once their names are canonical: one
q|k|v projection in equal thirds, a LayerNorm before each branch, a plain MLP."""

from __future__ import annotations

from glmc.core.spec import HEADS, MLP, MLP_IN, NORM, QKV, RES, Axes

# One pre-norm Transformer block, the same in timm's ViT and HF's GPT-2 once names are canonical.
BLOCK_SPEC: dict[str, Axes] = {
    "blocks.{l}.ln1.w": (NORM,),
    "blocks.{l}.ln1.b": (RES,),
    "blocks.{l}.attn.qkv.w": (QKV, RES),
    "blocks.{l}.attn.qkv.b": (QKV,),
    "blocks.{l}.attn.proj.w": (RES, HEADS),
    "blocks.{l}.attn.proj.b": (RES,),
    "blocks.{l}.ln2.w": (NORM,),
    "blocks.{l}.ln2.b": (RES,),
    "blocks.{l}.mlp.fc1.w": (MLP, RES),
    "blocks.{l}.mlp.fc1.b": (MLP,),
    "blocks.{l}.mlp.fc2.w": (RES, MLP_IN),
    "blocks.{l}.mlp.fc2.b": (RES,),
}

# Which linear layers read each LayerNorm: its gain (and bias, where the reader has one) folds into them.
BLOCK_FOLDS: dict[str, tuple[str, ...]] = {
    "blocks.{l}.ln1": ("blocks.{l}.attn.qkv",),
    "blocks.{l}.ln2": ("blocks.{l}.mlp.fc1",),
}

# Parameters that write into the residual stream (centred in the rmsnorm form).
BLOCK_WRITERS: tuple[str, ...] = ("blocks.{l}.attn.proj", "blocks.{l}.mlp.fc2")


