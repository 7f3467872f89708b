"""Live models as their own libraries built them (a timm ``VisionTransformer``, an HF ``GPT2LMHeadModel``): the
family and config glmc reads from one, its weights under glmc's native names, and a new module of the same class
holding other weights.

Reading checks itself: glmc's own build of the config it read, holding the model's weights, must compute the model's
logits (float64), so an option that moves no parameter but changes the function is refused rather than aligned
wrongly. Weights shared by two names (GPT-2's tied embedding and head, the HF default) are copied apart, with one
INFO line: alignment moves the two differently, and a tie kept silently would make the model compute something else.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from glmc.archs import ARCHS, Arch, hf_vit
from glmc.core.config import ModelConfig
from glmc.core.state import State, cast
from glmc.errors import ConfigError, first_line

log = logging.getLogger(__name__)

READ_TOLERANCE = 1e-6  # max |logit difference| (float64) between a read model and glmc's rebuild of it
FLOAT64_CHECK_PARAMS = 100_000_000  # above: the check runs on the model's own tensors in their precision, since
# float64 copies of a billion-parameter model and of glmc's rebuild would take 17 GB, 9 GB even in float32
LEAN_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2, torch.float64: READ_TOLERANCE}
# relative, for that check: the precision's rounding (the rebuild is the same class: 0 in every case measured),
# where an option glmc does not describe changes the logits at O(1)
CHECK_LENGTH = 16  # tokens per sequence of the read check (a GPT-2's full context is not needed to tell)


def describe(model: nn.Module) -> tuple[Arch, ModelConfig]:
    """The family and config of a live model; one-line ConfigError for a class glmc does not read."""
    for arch in ARCHS.values():
        cfg = arch.config_of(model)
        if cfg is not None:
            return arch, cfg
    hf = ", ".join(["GPT2LMHeadModel", "ViTForImageClassification",
                    *(a.hf_class for a in ARCHS.values() if a.hf_class)])
    raise ConfigError(f"unsupported model class {type(model).__name__}: glmc reads timm VisionTransformer and "
                      f"Hugging Face {hf} models")


def shared_names(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Each name whose tensor shares its storage with an earlier name's → that earlier name (tied weights)."""
    first: dict[tuple[int, tuple[int, ...]], str] = {}
    tied = {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in first and tensor.numel():
            tied[name] = first[key]
        first.setdefault(key, name)
    return tied


def untied_state(model: nn.Module) -> State:
    """The model's state dict, detached, with every tied tensor an independent copy (one INFO line each)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for name, source in shared_names(state).items():
        log.info("%s is tied to %s in this %s; glmc unties it (aligning moves the two apart)", name, source,
                 type(model).__name__)
        state[name] = state[name].clone()
    return state


def probe_inputs(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """Two short inputs of the model's kind, to compare two builds of it."""
    from glmc.archs import random_inputs

    return random_inputs(cfg.replace(context=min(cfg.context, CHECK_LENGTH)), n=2).to(device)


def verify_rebuild(model: nn.Module, arch: Arch, cfg: ModelConfig, state: Mapping[str, torch.Tensor]) -> None:
    """ConfigError unless glmc's build of ``cfg`` takes ``state`` (strictly) and then computes ``model``'s logits:
    in float64 on copies, or above :data:`FLOAT64_CHECK_PARAMS` in the model's own precision on its own tensors."""
    device = next(iter(state.values())).device
    if sum(v.numel() for v in state.values()) <= FLOAT64_CHECK_PARAMS:
        ours = _holding(arch.build(cfg).to(device, torch.float64), cast(state, torch.float64), model, cfg)
        _compare(copy.deepcopy(model).to(device, torch.float64).eval(), ours.eval(), arch, cfg, READ_TOLERANCE)
        return
    training = model.training
    try:
        with torch.device("meta"):
            empty = arch.build(cfg)
        ours = _holding(empty, state, model, cfg, assign=True)
        _share_buffers(ours, model)
        _compare(model.eval(), ours.eval(), arch, cfg, LEAN_TOLERANCE[next(model.parameters()).dtype])
    finally:
        model.train(training)


def _holding(ours: nn.Module, state: Mapping[str, torch.Tensor], model: nn.Module, cfg: ModelConfig,
             assign: bool = False) -> nn.Module:
    """``ours`` holding ``state`` strictly (``assign``: its own tensors, not copies); ConfigError if it does not."""
    try:
        ours.load_state_dict(dict(state), strict=True, assign=assign)
    except RuntimeError as err:
        raise ConfigError(f"unsupported {type(model).__name__} variant: its parameters are not those of glmc's "
                          f"{cfg.family} ({first_line(err)})") from err
    return ours


def _share_buffers(ours: nn.Module, theirs: nn.Module) -> None:
    """The buffers no state dict holds (rotary frequencies), still on the meta device in ``ours``, shared with
    ``theirs``'s of the same name."""
    buffers = dict(theirs.named_buffers())
    for name, buffer in list(ours.named_buffers()):
        if buffer.is_meta:
            owner, _, leaf = name.rpartition(".")
            ours.get_submodule(owner).register_buffer(leaf, buffers[name], persistent=False)


def _compare(theirs: nn.Module, ours: nn.Module, arch: Arch, cfg: ModelConfig, tolerance: float) -> None:
    """ConfigError unless both modules compute the same logits on two probe inputs, within ``tolerance`` of the
    largest (at least 1)."""
    like = next(theirs.parameters())
    x = probe_inputs(cfg, like.device)
    x = x.to(like.dtype) if x.is_floating_point() else x
    with torch.no_grad():
        want = arch.logits(theirs, x)
        error = float((arch.logits(ours, x) - want).abs().max())
    if not error <= tolerance * max(1.0, float(want.abs().max())):
        raise ConfigError(f"unsupported {type(theirs).__name__} variant: glmc's {cfg.family} of the same config "
                          f"computes other logits (max difference {error:.2e}); an option glmc does not describe")


def read_module(model: nn.Module) -> tuple[Arch, ModelConfig, State]:
    """Family, config and untied native state of a live model, checked against glmc's rebuild of it (a transformers
    ViT is read as the timm ViT computing it, :mod:`glmc.archs.hf_vit`)."""
    if hf_vit.is_hf_vit(model):
        model = hf_vit.timm_module(model)
    arch, cfg = describe(model)
    state = untied_state(model)
    verify_rebuild(model, arch, cfg, state)
    return arch, cfg, state


def like(model: nn.Module, native: Mapping[str, torch.Tensor]) -> nn.Module:
    """A new module of ``model``'s class, config, device and dtype holding ``native``: tied weights stay tied
    only where the new values are still equal bit for bit; elsewhere they become separate parameters (and an HF
    config says ``tie_word_embeddings: false``, so saving and reloading keeps them apart)."""
    if hf_vit.is_hf_vit(model):
        config: Any = model.config
        native = hf_vit.from_timm(native, config.num_hidden_layers)
    new = copy.deepcopy(model)
    current = new.state_dict()
    for name, source in shared_names(current).items():
        if torch.equal(native[name].to(current[name].device), native[source].to(current[source].device)):
            continue
        owner, _, leaf = name.rpartition(".")
        module = new.get_submodule(owner)
        setattr(module, leaf, nn.Parameter(current[name].clone(), requires_grad=current[name].requires_grad))
        config = getattr(new, "config", None)
        if config is not None and hasattr(config, "tie_word_embeddings"):
            config.tie_word_embeddings = False
    try:
        new.load_state_dict(dict(native), strict=True)
    except RuntimeError as err:
        raise ConfigError(f"the result does not fit a {type(model).__name__}: {first_line(err)}") from err
    return new.eval() if not model.training else new
