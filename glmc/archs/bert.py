"""Hugging Face BERT (``BertForMaskedLM``): a post-LayerNorm encoder with separate q/k/v projections, learned
absolute positions, token types, a GELU MLP and a masked-language-model head tied to the word embeddings, declared
as data.

Every LayerNorm sits on the stream itself (x = LN(x + attn(x)); x = LN(x + mlp(x))), so none folds into a reader and
only the permutations of the stream commute with them: the residual group is the permutations (``norm="post"``),
each norm's gain and bias a residual vector that moves with the stream. The MLM head's transform reads and writes the
stream's space (its LayerNorm feeds the decoder, which is the word embedding), so it is (RES, RES). Without rotary
positions the q/k maps are any invertible M, M⁻ᵀ and the v/o maps any invertible N, as in GPT-2.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from glmc.archs.base import Arch, KeyRule
from glmc.archs.gpt2 import check_inputs, logits  # token ids in, per-token logits out, as GPT-2
from glmc.core.config import ModelConfig
from glmc.core.spec import HEADS, MLP, MLP_IN, RES, Axes, K, Q, V
from glmc.errors import ConfigError

LAYER = "bert.encoder.layer.{l}."
# canonical module -> HF module inside ``bert.encoder.layer.{l}``, in forward order
_BLOCK = {
    "attn.q": "attention.self.query",
    "attn.k": "attention.self.key",
    "attn.v": "attention.self.value",
    "attn.proj": "attention.output.dense",
    "ln1": "attention.output.LayerNorm",
    "mlp.fc1": "intermediate.dense",
    "mlp.fc2": "output.dense",
    "ln2": "output.LayerNorm",
}
_OUTSIDE = {
    "embed.tok": "bert.embeddings.word_embeddings",
    "embed.pos": "bert.embeddings.position_embeddings",
    "embed.type": "bert.embeddings.token_type_embeddings",
    "embed.norm": "bert.embeddings.LayerNorm",
    "head.dense": "cls.predictions.transform.dense",
    "head.norm": "cls.predictions.transform.LayerNorm",
}
_MODULES = {f"blocks.{{l}}.{c}": LAYER + n for c, n in _BLOCK.items()} | _OUTSIDE | {
    "blocks.{l}": "bert.encoder.layer.{l}", "head": "cls.predictions.decoder"}

KEYS: dict[str, KeyRule] = {
    "embed.tok.w": KeyRule("bert.embeddings.word_embeddings.weight"),
    "embed.pos.w": KeyRule("bert.embeddings.position_embeddings.weight"),
    "embed.type.w": KeyRule("bert.embeddings.token_type_embeddings.weight"),
}
for canon in ("embed.norm", "head.dense", "head.norm"):
    KEYS[f"{canon}.w"], KEYS[f"{canon}.b"] = KeyRule(f"{_OUTSIDE[canon]}.weight"), KeyRule(f"{_OUTSIDE[canon]}.bias")
for canon, native in _BLOCK.items():
    KEYS[f"blocks.{{l}}.{canon}.w"] = KeyRule(f"{LAYER}{native}.weight")
    KEYS[f"blocks.{{l}}.{canon}.b"] = KeyRule(f"{LAYER}{native}.bias")
KEYS["head.b"] = KeyRule("cls.predictions.bias")
# The decoder is the word embedding, and its bias the head's (transformers ties both pairs).
TIED = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias"}

SPEC: dict[str, Axes] = {
    "embed.tok.w": (None, RES),
    "embed.pos.w": (None, RES),
    "embed.type.w": (None, RES),
    "embed.norm.w": (RES,),  # a post-LayerNorm's gain and bias move with the stream
    "embed.norm.b": (RES,),
    "blocks.{l}.attn.q.w": (Q, RES),
    "blocks.{l}.attn.q.b": (Q,),
    "blocks.{l}.attn.k.w": (K, RES),
    "blocks.{l}.attn.k.b": (K,),
    "blocks.{l}.attn.v.w": (V, RES),
    "blocks.{l}.attn.v.b": (V,),
    "blocks.{l}.attn.proj.w": (RES, HEADS),
    "blocks.{l}.attn.proj.b": (RES,),
    "blocks.{l}.ln1.w": (RES,),
    "blocks.{l}.ln1.b": (RES,),
    "blocks.{l}.mlp.fc1.w": (MLP, RES),
    "blocks.{l}.mlp.fc1.b": (MLP,),
    "blocks.{l}.mlp.fc2.w": (RES, MLP_IN),
    "blocks.{l}.mlp.fc2.b": (RES,),
    "blocks.{l}.ln2.w": (RES,),
    "blocks.{l}.ln2.b": (RES,),
    "head.dense.w": (RES, RES),  # reads the stream and writes what the tied decoder reads: its space too
    "head.dense.b": (RES,),
    "head.norm.w": (RES,),
    "head.norm.b": (RES,),
    "head.b": (None,),
}

TYPE_VOCAB = 2  # token types glmc builds (sentence A and B, BERT's default); every input is of type 0
# glmc's activation → HF hidden_act: BERT's GELU is the exact (erf) one
_ACTIVATIONS = {"gelu": "gelu", "relu": "relu"}


def build(cfg: ModelConfig) -> nn.Module:
    """A standard BertForMaskedLM with no pretrained weights: tied decoder, no pooler, absolute positions."""
    from transformers import BertConfig, BertForMaskedLM

    if cfg.vocab_size <= 0 or cfg.context <= 0:
        raise ConfigError("a bert config needs vocab_size and context set by its dataset")
    if cfg.activation not in _ACTIVATIONS or cfg.attn_dim != cfg.width or cfg.kv_heads != cfg.heads:
        raise ConfigError("a bert model has a GELU or ReLU MLP and heads of width/heads, without grouped queries")
    if not cfg.qkv_bias or cfg.rotary_pct:
        raise ConfigError("a bert model has q/k/v biases and no rotary positions: set qkv_bias=True, rotary_pct=0")
    hf = BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.width, num_hidden_layers=cfg.depth,
        num_attention_heads=cfg.heads, intermediate_size=cfg.mlp, hidden_act=_ACTIVATIONS[cfg.activation],
        hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.dropout,
        max_position_embeddings=cfg.context, type_vocab_size=TYPE_VOCAB, layer_norm_eps=cfg.norm_eps,
        pad_token_id=None, tie_word_embeddings=True,
    )
    return BertForMaskedLM(hf)


def _refuse_unmodelled(model: Any, hf: Any) -> None:
    """ConfigError naming the first option glmc's spec does not describe, rather than approximating it."""
    if getattr(hf, "position_embedding_type", "absolute") != "absolute":
        raise ConfigError(f"unsupported bert position_embedding_type {hf.position_embedding_type!r} (glmc covers "
                          "'absolute')")
    for option in ("is_decoder", "add_cross_attention"):
        if getattr(hf, option, False):
            raise ConfigError(f"unsupported bert option {option}=True (glmc covers the encoder)")
    if getattr(hf, "hidden_act", "gelu") not in _ACTIVATIONS.values():
        raise ConfigError(f"unsupported bert hidden_act {hf.hidden_act!r} (glmc covers "
                          f"{', '.join(_ACTIVATIONS.values())})")
    if not getattr(hf, "tie_word_embeddings", True):
        raise ConfigError("unsupported bert option tie_word_embeddings=False (glmc covers the decoder tied to the "
                          "word embeddings)")
    if getattr(model.bert, "pooler", None) is not None:
        raise ConfigError("unsupported bert pooler: glmc covers BertForMaskedLM without one")
    if getattr(hf, "type_vocab_size", TYPE_VOCAB) != TYPE_VOCAB:
        raise ConfigError(f"unsupported bert type_vocab_size={hf.type_vocab_size} (glmc builds {TYPE_VOCAB})")


