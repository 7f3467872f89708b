"""Hugging Face GPT-NeoX (``GPTNeoXForCausalLM``, the Pythia models): pre-LayerNorm with biases, one fused q|k|v
projection interleaved per head, partial rotary positions, a plain MLP, and a parallel or sequential residual,
declared as data.

The fused ``query_key_value`` holds each head's q, k and v rows one after another, ``[head 0: q, k, v; head 1: …]``
(its output is viewed as (H, 3·d_h) and chunked): the key map reads it as separate canonical ``attn.q/k/v`` (axis
kinds Q, K, V, with no grouped queries) and joins them back on writing. Folding a LayerNorm leaves a plain one,
which commutes with the orthogonal maps that fix the ones vector, as GPT-2's. Rotary positions rotate the first
``rotary_pct`` of each head's dimensions, pairing dimension i with i + r/2 (``rotate_half`` on those r): the q/k
maps are, per frequency pair, a rotation times a scale, and any invertible map on the dimensions left alone
(:func:`glmc.symmetry.groups.random_rotary`).

A parallel residual (Pythia's ``use_parallel_residual``: x + attn(ln1(x)) + mlp(ln2(x))) and a sequential one have the
same symmetries, and the block's modules run in the spec's order in both (attention, then the MLP), which is all
refit and REPAIR ask of it: each hook sees its layer's actual input, whichever the MLP reads.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from glmc.archs.base import Arch, KeyRule, Part
from glmc.archs.gpt2 import check_inputs, logits  # token ids in, next-token logits out, as GPT-2
from glmc.core.config import ModelConfig
from glmc.core.spec import HEADS, MLP, MLP_IN, NORM, RES, Axes, K, Q, V
from glmc.errors import ConfigError

LAYER = "gpt_neox.layers.{l}"
_FUSED = f"{LAYER}.attention.query_key_value"
# canonical module -> HF module inside a layer, and whether its bias is optional (``attention_bias``)
_BLOCK: dict[str, tuple[str, bool]] = {
    "ln1": ("input_layernorm", False),
    "attn.proj": ("attention.dense", True),
    "ln2": ("post_attention_layernorm", False),
    "mlp.fc1": ("mlp.dense_h_to_4h", False),
    "mlp.fc2": ("mlp.dense_4h_to_h", False),
}
_QKV = ("attn.q", "attn.k", "attn.v")  # the slots of the fused projection, in each head's order
_MODULES = ({f"blocks.{{l}}.{c}": f"{LAYER}.{n}" for c, (n, _) in _BLOCK.items()}
            | {f"blocks.{{l}}.{c}": _FUSED for c in _QKV}  # one module computes the three (Arch.output_part)
            | {"blocks.{l}": LAYER, "embed.tok": "gpt_neox.embed_in", "norm": "gpt_neox.final_layer_norm",
               "head": "lm_head"})

KEYS: dict[str, KeyRule] = {
    "embed.tok.w": KeyRule("gpt_neox.embed_in.weight"),
    "norm.w": KeyRule("gpt_neox.final_layer_norm.weight"),
    "norm.b": KeyRule("gpt_neox.final_layer_norm.bias"),
    "head.w": KeyRule("lm_head.weight"),  # transformers renames the Hub's older ``embed_out`` on loading
}
for canon, (native, optional) in _BLOCK.items():
    KEYS[f"blocks.{{l}}.{canon}.w"] = KeyRule(f"{LAYER}.{native}.weight")
    KEYS[f"blocks.{{l}}.{canon}.b"] = KeyRule(f"{LAYER}.{native}.bias", optional=optional)
for slot, canon in enumerate(_QKV):
    part = Part(slot, len(_QKV), per_head=True)
    KEYS[f"blocks.{{l}}.{canon}.w"] = KeyRule(f"{_FUSED}.weight", part=part)
    KEYS[f"blocks.{{l}}.{canon}.b"] = KeyRule(f"{_FUSED}.bias", optional=True, part=part)

SPEC: dict[str, Axes] = {
    "embed.tok.w": (None, RES),
    "blocks.{l}.ln1.w": (NORM,),
    "blocks.{l}.ln1.b": (RES,),  # folded into q, k, v's biases; kept (as β/γ) where attention has none
    "blocks.{l}.attn.q.w": (Q, RES),
    "blocks.{l}.attn.q.b": (Q,),
    "blocks.{l}.attn.k.w": (K, RES),
    "blocks.{l}.attn.k.b": (K,),
    "blocks.{l}.attn.v.w": (V, RES),
    "blocks.{l}.attn.v.b": (V,),
    "blocks.{l}.attn.proj.w": (RES, HEADS),
    "blocks.{l}.attn.proj.b": (RES,),
    "blocks.{l}.ln2.w": (NORM,),
    "blocks.{l}.ln2.b": (RES,),
    "blocks.{l}.mlp.fc1.w": (MLP, RES),
    "blocks.{l}.mlp.fc1.b": (MLP,),
    "blocks.{l}.mlp.fc2.w": (RES, MLP_IN),
    "blocks.{l}.mlp.fc2.b": (RES,),
    "norm.w": (NORM,),
    "norm.b": (RES,),  # lm_head has no bias, so the final norm's bias stays and moves with the stream
    "head.w": (None, RES),
}

# HF hidden_act → glmc's activation: the exact GELU (glmc's "gelu" for this family) and ReLU (whose units scale).
_ACTIVATIONS = {"gelu": "gelu", "relu": "relu"}
_HIDDEN_ACT = {v: k for k, v in _ACTIVATIONS.items()}


def build(cfg: ModelConfig) -> nn.Module:
    """A standard GPTNeoXForCausalLM with no pretrained weights, an untied head and no special tokens."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    if cfg.vocab_size <= 0 or cfg.context <= 0:
        raise ConfigError("a neox config needs vocab_size and context set by its dataset")
    if cfg.activation not in _HIDDEN_ACT or cfg.kv_heads != cfg.heads or cfg.attn_dim != cfg.width:
        raise ConfigError(f"a neox model has a {' or '.join(_HIDDEN_ACT)} MLP and heads of width/heads with no "
                          f"grouped queries (activation {cfg.activation!r}, {cfg.kv_heads} KV heads of "
                          f"{cfg.heads}, head_dim {cfg.head_dim})")
    hf = GPTNeoXConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.width, num_hidden_layers=cfg.depth,
        num_attention_heads=cfg.heads, intermediate_size=cfg.mlp, hidden_act=_HIDDEN_ACT[cfg.activation],
        max_position_embeddings=cfg.context, layer_norm_eps=cfg.norm_eps, attention_bias=cfg.qkv_bias,
        use_parallel_residual=cfg.parallel_residual, attention_dropout=cfg.dropout, hidden_dropout=cfg.dropout,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.rotary_pct},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return GPTNeoXForCausalLM(hf)


