"""``glmc check``, ``glmc align`` and ``glmc barrier``: the symmetry core from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from glmc import cli_export, cli_merge
from glmc.cli_learn import add_learn_arguments, count, learn_options, test_data, training_data
from glmc.cli_weight import add_weight_arguments, weight_options, weight_start
from glmc.errors import ConfigError

ACTIVATION_SAMPLES = 512  # default --batch of activation matching
METHOD_NAMES = "none, weight, weight-perm, activation, learned, learned-perm, soft, dual"  # glmc.match.align.METHODS
FORM_NAMES = ["standard", "rmsnorm", "circuit", "circuit-rmsnorm"]  # canonical.FORMS, torch-free

if TYPE_CHECKING:

    from glmc.io.checkpoint import CheckpointMeta
    from glmc.match.align import Alignment
    from glmc.symmetry.canonical import Form


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, nargs="?",
                        help="check this model's own weights: a glmc checkpoint, Hugging Face folder or timm state "
                             "dict (instead of a random --model)")
    parser.add_argument("--model", help="preset name, e.g. vit-tiny or gpt2-bench")
    for size in ("width", "depth", "heads", "mlp"):
        parser.add_argument(f"--{size}", type=int, help=f"override the preset's {size}")
    parser.add_argument("--activation", choices=["gelu", "relu"], help="relu adds the MLP scaling symmetry")
    parser.add_argument("--form", choices=FORM_NAMES, default="standard")
    parser.add_argument("--seed", type=int, default=0)


def run_check(args: argparse.Namespace) -> int:
    """Apply a random transform of every class in float64; print JSON errors; exit 0 only if all are ≤ 1e-5."""
    from glmc.symmetry.exactness import TOLERANCE, invariance_errors

    if args.checkpoint is not None:
        return _check_checkpoint(args)
    if args.model is None:
        raise ConfigError("give a checkpoint to check, or --model PRESET for a random model of a preset")
    from glmc.archs import preset

    changes = {k: getattr(args, k) for k in ("width", "depth", "heads", "mlp", "activation")
               if getattr(args, k) is not None}  # --width 0 is an error to report, not "no override"
    cfg = preset(args.model).replace(**changes)
    if cfg.family == "gpt2":
        cfg = cfg.replace(vocab_size=67)  # any vocabulary will do for an invariance check
    errors = invariance_errors(cfg, args.form, args.seed, device=args.device)
    ok = max(errors.values()) <= TOLERANCE
    print(json.dumps({"model": args.model, "config": cfg.to_dict(), "form": args.form, "tolerance": TOLERANCE,
                      "max_abs_logit_error": errors, "ok": ok}, indent=2))
    return 0 if ok else 1


def _check_checkpoint(args: argparse.Namespace) -> int:
    """``glmc check CHECKPOINT``: the invariance errors of the model's own weights."""
    from glmc.io.formats import read
    from glmc.symmetry.exactness import TOLERANCE, invariance_errors

    for flag in ("model", "width", "depth", "heads", "mlp", "activation"):
        if getattr(args, flag) is not None:
            raise ConfigError(f"--{flag} shapes a random preset model; a checkpoint has its own")
    state, meta = read(args.checkpoint)
    errors = invariance_errors(meta.config, args.form, args.seed, device=args.device, native=state)
    ok = max(errors.values()) <= TOLERANCE
    print(json.dumps({"checkpoint": str(args.checkpoint), "config": meta.config.to_dict(), "form": args.form,
                      "tolerance": TOLERANCE, "max_abs_logit_error": errors, "ok": ok}, indent=2))
    return 0 if ok else 1


def _add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", type=Path, help="reference checkpoint A (glmc .safetensors, Hugging Face folder or timm "
                        "state dict)")
    parser.add_argument("b", type=Path, help="checkpoint B, moved towards A (B may be narrower: then it is "
                        "embedded into A's width first, as glmc merge embeds its inputs)")
    add_learn_arguments(parser, "training samples given to data-driven methods (default: "
                        f"{ACTIVATION_SAMPLES} for activation, the whole training split for learned ones)")
    add_weight_arguments(parser)


