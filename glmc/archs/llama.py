"""The Llama families of Hugging Face (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``): RMSNorm,
separate q/k/v projections with grouped-query attention, rotary positions and a SwiGLU MLP, declared as data.

The three differ only in their classes and where their attention has biases (Llama: an option on q, k, v and o;
Qwen2: always on q, k, v; Mistral: none), so one declaration serves them. Folding an RMSNorm's gain into its readers
leaves a plain RMSNorm, which commutes with every orthogonal map of the stream: the residual group is the whole
O(d). Rotary positions restrict the q/k maps to those commuting with every rotation (per frequency pair, a rotation
times a scale: :func:`glmc.symmetry.groups.random_rotary`); the gated MLP admits a per-unit scale on ``up``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from glmc.archs.base import Arch, KeyRule
from glmc.archs.gpt2 import check_inputs, logits  # token ids in, next-token logits out, as GPT-2
from glmc.core.config import ModelConfig
from glmc.core.spec import HEADS, MLP, MLP_GATE, MLP_IN, NORM, RES, Axes, K, Q, V
from glmc.errors import ConfigError

# canonical module -> HF module inside ``model.layers.{l}``, and whether some variants have its bias
_BLOCK: dict[str, tuple[str, bool]] = {
    "ln1": ("input_layernorm", False),
    "attn.q": ("self_attn.q_proj", True),
    "attn.k": ("self_attn.k_proj", True),
    "attn.v": ("self_attn.v_proj", True),
    "attn.proj": ("self_attn.o_proj", True),
    "ln2": ("post_attention_layernorm", False),
    "mlp.gate": ("mlp.gate_proj", False),
    "mlp.fc1": ("mlp.up_proj", False),
    "mlp.fc2": ("mlp.down_proj", False),
}
_BIASED = tuple(c for c, (_, biased) in _BLOCK.items() if biased)
_MODULES = {f"blocks.{{l}}.{c}": f"model.layers.{{l}}.{n}" for c, (n, _) in _BLOCK.items()} | {
    "blocks.{l}": "model.layers.{l}",
    "embed.tok": "model.embed_tokens",
    "norm": "model.norm",
    "head": "lm_head",
}

KEYS: dict[str, KeyRule] = {
    "embed.tok.w": KeyRule("model.embed_tokens.weight"),
    "norm.w": KeyRule("model.norm.weight"),
    "head.w": KeyRule("lm_head.weight"),
}
for canon, (native, biased) in _BLOCK.items():
    KEYS[f"blocks.{{l}}.{canon}.w"] = KeyRule(f"model.layers.{{l}}.{native}.weight")
    if biased:
        KEYS[f"blocks.{{l}}.{canon}.b"] = KeyRule(f"model.layers.{{l}}.{native}.bias", optional=True)

SPEC: dict[str, Axes] = {
    "embed.tok.w": (None, RES),
    "blocks.{l}.ln1.w": (NORM,),
    "blocks.{l}.attn.q.w": (Q, RES),
    "blocks.{l}.attn.q.b": (Q,),
    "blocks.{l}.attn.k.w": (K, RES),
    "blocks.{l}.attn.k.b": (K,),
    "blocks.{l}.attn.v.w": (V, RES),
    "blocks.{l}.attn.v.b": (V,),
    "blocks.{l}.attn.proj.w": (RES, HEADS),
    "blocks.{l}.attn.proj.b": (RES,),
    "blocks.{l}.ln2.w": (NORM,),
    "blocks.{l}.mlp.gate.w": (MLP_GATE, RES),
    "blocks.{l}.mlp.fc1.w": (MLP, RES),
    "blocks.{l}.mlp.fc2.w": (RES, MLP_IN),
    "norm.w": (NORM,),
    "head.w": (None, RES),
}


@dataclass(frozen=True)
class _Variant:
    """What tells the three families apart: their classes and which attention projections carry biases."""

    family: str
    model_class: str
    config_class: str
    biases: tuple[str, ...]  # the canonical modules with biases when ``qkv_bias`` is set
    bias_option: bool  # whether ``qkv_bias`` is a choice (Llama's attention_bias) or fixed by the family
    windowed: bool = False  # whether its config sets a sliding window unless told otherwise (Mistral)


_VARIANTS = {
    "llama": _Variant("llama", "LlamaForCausalLM", "LlamaConfig", _BIASED, True),
    "mistral": _Variant("mistral", "MistralForCausalLM", "MistralConfig", (), False, windowed=True),
    "qwen2": _Variant("qwen2", "Qwen2ForCausalLM", "Qwen2Config", ("attn.q", "attn.k", "attn.v"), False),
}


def _classes(variant: _Variant) -> tuple[Any, Any]:
    """The variant's (config class, model class); transformers is imported only when a model is built or read."""
    import transformers

    return getattr(transformers, variant.config_class), getattr(transformers, variant.model_class)


