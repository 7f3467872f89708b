"""The description of one architecture family: builder, key map to canonical names, and symmetry spec."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from glmc.core.config import ModelConfig
from glmc.core.spec import SpecTable, expand
from glmc.core.state import Lazy, State
from glmc.errors import CheckpointError, ConfigError


@dataclass(frozen=True)
class Part:
    """Slot ``index`` of ``count`` equal parts of a fused tensor's axis (the rows of a fused q|k|v, or its
    output's features): one block after another (``per_head=False``), or interleaved per head, ``[head 0: part 0,
    part 1, …; head 1: …]`` (GPT-NeoX's ``query_key_value``), over the config's heads."""

    index: int
    count: int
    per_head: bool = False

    def _split(self, fused: torch.Tensor, heads: int, axis: int) -> torch.Tensor:
        """``fused`` with ``axis`` moved first and split: (count, ...) in blocks, (heads, count, ...) per head."""
        x = fused.movedim(axis, 0)
        size, rest = x.shape[0], x.shape[1:]
        if self.per_head:
            return x.reshape(heads, self.count, size // (heads * self.count), *rest)
        return x.reshape(self.count, size // self.count, *rest)

    def take(self, fused: torch.Tensor, heads: int, axis: int = 0) -> torch.Tensor:
        """This part of ``fused`` along ``axis``."""
        x = self._split(fused, heads, axis)
        part = x[:, self.index] if self.per_head else x[self.index]
        return part.reshape(-1, *part.shape[(2 if self.per_head else 1):]).movedim(0, axis)

    def join(self, parts: Sequence[torch.Tensor], heads: int, axis: int = 0) -> torch.Tensor:
        """The fused tensor whose ``count`` parts (in slot order) are ``parts``: the inverse of :meth:`take`."""
        if len(parts) != self.count:
            raise CheckpointError(f"a fused tensor of {self.count} parts cannot be joined from {len(parts)}")
        xs = [p.movedim(axis, 0) for p in parts]
        if self.per_head:
            fused = torch.stack([x.reshape(heads, -1, *x.shape[1:]) for x in xs], 1)
            return fused.reshape(-1, *fused.shape[3:]).movedim(0, axis)
        return torch.cat(xs).movedim(0, axis)

    def put(self, fused: torch.Tensor, part: torch.Tensor, heads: int, axis: int = 0) -> torch.Tensor:
        """``fused`` with this part replaced by ``part``."""
        slots = [Part(i, self.count, self.per_head) for i in range(self.count)]
        return self.join([part if i == self.index else s.take(fused, heads, axis) for i, s in enumerate(slots)],
                         heads, axis)


@dataclass(frozen=True)
class KeyRule:
    """Where a canonical parameter lives in the native state dict, whether it is stored (in, out), whether
    some variants of the family go without it (a ViT without class token or qkv bias; the config's builder
    decides which are present, and loading a native state into it checks that they are), and which part of the
    native tensor's rows it is, where one native tensor holds several canonical ones (a fused q|k|v that the
    canonical names keep separate)."""

    native: str
    transpose: bool = False
    optional: bool = False
    part: Part | None = None


@dataclass(frozen=True)
class Arch:
    """One family: everything the algorithms need, and nothing they must branch on."""

    family: str
    keys: Mapping[str, KeyRule]  # canonical template -> native template
    spec: SpecTable  # canonical template -> axis kinds
    folds: Mapping[str, tuple[str, ...]]  # LayerNorm prefix -> reader prefixes
    writers: tuple[str, ...]  # prefixes of the residual writers (weights and biases)
    build: Callable[[ModelConfig], nn.Module]
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    module_names: Mapping[str, str]  # canonical module prefix -> native module path (for hooks)
    check_inputs: Callable[[ModelConfig, torch.Tensor], None]  # ConfigError unless a batch fits the model
    # The config of a live model of this family as its library built it (timm, transformers), None for another
    # family's module; ConfigError for a variant the spec does not describe.
    config_of: Callable[[nn.Module], ModelConfig | None]
    # Activation matching permutes the residual stream by its correlations. Verma & Elbayad do so for classifiers
    # and keep the identity for language modelling, where every residual permutation they tried raised the barrier
    # (their §5.3, Table 2). Measured on seeds 0, 1: vit-bench 0.92 with it, 1.70 without; gpt2-bench 1.58 and 1.48
    # (vanilla 1.50).
    activation_residual: bool = True
    # LayerScale prefix -> the residual writer whose output rows it scales (folded into it when canonicalising)
    scales: Mapping[str, str] = field(default_factory=dict)
    # The stream's norm once its gain is folded: a LayerNorm commutes with the orthogonal maps that fix the ones
    # vector, an RMSNorm with all of O(d); a post-LayerNorm (BERT: x = LN(x + f(x))) cannot fold, and only permutations
    # of the stream commute with it, its gain and bias moving with the stream (declared as residual vectors).
    norm: Literal["layer", "rms", "post"] = "layer"
    # The transformers class whose ``save_pretrained`` folders glmc reads and writes through ``from_pretrained`` and
    # ``build`` alone (no family-specific reader); "" where a family has its own (GPT-2's tied heads, ViT's names).
    hf_class: str = ""
    # The ``model_type`` its transformers config saves, where it is not the family's name (GPT-NeoX's "gpt_neox").
    hf_model_type: str = ""
    # What the model reads: images (a classifier) or token ids (a causal language model); tasks and checks ask this,
    # not the family's name.
    modality: Literal["image", "text"] = "text"
    # What a text model predicts: the next token (causal) or tokens hidden by masking (masked, BERT's objective, with
    # the mask token the vocabulary's last id); tasks and checks ask this.
    objective: Literal["causal", "masked"] = "causal"
    # Native names the library ties to another native parameter (alias → source): read only to check they still equal
    # their source, written as copies of it (BERT's decoder, tied to the word embeddings).
    tied: Mapping[str, str] = field(default_factory=dict)

    @property
    def optional(self) -> frozenset[str]:
        """The canonical templates some variants of the family go without."""
        return frozenset(name for name, rule in self.keys.items() if rule.optional)

    def to_canonical(self, native: Mapping[str, torch.Tensor], cfg: ModelConfig) -> State:
        """Rename a native (timm / HF) state dict to canonical names, weights as (out, in)."""
        return {name: self.canonical_tensor(native, name, rule, cfg)
                for name, rule in self.canonical_sources(native, cfg).items()}

    def canonical_sources(self, native: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, KeyRule]:
        """Each canonical name ``native`` holds, with the rule that reads it (in the key table's order), checked as
        :meth:`to_canonical` checks it (missing, unexpected and untied parameters refused) without reading a
        tensor but the tied ones."""
        depth = cfg.depth
        out: dict[str, KeyRule] = {}
        for name, (layer, template) in expand(self.keys, depth).items():
            rule = self.keys[template]
            key = rule.native.format(l=layer)
            if key not in native:
                if rule.optional:
                    continue
                raise CheckpointError(f"missing parameter {key!r} for a {self.family} of depth {depth}")
            out[name] = dataclasses.replace(rule, native=key)
        for alias, source in self.tied.items():
            if alias in native and source in native and not torch.equal(native[alias], native[source]):
                raise CheckpointError(f"{alias!r} is tied to {source!r} in a {self.family} but differs from it")
        extra = set(native) - set(self.tied) - {
            self.keys[t].native.format(l=layer) for layer, t in expand(self.keys, depth).values()}
        if extra:
            raise CheckpointError(f"unexpected parameter {sorted(extra)[0]!r} for a {self.family} of depth {depth}")
        return out

    def canonical_tensor(self, native: Mapping[str, torch.Tensor], name: str, rule: KeyRule,
                         cfg: ModelConfig) -> torch.Tensor:
        """One canonical tensor read from ``native`` by ``rule`` (its native name formatted, as
        :meth:`canonical_sources` gives it): transposed to (out, in), or its part of a fused tensor."""
        value = native[rule.native].t() if rule.transpose else native[rule.native]
        return value if rule.part is None else rule.part.take(value, cfg.heads)

    def to_native(self, canonical: Mapping[str, torch.Tensor], cfg: ModelConfig) -> State:
        """Inverse of :meth:`to_canonical`: the key table read the other way (keys a form dropped are skipped), the
        parts of a fused native tensor joined back."""
        sources = self.native_sources(canonical, cfg)
        out: State = {}
        for key, (rule, names) in sources.items():
            if key not in self.tied:
                out[key] = self.native_tensor(canonical, rule, names, cfg)
        for alias, source in self.tied.items():
            if source in out:
                out[alias] = out[source].clone()
        return out

    def native_sources(self, canonical: Mapping[str, torch.Tensor], cfg: ModelConfig,
                       ) -> dict[str, tuple[KeyRule, list[str]]]:
        """Each native name the canonical state writes, with its rule and the canonical names it is made of (one, or
        a fused tensor's parts in slot order; a tied alias: its source's), in :meth:`to_native`'s order; a fused
        tensor missing a part is refused."""
        out: dict[str, tuple[KeyRule, list[str]]] = {}
        parts: dict[str, dict[int, str]] = {}
        rules: dict[str, KeyRule] = {}
        for name, (layer, template) in expand(self.keys, cfg.depth).items():
            if name not in canonical:
                continue
            rule, key = self.keys[template], self.keys[template].native.format(l=layer)
            if rule.part is None:
                out[key] = (rule, [name])
                continue
            parts.setdefault(key, {})[rule.part.index] = name
            rules[key] = rule
        for key, held in parts.items():
            part = rules[key].part
            assert part is not None
            if len(held) != part.count:
                raise CheckpointError(f"{key!r} needs all {part.count} of its parts, got {len(held)}")
            out[key] = (rules[key], [held[i] for i in range(part.count)])
        for alias, source in self.tied.items():
            if source in out:
                out[alias] = out[source]
        return out

    def native_tensor(self, canonical: Mapping[str, torch.Tensor], rule: KeyRule, names: list[str],
                      cfg: ModelConfig) -> torch.Tensor:
        """One native tensor made of the canonical ``names`` (:meth:`native_sources`), contiguous."""
        if rule.part is None:
            value = canonical[names[0]]
            return (value.t() if rule.transpose else value).contiguous()
        fused = rule.part.join([canonical[n] for n in names], cfg.heads)
        return (fused.t() if rule.transpose else fused).contiguous()

    def native_view(self, canonical: Mapping[str, torch.Tensor], cfg: ModelConfig) -> Lazy:
        """:meth:`to_native` made one native tensor at a time on each read (a tied alias: a copy of its source), from
        a canonical state that may itself be :class:`glmc.core.state.Lazy`."""
        sources = self.native_sources(canonical, cfg)

        def make(key: str) -> torch.Tensor:
            rule, names = sources[key]
            value = self.native_tensor(canonical, rule, names, cfg)
            return value.clone() if key in self.tied else value

        return Lazy(sources, make)

    def module(self, model: nn.Module, canonical_prefix: str, layer: int | None = None) -> nn.Module:
        """The native submodule behind a canonical prefix such as ``blocks.{l}.mlp.fc2``."""
        path = self.module_names[canonical_prefix].format(l=layer)
        return model.get_submodule(path)

    def output_part(self, canonical_prefix: str) -> Part | None:
        """The part of its native module's output that a canonical linear layer computes (q of a fused q|k|v), or
        None where the module is the layer's own."""
        rule = self.keys.get(f"{canonical_prefix}.w")
        return None if rule is None else rule.part


def require_inputs(batch: torch.Tensor, cfg: ModelConfig, fits: bool, expected: str) -> None:
    """Raise a one-line ConfigError naming the expected input when ``fits`` is false."""
    if not fits or batch.shape[0] == 0:
        raise ConfigError(
            f"batch of shape {tuple(batch.shape)} ({batch.dtype}) does not fit the {cfg.family} model: "
            f"expected {expected}"
        )
