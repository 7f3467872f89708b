"""``glmc check``: every symmetry class must leave a model's function unchanged (logits within 1e-5 in float64)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from glmc.cli.pair import FORM_NAMES
from glmc.errors import ConfigError


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, nargs="?",
                        help="check this model's own weights: a glmc checkpoint, Hugging Face folder or timm state "
                             "dict (instead of a random --model)")
    parser.add_argument("--model", help="preset name, e.g. vit-tiny or gpt2-bench (default: none; give it or a "
                                        "checkpoint)")
    for size in ("width", "depth", "heads", "mlp"):
        parser.add_argument(f"--{size}", type=int, help=f"override the preset's {size} (default: the preset's)")
    parser.add_argument("--activation", choices=["gelu", "relu"], help="relu adds the MLP scaling symmetry (default: "
                                                                       "the preset's)")
    parser.add_argument("--form", choices=FORM_NAMES, default="standard", help="the parameters the transforms act on")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random model and transforms")


def run_check(args: argparse.Namespace) -> int:
    """Apply a random transform of every class in float64; print JSON errors; exit 0 only if all are ≤ 1e-5."""
    from glmc.symmetry.exactness import TOLERANCE, invariance_errors

    if args.checkpoint is not None:
        return _check_checkpoint(args)
    if args.model is None:
        raise ConfigError("give a checkpoint to check, or --model PRESET for a random model of a preset")
    from glmc.archs import get_arch
    from glmc.core.config import preset

    changes = {k: getattr(args, k) for k in ("width", "depth", "heads", "mlp", "activation")
               if getattr(args, k) is not None}  # --width 0 is an error to report, not "no override"
    cfg = preset(args.model).replace(**changes)
    if get_arch(cfg.family).modality == "text":
        cfg = cfg.replace(vocab_size=67)  # any vocabulary will do for an invariance check
    errors = invariance_errors(cfg, args.form, args.seed, device=args.device)
    ok = max(errors.values()) <= TOLERANCE
    shown = cfg.fields_read(get_arch(cfg.family).modality)
    print(json.dumps({"model": args.model, "config": shown, "form": args.form, "tolerance": TOLERANCE,
                      "max_abs_logit_error": errors, "ok": ok}, indent=2))
    return 0 if ok else 1


def _check_checkpoint(args: argparse.Namespace) -> int:
    """``glmc check CHECKPOINT``: the invariance errors of the model's own weights."""
    from glmc.archs import get_arch
    from glmc.io.formats import read
    from glmc.symmetry.exactness import TOLERANCE, invariance_errors

    for flag in ("model", "width", "depth", "heads", "mlp", "activation"):
        if getattr(args, flag) is not None:
            raise ConfigError(f"--{flag} shapes a random preset model; a checkpoint has its own")
    state, meta = read(args.checkpoint)
    errors = invariance_errors(meta.config, args.form, args.seed, device=args.device, native=state)
    ok = max(errors.values()) <= TOLERANCE
    shown = meta.config.fields_read(get_arch(meta.config.family).modality)
    print(json.dumps({"checkpoint": str(args.checkpoint), "config": shown, "form": args.form,
                      "tolerance": TOLERANCE, "max_abs_logit_error": errors, "ok": ok}, indent=2))
    return 0 if ok else 1