def _refuse_unmodelled(hf: Any) -> None:
    """ConfigError naming the first option glmc's spec does not describe, rather than approximating it."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"unsupported neox rope_type {rope['rope_type']!r} (glmc covers 'default')")
    if hf.hidden_act not in _ACTIVATIONS:
        raise ConfigError(f"unsupported neox hidden_act {hf.hidden_act!r} (glmc covers {', '.join(_ACTIVATIONS)})")
    rotary = int(hf.hidden_size // hf.num_attention_heads * rope.get("partial_rotary_factor", 1.0))
    if rotary % 2:
        raise ConfigError(f"unsupported neox rotary dimensions {rotary}: rotate_half pairs an even number")


def config_of(model: nn.Module) -> ModelConfig | None:
    """The ModelConfig of a live GPTNeoXForCausalLM (None for any other module)."""
    if type(model).__name__ != "GPTNeoXForCausalLM" or not hasattr(model, "config"):
        return None
    hf: Any = model.config
    _refuse_unmodelled(hf)
    rope = dict(hf.rope_parameters or {})
    return ModelConfig("neox", width=hf.hidden_size, depth=hf.num_hidden_layers, heads=hf.num_attention_heads,
                       mlp=hf.intermediate_size, activation=_ACTIVATIONS[hf.hidden_act],  # type: ignore[arg-type]
                       norm_eps=hf.layer_norm_eps, vocab_size=hf.vocab_size, context=hf.max_position_embeddings,
                       rotary_pct=float(rope.get("partial_rotary_factor", 1.0)),
                       rope_theta=float(rope.get("rope_theta", 10000.0)), qkv_bias=bool(hf.attention_bias),
                       parallel_residual=bool(hf.use_parallel_residual))


NEOX = Arch(
    family="neox",
    keys=KEYS,
    spec=SPEC,
    folds={"blocks.{l}.ln1": tuple(f"blocks.{{l}}.{c}" for c in _QKV), "blocks.{l}.ln2": ("blocks.{l}.mlp.fc1",),
           "norm": ("head",)},
    writers=("embed.tok", "blocks.{l}.attn.proj", "blocks.{l}.mlp.fc2"),
    build=build,
    logits=logits,
    module_names=_MODULES,
    check_inputs=check_inputs,
    config_of=config_of,
    activation_residual=False,  # a language model: the residual stays as it is (Verma & Elbayad §5.3)
    hf_class="GPTNeoXForCausalLM",
    hf_model_type="gpt_neox",
)
