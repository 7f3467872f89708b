"""Self-check of the symmetry core: random transforms of every class must leave a model's logits unchanged.

This is what ``glmc check`` runs; the tests assert the same invariants on odd sizes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from glmc.archs import build_model, get_arch, random_inputs
from glmc.core.config import ModelConfig
from glmc.core.state import State, cast
from glmc.device import resolve, to_device
from glmc.symmetry.canonical import CIRCUITS, Form, canonicalize, residual_group, to_circuit, to_model
from glmc.symmetry.transforms import SYMMETRY_CLASSES, apply, random_transform

TOLERANCE = 1e-5  # maximum absolute logit difference in float64 that still counts as the same function
CHECK_CONTEXT = 64  # tokens per checked sequence: a pretrained GPT-2's 1024 would make the check slow, not stricter


def random_native(cfg: ModelConfig, seed: int) -> State:
    """A float64 native state dict with every parameter perturbed, so LayerNorm folding is never trivial; a tied
    parameter stays equal to its source."""
    torch.manual_seed(seed)
    model = build_model(cfg).double()
    state = {k: v + 0.1 * torch.randn_like(v) for k, v in model.state_dict().items()}
    return state | {alias: state[source] for alias, source in get_arch(cfg.family).tied.items() if alias in state}


def classes_for(cfg: ModelConfig) -> tuple[str, ...]:
    """The symmetry classes of this model: MLP scaling only for ReLU (paper §3.1) and the gated SwiGLU, whose
    ``up`` is linear."""
    return tuple(c for c in SYMMETRY_CLASSES if c != "mlp-scale" or cfg.activation in ("relu", "silu"))


def _logits(state: State, cfg: ModelConfig, form: Form, x: torch.Tensor) -> torch.Tensor:
    if form in CIRCUITS:
        state, cfg = to_circuit(state, cfg)
    with torch.no_grad():
        return get_arch(cfg.family).logits(to_model(state, cfg, form), x)


def invariance_errors(cfg: ModelConfig, form: Form = "standard", seed: int = 0,
                      device: str | torch.device = "cpu", native: Mapping[str, torch.Tensor] | None = None,
                      ) -> dict[str, float]:
    """Max |logit difference| for the canonical form itself and after a random transform of each class (and all),
    computed on ``device``, for ``native`` (a model's own weights; default: a random model of ``cfg``) on short
    random inputs."""
    arch, dev = get_arch(cfg.family), resolve(device)
    native = random_native(cfg, seed) if native is None else cast(native, torch.float64)
    x = random_inputs(cfg.replace(context=min(cfg.context, CHECK_CONTEXT)), seed=seed).to(dev)
    native = to_device(native, dev)
    model = build_model(cfg).to(dev, torch.float64).eval()
    model.load_state_dict(native)
    with torch.no_grad():
        reference = arch.logits(model, x)
    state = canonicalize(arch, native, cfg, form)
    errors = {"canonical-form": float((_logits(state, cfg, form, x) - reference).abs().max())}
    classes = classes_for(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    for name, group in [*((c, (c,)) for c in classes), ("all", classes)]:
        t = random_transform(cfg, group, g, residual_group(form, arch))
        moved = apply(state, arch.spec, t, cfg.heads)
        errors[name] = float((_logits(moved, cfg, form, x) - reference).abs().max())
    return errors
