"""Hugging Face GPT-2: builder from a ModelConfig (untied head), key map to canonical names, symmetry spec."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from glmc.archs.base import Arch, KeyRule, require_inputs
from glmc.archs.prenorm import BLOCK_FOLDS, BLOCK_SPEC, BLOCK_WRITERS
from glmc.core.config import ModelConfig
from glmc.core.spec import NORM, RES, Axes
from glmc.errors import ConfigError

if TYPE_CHECKING:
    from transformers import GPT2LMHeadModel

# HF's Conv1D stores weights (in, out), hence transpose=True on every block linear.
_BLOCK = {
    "ln1": ("ln_1", False),
    "attn.qkv": ("attn.c_attn", True),
    "attn.proj": ("attn.c_proj", True),
    "ln2": ("ln_2", False),
    "mlp.fc1": ("mlp.c_fc", True),
    "mlp.fc2": ("mlp.c_proj", True),
}
_MODULES = {f"blocks.{{l}}.{c}": f"transformer.h.{{l}}.{n}" for c, (n, _) in _BLOCK.items()} | {
    "blocks.{l}": "transformer.h.{l}",
    "embed.tok": "transformer.wte",
    "embed.pos": "transformer.wpe",
    "norm": "transformer.ln_f",
    "head": "lm_head",
}

KEYS: dict[str, KeyRule] = {
    "embed.tok.w": KeyRule("transformer.wte.weight"),
    "embed.pos.w": KeyRule("transformer.wpe.weight"),
    "norm.w": KeyRule("transformer.ln_f.weight"),
    "norm.b": KeyRule("transformer.ln_f.bias"),
    "head.w": KeyRule("lm_head.weight"),
}
for canon, (native, transpose) in _BLOCK.items():
    KEYS[f"blocks.{{l}}.{canon}.w"] = KeyRule(f"transformer.h.{{l}}.{native}.weight", transpose)
    KEYS[f"blocks.{{l}}.{canon}.b"] = KeyRule(f"transformer.h.{{l}}.{native}.bias")

SPEC: dict[str, Axes] = {
    "embed.tok.w": (None, RES),
    "embed.pos.w": (None, RES),
    **BLOCK_SPEC,
    "norm.w": (NORM,),
    "norm.b": (RES,),  # lm_head has no bias, so ln_f's bias stays and moves with the stream
    "head.w": (None, RES),
}


def build(cfg: ModelConfig) -> GPT2LMHeadModel:
    """A standard GPT2LMHeadModel with no pretrained weights and an untied head."""
    # Imported here: transformers takes seconds to import, and a ViT-only process (every deployed ClientApp
    # starts afresh each round) never needs it.
    from transformers import GPT2Config, GPT2LMHeadModel

    if cfg.vocab_size <= 0 or cfg.context <= 0:
        raise ConfigError("a gpt2 config needs vocab_size and context set by its dataset")
    hf = GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.context,
        n_embd=cfg.width,
        n_layer=cfg.depth,
        n_head=cfg.heads,
        n_inner=cfg.mlp,
        layer_norm_epsilon=cfg.norm_eps,
        activation_function="gelu_new" if cfg.activation == "gelu" else "relu",
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = GPT2LMHeadModel(hf)
    if cfg.attn_dim != cfg.width:
        _set_head_dim(model, cfg.head_dim)
    return model


def _set_head_dim(model: GPT2LMHeadModel, head_dim: int) -> None:
    """Give every attention heads of size d_h ≠ d/H (HF ties them); used by the circuit form and width embedding."""
    from transformers.pytorch_utils import Conv1D

    for block in model.transformer.h:
        attn: Any = block.attn
        inner = attn.num_heads * head_dim
        attn.head_dim, attn.split_size, attn.scaling = head_dim, inner, head_dim**-0.5
        attn.c_attn = Conv1D(3 * inner, attn.embed_dim)
        attn.c_proj = Conv1D(attn.embed_dim, inner)


# HF activation_function → glmc's name; "gelu" in glmc is GPT-2's tanh approximation, as built above.
_ACTIVATIONS = {"gelu_new": "gelu", "relu": "relu"}


def config_of(model: nn.Module) -> ModelConfig | None:
    """The ModelConfig of an HF GPT2LMHeadModel (None for any other module); ConfigError for options glmc's spec
    does not describe (another activation, attention scaled per layer, cross-attention)."""
    from transformers import GPT2LMHeadModel

    if not isinstance(model, GPT2LMHeadModel):
        return None
    hf: Any = model.config
    if hf.activation_function not in _ACTIVATIONS:
        raise ConfigError(f"unsupported GPT-2 activation_function {hf.activation_function!r} (glmc covers "
                          f"{', '.join(_ACTIVATIONS)})")
    for option, plain in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("add_cross_attention", False)):
        if bool(getattr(hf, option, plain)) != plain:
            raise ConfigError(f"unsupported GPT-2 option {option}={getattr(hf, option)!r}")
    attn: Any = model.transformer.h[0].attn
    return ModelConfig("gpt2", width=hf.n_embd, depth=hf.n_layer, heads=hf.n_head, mlp=hf.n_inner or 4 * hf.n_embd,
                       head_dim=attn.head_dim, activation=_ACTIVATIONS[hf.activation_function],  # type: ignore[arg-type]
                       norm_eps=hf.layer_norm_epsilon, vocab_size=hf.vocab_size, context=hf.n_positions)


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B, T) token ids → (B, T, vocab) next-token logits."""
    return model(input_ids=x).logits


def check_inputs(cfg: ModelConfig, batch: torch.Tensor) -> None:
    """Token ids (N, T) with T ≤ context and every id inside the vocabulary."""
    fits = batch.dim() == 2 and 0 < batch.shape[1] <= cfg.context and not batch.is_floating_point()
    fits = fits and batch.numel() > 0 and int(batch.min()) >= 0 and int(batch.max()) < cfg.vocab_size
    require_inputs(batch, cfg, fits, f"(N, ≤{cfg.context}) integer token ids < {cfg.vocab_size}")


GPT2 = Arch(
    family="gpt2",
    keys=KEYS,
    spec=SPEC,
    folds={**BLOCK_FOLDS, "norm": ("head",)},
    writers=("embed.tok", "embed.pos", *BLOCK_WRITERS),
    build=build,
    logits=logits,
    module_names=_MODULES,
    check_inputs=check_inputs,
    config_of=config_of,
    activation_residual=False,  # a language model: the residual stays as it is (Verma & Elbayad §5.3)
)