def add_align_arguments(parser: argparse.ArgumentParser) -> None:
    _add_pair_arguments(parser)
    parser.add_argument("--method", default="weight", help=f"one of {METHOD_NAMES}")
    parser.add_argument("--out", required=True, type=Path, help="aligned B, a standard checkpoint (at A's width)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out")
    cli_export.add_format_argument(parser)
    cli_merge.add_fill_argument(parser)


def _load_pair(a: Path, b: Path) -> tuple[dict, dict, CheckpointMeta, CheckpointMeta]:
    """Both checkpoints, refusing before any work a NaN or inf (named as the file names it), different families or a
    B that does not fit inside A (only widths may differ, and B is then embedded into A's width)."""
    from glmc.io.formats import read
    from glmc.match.common import require_finite
    from glmc.merging.widths import check_embeddable
    from glmc.symmetry.spec import check_same_shapes

    state_a, meta_a = read(a)
    state_b, meta_b = read(b)
    require_finite(state_a, str(a))
    require_finite(state_b, str(b))
    if meta_a.config.family != meta_b.config.family:
        raise ConfigError(f"{a} is a {meta_a.config.family} but {b} is a {meta_b.config.family}")
    if meta_a.config != meta_b.config:
        check_embeddable(meta_b.config, meta_a.config)
    else:
        check_same_shapes(state_a, state_b)
    return state_a, state_b, meta_a, meta_b


def _align(args: argparse.Namespace, method: str, state_a: dict, state_b: dict, meta: CheckpointMeta,
           form: Form = "standard") -> Alignment:
    from glmc.data.generated import writing_seconds
    from glmc.match.align import DATA_METHODS, LEARNED_METHODS, align_pair

    samples = args.batch or (None if method in LEARNED_METHODS else ACTIVATION_SAMPLES)
    data = training_data(meta, args, samples, ([state_a, state_b], [meta.config] * 2)) \
        if method in DATA_METHODS else None
    written = writing_seconds(data)
    learn = learn_options(args) if method in LEARNED_METHODS else None
    aligned = align_pair(state_a, state_b, meta.config, method, form=form, data=data,
                         batch=samples or ACTIVATION_SAMPLES, learn=learn, start=weight_start(args),
                         device=args.device, weight=weight_options(args))
    if written:  # sampling the text is part of the method's cost
        aligned.result.seconds += written
        aligned.result.info["generate_seconds"] = round(written, 3)
    return aligned


def run_align(args: argparse.Namespace) -> int:
    """Write B transformed towards A as a standard checkpoint (same function as B)."""
    import dataclasses

    from glmc.archs import get_arch
    from glmc.io.formats import check_output, write

    check_output(args.out, cli_export.early_format(args), args.force)
    state_a, state_b, meta, meta_b = _load_pair(args.a, args.b)
    fmt = cli_export.output_format(args, meta_b)
    config = meta.config
    if meta_b.config != config:  # embedded into A's width: a checkpoint of A's shapes computing B
        moved, config, seconds = cli_merge.align_across_widths(args, [state_a, state_b], [meta, meta_b])
        report: dict = {"seconds": round(seconds, 3), "width": [meta_b.config.width, config.width]}
    else:
        aligned = _align(args, args.method, state_a, state_b, meta)
        moved, result = aligned.b, aligned.result
        report = {"seconds": round(result.seconds, 3), "objective": result.objective,
                  **{k: v for k, v in result.info.items() if k != "sweeps"}}
    native = get_arch(config.family).to_native(moved, config.depth)
    split = f"{meta_b.split}; aligned to {args.a.name} by {args.method}"
    out_meta = dataclasses.replace(meta_b, config=config, width_mult=meta.width_mult, split=split)
    write(args.out, fmt, native, out_meta, args.dtype)
    print(json.dumps({"out": str(args.out), "format": fmt, "dtype": args.dtype, "method": args.method, **report}))
    return 0