def _require_biases(variant: _Variant, cfg: ModelConfig) -> None:
    """ConfigError where the config asks for attention biases the family does not have (or lacks ones it has)."""
    if not variant.bias_option and cfg.qkv_bias != bool(variant.biases):
        raise ConfigError(f"a {variant.family} model has {'q/k/v biases' if variant.biases else 'no attention biases'}"
                          f": set qkv_bias={bool(variant.biases)}")


def _build(variant: _Variant, cfg: ModelConfig) -> nn.Module:
    """A standard HF model of the variant with no pretrained weights, an untied head and full-length attention."""
    if cfg.vocab_size <= 0 or cfg.context <= 0:
        raise ConfigError(f"a {variant.family} config needs vocab_size and context set by its dataset")
    if cfg.activation != "silu" or cfg.rotary_pct != 1.0:
        raise ConfigError(f"a {variant.family} model has a SwiGLU MLP and rotary positions on every head dimension: "
                          "set activation='silu' and rotary_pct=1.0")
    _require_biases(variant, cfg)
    config_class, model_class = _classes(variant)
    hf = config_class(
        vocab_size=cfg.vocab_size, hidden_size=cfg.width, intermediate_size=cfg.mlp, num_hidden_layers=cfg.depth,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.context, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, attention_dropout=cfg.dropout,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        **({"attention_bias": cfg.qkv_bias} if variant.bias_option else {}),
        **({"sliding_window": None} if variant.windowed else {}),
    )
    return model_class(hf)


def _refuse_unmodelled(variant: _Variant, hf: Any) -> None:
    """ConfigError naming the first option glmc's spec does not describe, rather than approximating it."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"unsupported {variant.family} rope_type {rope['rope_type']!r} (glmc covers 'default')")
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported {variant.family} hidden_act {hf.hidden_act!r} (glmc covers 'silu')")
    if getattr(hf, "mlp_bias", False):
        raise ConfigError(f"unsupported {variant.family} option mlp_bias=True")
    window = getattr(hf, "sliding_window", None)
    if window is not None and (variant.windowed or getattr(hf, "use_sliding_window", False)) \
            and window < hf.max_position_embeddings:
        raise ConfigError(f"unsupported {variant.family} sliding_window={window} below max_position_embeddings "
                          f"{hf.max_position_embeddings}")
    if getattr(hf, "pretraining_tp", 1) != 1:
        raise ConfigError(f"unsupported {variant.family} option pretraining_tp={hf.pretraining_tp}")


def _config_of(variant: _Variant, model: nn.Module) -> ModelConfig | None:
    """The ModelConfig of a live model of the variant's class (None for any other module)."""
    if type(model).__name__ != variant.model_class or not hasattr(model, "config"):
        return None
    hf: Any = model.config
    _refuse_unmodelled(variant, hf)
    live: Any = model
    attn: Any = live.model.layers[0].self_attn
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    biased = attn.q_proj.bias is not None
    return ModelConfig(variant.family, width=hf.hidden_size, depth=hf.num_hidden_layers,  # type: ignore[arg-type]
                       heads=hf.num_attention_heads, kv_heads=hf.num_key_value_heads, mlp=hf.intermediate_size,
                       head_dim=attn.head_dim, activation="silu", norm_eps=hf.rms_norm_eps,
                       vocab_size=hf.vocab_size, context=hf.max_position_embeddings, rotary_pct=1.0,
                       rope_theta=float(rope.get("rope_theta", 10000.0)), qkv_bias=biased)


def _arch(variant: _Variant) -> Arch:
    return Arch(
        family=variant.family,
        keys=KEYS,
        spec=SPEC,
        folds={"blocks.{l}.ln1": ("blocks.{l}.attn.q", "blocks.{l}.attn.k", "blocks.{l}.attn.v"),
               "blocks.{l}.ln2": ("blocks.{l}.mlp.gate", "blocks.{l}.mlp.fc1"), "norm": ("head",)},
        writers=("embed.tok", "blocks.{l}.attn.proj", "blocks.{l}.mlp.fc2"),
        build=lambda cfg: _build(variant, cfg),
        logits=logits,
        module_names=_MODULES,
        check_inputs=check_inputs,
        config_of=lambda model: _config_of(variant, model),
        activation_residual=False,  # language models (Verma & Elbayad §5.3)
        norm="rms",
        hf_class=variant.model_class,
    )


LLAMA, MISTRAL, QWEN2 = (_arch(_VARIANTS[name]) for name in ("llama", "mistral", "qwen2"))
