"""Model configurations: one frozen dataclass for both families, named presets and width multipliers."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from glmc.errors import ConfigError, check_options

Family = Literal["vit", "gpt2", "llama", "mistral", "qwen2", "neox", "bert"]

# Each family's own norm eps (timm ViT, HF GPT-2, HF's RMSNorm families, HF GPT-NeoX, HF BERT); an exact width
# embedding rescales it.
DEFAULT_NORM_EPS: dict[str, float] = {"vit": 1e-6, "gpt2": 1e-5, "llama": 1e-6, "mistral": 1e-6, "qwen2": 1e-6,
                                      "neox": 1e-5, "bert": 1e-12}
PARALLEL_FAMILIES = ("neox",)  # the families whose builders can run attention and MLP side by side
# The fields only one modality's models read (the sections of ModelConfig below): a view of a config leaves the
# other modality's out (ModelConfig.fields_read).
IMAGE_FIELDS = ("img_size", "patch", "in_chans", "num_classes", "class_token", "reg_tokens", "global_pool", "fc_norm",
                "layer_scale", "no_embed_class")
TEXT_FIELDS = ("vocab_size", "context", "rotary_pct", "rope_theta", "parallel_residual")
POOLS = ("token", "avg")  # the timm ViT poolings glmc covers


@dataclass(frozen=True)
class ModelConfig:
    """Every number that fixes a model's shape, and its dropout. Data-dependent fields (classes, vocab) are set by
    the task."""

    family: Family
    width: int  # residual width d
    depth: int  # number of blocks L
    heads: int  # attention heads H
    mlp: int  # MLP hidden width f
    head_dim: int = 0  # d_h; 0 means width // heads
    kv_heads: int = 0  # key/value heads H_kv (grouped-query attention); 0 means heads
    activation: Literal["gelu", "relu", "silu"] = "gelu"  # silu: the gated SwiGLU MLP of the Llama families
    norm_eps: float = 0.0  # LayerNorm eps; 0 means the family default
    dropout: float = 0.0  # on the embeddings, attention weights and residual writes while training (no parameters)
    # ViT only
    img_size: int = 28
    patch: int = 7
    in_chans: int = 1
    num_classes: int = 10
    # timm ViT variants (their defaults are the plain ViT glmc trains): a class token, ``reg_tokens`` register
    # tokens, pooling by the class token or the mean of the patch tokens ("avg"), the final norm after pooling
    # (``fc_norm``), biases on q, k, v, LayerScale after each branch, position embeddings on the patches only
    class_token: bool = True
    reg_tokens: int = 0
    global_pool: Literal["token", "avg"] = "token"
    fc_norm: bool = False
    qkv_bias: bool = True
    layer_scale: bool = False
    no_embed_class: bool = False
    # Language models
    vocab_size: int = 0
    context: int = 0
    # Rotary positions (the Llama families, GPT-NeoX): the share of each head's dimensions they rotate (0: none) and
    # their base
    rotary_pct: float = 0.0
    rope_theta: float = 10000.0
    # GPT-NeoX's parallel residual, x + attn(ln1(x)) + mlp(ln2(x)), rather than the MLP reading x + attn(ln1(x))
    parallel_residual: bool = False

    def __post_init__(self) -> None:
        if self.head_dim == 0 and self.heads > 0:  # heads ≤ 0 is reported with the other sizes below
            if self.width % self.heads:
                raise ConfigError(f"width {self.width} is not divisible by heads {self.heads}")
            object.__setattr__(self, "head_dim", self.width // self.heads)
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.norm_eps == 0.0:
            object.__setattr__(self, "norm_eps", DEFAULT_NORM_EPS[self.family])
        for sizes in (("width", "depth", "heads", "mlp"), ("head_dim",)):  # head_dim after the sizes it comes from
            check_options("model config", [("≥ 1", lambda v: v >= 1, {k: getattr(self, k) for k in sizes})])
        if self.global_pool not in POOLS:
            raise ConfigError(f"global_pool must be one of {POOLS}, got {self.global_pool!r}")
        if self.global_pool == "token" and not self.class_token:
            raise ConfigError("global_pool 'token' needs the class token (class_token=False pools by 'avg')")
        check_options("model config", [("≥ 0", lambda v: v >= 0, {"reg_tokens": self.reg_tokens})])
        check_options("model config", [("in [0, 1)", lambda v: 0 <= v < 1, {"dropout": self.dropout})])
        if self.heads % self.kv_heads:
            raise ConfigError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.parallel_residual and self.family not in PARALLEL_FAMILIES:
            raise ConfigError(f"a {self.family} model has a sequential residual: parallel_residual needs one of "
                              f"{', '.join(PARALLEL_FAMILIES)}")
        if not 0 <= self.rotary_pct <= 1 or self.rotary_dim % 2:
            raise ConfigError(f"rotary_pct {self.rotary_pct} must be in [0, 1] and rotate an even number of the "
                              f"{self.head_dim} head dimensions")

    @property
    def attn_dim(self) -> int:
        """Width of the concatenated heads, H·d_h (equal to d unless d_h is set apart)."""
        return self.heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dimensions rotary positions rotate (HF: ``int(head_dim · rotary_pct)``)."""
        return int(self.head_dim * self.rotary_pct)

    @property
    def group(self) -> int:
        """Query heads per key/value head, G = H / H_kv."""
        return self.heads // self.kv_heads

    def fields_read(self, modality: Literal["image", "text"]) -> dict[str, Any]:
        """:meth:`to_dict` without the fields that only models of the other modality read (a Llama has no patch)."""
        unread = TEXT_FIELDS if modality == "image" else IMAGE_FIELDS
        return {k: v for k, v in self.to_dict().items() if k not in unread}

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed; head_dim (and kv_heads, where it equalled heads) re-derived unless
        given."""
        if "head_dim" not in changes and ({"width", "heads"} & changes.keys()):
            changes["head_dim"] = 0
        if "kv_heads" not in changes and "heads" in changes and self.kv_heads == self.heads:
            changes["kv_heads"] = 0
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown model config fields: {sorted(unknown)}")
        return cls(**data)


PRESETS: dict[str, ModelConfig] = {
    "vit-tiny": ModelConfig("vit", width=32, depth=2, heads=2, mlp=64),
    "vit-bench": ModelConfig("vit", width=128, depth=6, heads=4, mlp=256),
    # The cross-device grids' ViT: vit-bench's four heads (tiers 1/2 and 1/4 keep whole heads) at a quarter of its
    # cost per step (22 ms against 69 ms for a batch of 32 on one core), so that 100-client runs reach a plateau.
    "vit-fl": ModelConfig("vit", width=64, depth=4, heads=4, mlp=128),
    "vit-paper": ModelConfig("vit", width=256, depth=6, heads=8, mlp=512),
    "gpt2-tiny": ModelConfig("gpt2", width=32, depth=2, heads=2, mlp=64, context=32),
    "gpt2-bench": ModelConfig("gpt2", width=128, depth=4, heads=4, mlp=512, context=128),
    # The official GLMC code's GPT-2 (n_embd 256, 6 layers, 4 heads, MLP 1024, context 256), trained with dropout 0.1.
    "gpt2-paper": ModelConfig("gpt2", width=256, depth=6, heads=4, mlp=1024, context=256, dropout=0.1),
    # A Llama of the same size as gpt2-tiny: RMSNorm, SwiGLU, rotary positions, two query heads per KV head.
    "llama-tiny": ModelConfig("llama", width=32, depth=2, heads=4, kv_heads=2, mlp=64, activation="silu",
                              qkv_bias=False, rotary_pct=1.0, context=32),
    # The cross-device text grid's Llama: llama-tiny's shape with four KV groups (so tier 1/4 keeps a whole group,
    # two query heads each) at twice its width; head_dim 8.
    "llama-fl": ModelConfig("llama", width=64, depth=2, heads=8, kv_heads=4, mlp=128, activation="silu",
                            qkv_bias=False, rotary_pct=1.0, context=32),
    # A Pythia-shaped GPT-NeoX of the same size: parallel residual, rotary positions on a quarter of each head.
    "neox-tiny": ModelConfig("neox", width=32, depth=2, heads=4, mlp=128, rotary_pct=0.25, parallel_residual=True,
                             context=32),
    # A BERT masked language model of gpt2-tiny's width: post-LayerNorm, four heads, MLP 4·d.
    "bert-tiny": ModelConfig("bert", width=32, depth=2, heads=4, mlp=128, context=32),
}


def preset(name: str) -> ModelConfig:
    """The named preset, or a ConfigError listing the known ones."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def scale_width(cfg: ModelConfig, mult: float) -> ModelConfig:
    """Scale d, f and the KV heads H_kv by ``mult`` with d_h and the query heads per KV head G fixed: below 1 as
    HeteroFL-style width tiers do (whole KV groups, so that grouped queries keep their groups, and whole heads, so
    that rotary positions keep their frequencies), above 1 for a wider model of the same shape (the federated tiers
    check their own range)."""
    if not 0 < mult < math.inf:  # NaN fails too
        raise ConfigError(f"width multiplier must be positive and finite, got {mult}")
    heads = f"{cfg.kv_heads} heads" if cfg.kv_heads == cfg.heads else f"{cfg.kv_heads} KV heads (whole groups)"
    kv, mlp, width = (_scaled(size, mult, label) for size, label in
                      ((cfg.kv_heads, heads), (cfg.mlp, f"MLP width {cfg.mlp}"), (cfg.width, f"width {cfg.width}")))
    return cfg.replace(width=width, heads=kv * cfg.group, kv_heads=kv, mlp=mlp, head_dim=cfg.head_dim)


def _scaled(size: int, mult: float, label: str) -> int:
    """size·mult (positive, as mult is), or a ConfigError naming ``label`` where it is no whole number."""
    scaled = size * mult
    if abs(scaled - round(scaled)) > 1e-9:
        raise ConfigError(f"width multiplier {mult} does not divide the {label}")
    return round(scaled)