def add_barrier_arguments(parser: argparse.ArgumentParser) -> None:
    _add_pair_arguments(parser)
    parser.add_argument("--method", action="append", help=f"repeatable: {METHOD_NAMES}")
    parser.add_argument("--points", type=int, default=21, help="λ grid size, both ends included")
    parser.add_argument("--limit", type=int, help="evaluate on the first N held-out samples only")
    parser.add_argument("--form", choices=FORM_NAMES, default="standard",
                        help="the parameters the path interpolates: standard (the models as they are), rmsnorm "
                             "(LayerNorm as RMSNorm, the residual aligned over the whole O(d)), circuit (each head "
                             "multiplied out into its QK and OV circuits, paper §3.2.2) or circuit-rmsnorm (both, as "
                             "the official GLMC code interpolates); all but standard change the architecture, as the "
                             "paper's barriers do")
    parser.add_argument("--json", required=True, type=Path, help="write the curves here")
    parser.add_argument("--plot", type=Path, help="write a loss/accuracy plot here (.png)")
    parser.add_argument("--repair", type=count, metavar="N",
                        help="REPAIR every point of the path first (Jordan et al. 2022): reset each channel's mean "
                             "and std to the λ-mean of A's and B's, measured on N training samples; each curve is "
                             "named METHOD+repair")
    cli_merge.add_simplex_arguments(parser)


def run_barrier(args: argparse.Namespace) -> int:
    """Align B to A by each method and measure the loss barrier on held-out data (paper Eq. 1)."""
    import torch

    from glmc.interpolation import barrier_curve
    from glmc.symmetry.canonical import CIRCUITS, to_circuit

    if args.simplex:
        for flag, given in (("--repair", args.repair), ("--form", args.form != "standard")):
            if given:
                raise ConfigError(f"{flag} applies to the pairwise curves, not to --simplex")
        return cli_merge.run_simplex(args)
    if args.points < 2:
        raise ConfigError("--points must be at least 2")
    if args.repair and args.form != "standard":
        raise ConfigError(f"--repair needs the standard form, not --form {args.form}")
    state_a, state_b, meta, meta_b = _load_pair(args.a, args.b)
    if meta_b.config != meta.config:
        _write_barrier_outputs(args, cli_merge.width_curves(args, [state_a, state_b], [meta, meta_b]))
        return 0
    test = test_data(meta, meta.config, args)
    repair = training_data(meta, args, args.repair, ([state_a, state_b], [meta.config] * 2)) if args.repair else None
    curves = []
    for method in args.method or ["weight"]:
        aligned = _align(args, method, state_a, state_b, meta, args.form)  # learned methods learn the form's path
        (a, cfg), (b, _) = ((to_circuit(s, meta.config) if args.form in CIRCUITS else (s, meta.config))
                            for s in (aligned.a, aligned.b))
        name = f"{method}+repair" if repair is not None else method
        curve = barrier_curve(a, b, cfg, test, args.points, form=args.form, method=name, dtype=torch.float32,
                              repair_data=repair)
        curves.append(curve.to_dict() | {"align_seconds": aligned.result.seconds, "align_info": aligned.result.info})
        print(f"{name:12s} barrier {curve.barrier:.4f}  align {aligned.result.seconds:.2f} s", file=sys.stderr)
    _write_barrier_outputs(args, curves)
    return 0


def _write_barrier_outputs(args: argparse.Namespace, curves: list[dict]) -> None:
    from glmc.interpolation import BarrierCurve
    from glmc.plots import plot_barrier_curves

    report = {"a": str(args.a), "b": str(args.b), "points": args.points, "form": args.form,
              "curves": curves}
    if len(curves) == 1:
        report |= curves[0]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        fields = BarrierCurve.__dataclass_fields__
        plot_barrier_curves([BarrierCurve(**{k: c[k] for k in fields}) for c in curves], args.plot)
    print(json.dumps({c["method"]: round(c["barrier"], 4) for c in curves}))