def config_of(model: nn.Module) -> ModelConfig | None:
    """The ModelConfig of a live BertForMaskedLM (None for any other module)."""
    if type(model).__name__ != "BertForMaskedLM" or not hasattr(model, "config"):
        return None
    hf: Any = model.config
    _refuse_unmodelled(model, hf)
    activation = next(k for k, v in _ACTIVATIONS.items() if v == hf.hidden_act)
    return ModelConfig("bert", width=hf.hidden_size, depth=hf.num_hidden_layers, heads=hf.num_attention_heads,
                       mlp=hf.intermediate_size, activation=activation,  # type: ignore[arg-type]
                       norm_eps=hf.layer_norm_eps, vocab_size=hf.vocab_size, context=hf.max_position_embeddings)


BERT = Arch(
    family="bert",
    keys=KEYS,
    spec=SPEC,
    folds={},  # every norm is on the stream: none folds
    writers=("embed.tok", "embed.pos", "embed.type", "blocks.{l}.attn.proj", "blocks.{l}.mlp.fc2"),
    build=build,
    logits=logits,
    module_names=_MODULES,
    check_inputs=check_inputs,
    config_of=config_of,
    activation_residual=False,  # a language model (Verma & Elbayad §5.3)
    norm="post",
    hf_class="BertForMaskedLM",
    objective="masked",
    tied=TIED,
)
