"""The Python API on live models: ``glmc.align``, ``glmc.merge``, ``glmc.barrier`` and ``glmc.check`` take timm
``VisionTransformer`` and Hugging Face ``GPT2LMHeadModel`` and ``ViTForImageClassification`` instances as they come
(tied GPT-2s included) and return modules of the same class.

Every model is read through :func:`glmc.io.live.read_module` (its config, its weights untied, checked against glmc's
rebuild); the inputs are never modified. ``data`` may be a Dataset of (input, target) pairs, an (inputs, targets)
pair of tensors, a tensor of token ids (next-token targets taken from it), a ``.npy`` / ``.npz`` path
(:mod:`glmc.io.userdata`) or, for the data-driven methods of GPT-2s, ``"generated"``: 20,000 windows of text the
models write themselves (:mod:`glmc.data.generated`; learned against their mixed prediction unless ``learn`` names
other targets), so that no dataset is read. ``device`` is where the work happens
("cpu", "cuda", "auto"); results stay beside their inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from glmc.archs import Arch
from glmc.core.config import ModelConfig
from glmc.core.state import State, cast
from glmc.errors import ConfigError
from glmc.io.live import like, read_module
from glmc.match.options import MatchOptions
from glmc.merging.interpolation import BarrierCurve
from glmc.merging.options import MergeOptions
from glmc.merging.widths import check_embeddable

Data = Dataset | tuple[torch.Tensor, torch.Tensor] | torch.Tensor | str | Path | None
GENERATED = "generated"  # data for the data-driven methods that the models themselves write (glmc.data.generated)


def as_dataset(data: Data, cfg: ModelConfig, writers: tuple[Sequence[State], Sequence[ModelConfig]] = ((), ()),
               device: str = "cpu") -> Dataset | None:
    """``data`` as a Dataset of (input, target) pairs (see the module docstring); ``"generated"``: text that the
    ``writers`` (native states, their configs) sample."""
    from glmc.io.userdata import load_data_file

    if data is None or isinstance(data, Dataset):
        return data
    if data == GENERATED and writers[0]:
        from glmc.data.generated import generated_text

        return generated_text(*writers, device=device)
    if isinstance(data, str | Path):
        return load_data_file(data, cfg)
    if isinstance(data, tuple) and len(data) == 2:
        return TensorDataset(*data)
    if isinstance(data, torch.Tensor) and not data.is_floating_point() and data.dim() == 2 and data.shape[1] >= 2:
        from glmc.data.masking import for_objective

        return for_objective(TensorDataset(data[:, :-1], data[:, 1:]), cfg)
    raise ConfigError("data must be a Dataset of (input, target) pairs, an (inputs, targets) pair of tensors, a "
                      "tensor of token ids (N, L ≥ 2) or a .npy/.npz path")


def _read_all(models: Sequence[nn.Module]) -> tuple[Arch, list[ModelConfig], list[State]]:
    """Every model read, refused in one line unless they are one family."""
    if not models:
        raise ConfigError("no models given")
    read = [read_module(m) for m in models]
    families = [cfg.family for _, cfg, _ in read]
    if len(set(families)) > 1:
        raise ConfigError(f"models of different families cannot be aligned: {', '.join(families)}")
    return read[0][0], [cfg for _, cfg, _ in read], [state for _, _, state in read]


def _refuse_forms(options: MatchOptions | None) -> None:
    if options is not None and options.form != "standard":
        raise ConfigError(f"form {options.form!r} changes the architecture; the API returns standard models")


def align(model_a: nn.Module, model_b: nn.Module, method: str = "weight", data: Data = None, *,
          device: str = "cpu", options: MatchOptions | None = None) -> nn.Module:
    """A new module of ``model_b``'s class and config computing ``model_b``'s function, moved next to
    ``model_a`` by a symmetry found by ``method`` (glmc.match.registry.METHODS; ``data`` for those that read data).
    ``options``: the matchers' options (:class:`glmc.match.options.MatchOptions`; default glmc's).

    >>> import timm, torch, glmc
    >>> kw = dict(img_size=16, patch_size=4, in_chans=1, embed_dim=24, depth=2, num_heads=3, num_classes=5)
    >>> a = timm.create_model("vit_tiny_patch16_224", **kw)
    >>> b = timm.create_model("vit_tiny_patch16_224", **kw)
    >>> b_moved = glmc.align(a, b)
    >>> x = torch.randn(4, 1, 16, 16)
    >>> bool((b_moved(x) - b.eval()(x)).abs().max() < 1e-4)
    True
    """
    from glmc.match.align import align_pair

    _refuse_forms(options)
    arch, (cfg, cfg_b), (state_a, state_b) = _read_all([model_a, model_b])
    if cfg != cfg_b:
        raise ConfigError("glmc.align takes two models of one config; glmc.merge also takes different widths")
    fit = as_dataset(data, cfg, ([state_a, state_b], [cfg] * 2), device)
    aligned = align_pair(state_a, state_b, cfg, method, options, data=fit, device=device)
    return like(model_b, arch.to_native(aligned.b, cfg))


def merge(models: Sequence[nn.Module], method: str = "weight", weights: Sequence[float] | None = None,
          data: Data = None, *, device: str = "cpu", options: MergeOptions | None = None) -> nn.Module:
    """The models aligned into one universe and averaged (``weights``: one per model, default equal), a module of
    the widest model's class and config; narrower models are embedded into its width. ``options``: the rest of
    the merge (:class:`glmc.merging.options.MergeOptions`: iterations, fill, corrections, ...), with ``method`` and
    ``device`` as given here.

    >>> import torch, glmc
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> config = GPT2Config(vocab_size=20, n_positions=8, n_embd=24, n_layer=2, n_head=3)
    >>> models = [GPT2LMHeadModel(config) for _ in range(3)]
    >>> merged = glmc.merge(models)
    >>> type(merged).__name__, merged(torch.randint(0, 20, (2, 8))).logits.shape
    ('GPT2LMHeadModel', torch.Size([2, 8, 20]))
    """
    from glmc.merging.merge import MergeSetup, merge_models
    from glmc.merging.universe import members

    arch, configs, states = _read_all(models)
    widest = max(range(len(configs)), key=lambda i: (configs[i].width, configs[i].mlp, configs[i].heads))
    target = configs[widest]
    for cfg in configs:
        check_embeddable(cfg, target)
    options = dataclasses.replace(options or MergeOptions(), method=method, device=device)
    setup = MergeSetup(target, options, as_dataset(data, target, (states, configs), device))
    merged = merge_models(members(states, configs, weights), setup).universe.merged
    return like(models[widest], arch.to_native(merged, target))


def barrier(model_a: nn.Module, model_b: nn.Module, data: Data, method: str = "weight", points: int = 11, *,
            train: Data = None, device: str = "cpu", options: MatchOptions | None = None) -> BarrierCurve:
    """The loss barrier on ``data`` (held-out) along the linear path from B (λ = 0) to A (λ = 1) after aligning B
    by ``method`` ("none": as they are); data-driven methods fit on ``train`` (default: ``data``). The curve has
    ``.barrier``, ``.lambdas``, ``.losses`` and ``.accuracies``.

    >>> import torch, glmc
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> config = GPT2Config(vocab_size=20, n_positions=8, n_embd=24, n_layer=2, n_head=3)
    >>> a, b = GPT2LMHeadModel(config), GPT2LMHeadModel(config)
    >>> curve = glmc.barrier(a, b, torch.randint(0, 20, (16, 9)), points=5)
    >>> len(curve.lambdas), curve.barrier >= 0.0
    (5, True)
    """
    from glmc.match.align import align_pair
    from glmc.match.registry import get_method
    from glmc.merging.interpolation import barrier_curve

    _refuse_forms(options)
    if points < 2:
        raise ConfigError(f"points must be at least 2, got {points}")
    _, (cfg, cfg_b), (state_a, state_b) = _read_all([model_a, model_b])
    if cfg != cfg_b:
        raise ConfigError("glmc.barrier takes two models of one config")
    test = as_dataset(data, cfg)
    if test is None:
        raise ConfigError("a barrier is measured on data: pass held-out data")
    fit = as_dataset(train, cfg, ([state_a, state_b], [cfg] * 2), device) if train is not None else test
    reads = get_method(method).reads_data
    aligned = align_pair(state_a, state_b, cfg, method, options, data=fit if reads else None, device=device)
    return barrier_curve(aligned.a, aligned.b, cfg, test, points, method=method, dtype=torch.float32)


def check(model: nn.Module, *, device: str = "cpu", seed: int = 0) -> float:
    """The largest logit change (float64) that a random transform of any symmetry class causes on this model's own
    weights: ≤ 1e-5 (glmc.symmetry.exactness.TOLERANCE) means glmc's symmetries are exact on it.

    >>> import timm, glmc
    >>> vit = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=24, depth=2,
    ...                         num_heads=3, class_token=False, global_pool="avg", reg_tokens=2, init_values=0.1)
    >>> glmc.check(vit) < 1e-5
    True
    """
    from glmc.symmetry.exactness import invariance_errors

    _, cfg, state = read_module(model)
    return max(invariance_errors(cfg, seed=seed, device=device, native=cast(state, torch.float64)).values())
