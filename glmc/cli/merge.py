"""``glmc merge`` (N checkpoints, any widths, into one standard checkpoint) and ``glmc barrier --simplex``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmc.cli.data_options import add_data_arguments, count, test_data, training_data
from glmc.cli.export import add_format_argument, early_format, output_format
from glmc.cli.options import add_match_arguments, add_option_argument, match_options
from glmc.cli.outputs import write_report
from glmc.errors import ConfigError, check_weights
from glmc.match.options import ActivationOptions
from glmc.match.registry import MERGE_METHODS, get_method

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from glmc.core.config import ModelConfig
    from glmc.io.checkpoint import CheckpointMeta
    from glmc.merging.merge import MergeSetup
    from glmc.merging.options import MergeOptions
    from glmc.merging.universe import UniverseResult

log = logging.getLogger(__name__)
FILL_NAMES = ["zeros", "copies"]  # glmc.merging.widths.FILLS, without importing torch
LEARN_SAMPLES = 20000  # default training samples of learned merging (a seeded subset of the training split)
# The simplex grid's default size: a pair's 11 points (the paper's barrier curve), growing gently with N, so that
# the evaluation costs a few merges, not many (66 points for a pair took 17 of 18 minutes on two GPT-2s).
POINTS_PER_MODEL = 11


def add_merge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoints", nargs="+", type=Path,
                        help="two or more checkpoints to merge (glmc .safetensors, Hugging Face folders or timm state "
                             "dicts)")
    parser.add_argument("--method", default="weight", help=f"one of {', '.join(MERGE_METHODS)}")
    width = parser.add_mutually_exclusive_group()
    width.add_argument("--width-of", type=Path, help="give the merged model this checkpoint's width (default: the "
                                                     "widest input's)")
    width.add_argument("--width-mult", type=float, help="give the merged model this tier of the preset (default: the "
                                                        "widest input's)")
    parser.add_argument("--weights", help="comma-separated weights n1,n2,... (e.g. example counts; default equal)")
    parser.add_argument("--out", required=True, type=Path, help="merged standard checkpoint (.safetensors)")
    parser.add_argument("--json", type=Path, help="write the full report here (default: none)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out, or a --json that is not a "
                        "report glmc wrote")
    add_format_argument(parser)
    parser.add_argument("--simplex-points", type=int, help="at most this many weights on the simplex grid of the "
                        f"merge's barrier (Eq. 2); default {POINTS_PER_MODEL} per model beyond the first: a pair's 11 "
                        "λ, as its barrier curve; 3 models 21 points, 5 models 35, 10 models 55")
    parser.add_argument("--limit", type=int, help="evaluate on the first N held-out samples only (default: all)")
    parser.add_argument("--circuit-heads", action="store_true",
                        help="refit every merged head to its inputs' weighted mean QK and OV circuits (truncated SVD, "
                        "data-free; inputs of one width; rotary pairs and grouped queries included): the merge "
                        "averages circuits, not factors")
    parser.add_argument("--restore-norms", action="store_true",
                        help="rescale every merged MLP neuron and head to its inputs' mean norm: a data-free repair "
                        "of the shrinkage that averaging imperfectly aligned units causes")
    parser.add_argument("--repair", type=count, metavar="N",
                        help="then reset every merged channel's mean and std to the inputs' weighted mean, measured on "
                        "N training samples (REPAIR, Jordan et al. 2022); the merge then depends on data (default: "
                        "off)")
    parser.add_argument("--refit", type=count, metavar="N",
                        help="refit every merged linear layer, in forward order, to the inputs' weighted mean output "
                        "by least squares on N training samples (labels unread; RegMean with the merged model's own "
                        "inputs); across widths, to the mean of the models that hold each output (default: off)")
    add_data_arguments(parser, f"training samples for activation (default {ActivationOptions.batch}) and learned "
                       f"(default {LEARN_SAMPLES}) merging")
    add_match_arguments(parser, defaults={"epochs": 1}, skip=["concentration"])
    add_universe_arguments(parser)


def add_universe_arguments(parser: argparse.ArgumentParser) -> None:
    """Universe-matching options, shared by ``merge`` and ``barrier --simplex``."""
    parser.add_argument("--iters", type=count, default=5, help="universe iterations at most")
    parser.add_argument("--tol", type=float, default=1e-3,
                        help="stop when U moves, or the mean distance to U falls, by less than this (relative)")
    parser.add_argument("--workers", type=count, default=1, help="processes aligning models in parallel")
    add_fill_argument(parser)
    add_option_argument(parser, "learn", "concentration")


def add_fill_argument(parser: argparse.ArgumentParser) -> None:
    """How a narrower model is embedded into a wider one (``merge``, ``barrier`` and ``align`` across widths)."""
    parser.add_argument("--fill", choices=FILL_NAMES, default="zeros",
                        help="how a narrower model fills the target's extra heads and MLP units: zero heads and dead "
                        "neurons (the exact embedding), or copies of its own that share their output (Net2Net "
                        "widening, also exact: it lowers the barriers between widths and helps learned merges, "
                        "but costs data-free ones)")


def _weights(text: str | None, n: int) -> list[float] | None:
    """``n1,n2,...`` as n positive floats, checked before any merging."""
    if text is None:
        return None
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError as err:
        raise ConfigError(f"--weights must be comma-separated numbers, got {text!r}") from err
    return check_weights(weights, n)


def _load(paths: list[Path], half: bool = False) -> tuple[list[dict], list[CheckpointMeta]]:
    """The checkpoints' native states (in float32; ``half``: a half-precision file in its own, as
    :func:`glmc.cli.pair.load_pair` reads it) and metadata; a NaN or inf is refused here, named as its file names
    it."""
    from glmc.cli.pair import half_or_float32
    from glmc.io.formats import read
    from glmc.match.common import require_finite

    loaded = [read(p, stored=half) for p in paths]
    for path, (state, _) in zip(paths, loaded, strict=True):
        require_finite(state, str(path))
    return [half_or_float32(s) if half else s for s, _ in loaded], [m for _, m in loaded]


def _setup(args: argparse.Namespace, method: str, target: Any, natives: list[dict], metas: list[CheckpointMeta],
           learn_samples: int | None = LEARN_SAMPLES) -> MergeSetup:
    """The MergeSetup of one method for the models ``natives``: training samples only for the data-driven ones and
    the corrections (never the test split; with --generated, text the models write); ``learn_samples`` is learned's
    default (None: the whole training split)."""
    from glmc.merging.merge import MergeSetup

    samples = args.batch or (learn_samples if get_method(method).learns else ActivationOptions.batch)
    options = merge_options(args, method, samples)
    corrected = options.corrections.samples or 0  # the CLI's corrections always name their count
    train: Dataset | None
    meta, writers = dataclasses.replace(metas[0], config=target), (natives, [m.config for m in metas])
    if samples is None:  # the whole split, which covers REPAIR's and the refit's samples too
        train = training_data(meta, args, None, writers)
        samples = len(train)  # type: ignore[arg-type]
    else:
        wanted = max(samples, corrected) if options.reads_data else corrected  # the first `samples` stay
        train = training_data(meta, args, wanted, writers) if wanted else None
    return MergeSetup(target, options, train)


def merge_options(args: argparse.Namespace, method: str, samples: int | None) -> MergeOptions:
    """The MergeOptions the flags give, activation matching on ``samples`` (align has no universe or correction
    flags: MergeOptions' defaults)."""
    from glmc.merging.corrections import Corrections
    from glmc.merging.options import MergeOptions

    universe = {key: getattr(args, name) for key, name in (("max_iters", "iters"), ("tol", "tol"),
                                                           ("workers", "workers")) if hasattr(args, name)}
    corrections = Corrections(restore_norms=getattr(args, "restore_norms", False),
                              refit=getattr(args, "refit", None) or 0, repair=getattr(args, "repair", None) or 0,
                              circuit_heads=getattr(args, "circuit_heads", False))
    return MergeOptions(method, match_options(args, batch=samples), fill=args.fill, corrections=corrections,
                        device=args.device, **universe)


def simplex_points(args: argparse.Namespace, n: int) -> int:
    """--simplex-points, or its default for ``n`` models."""
    return args.simplex_points or POINTS_PER_MODEL * (n - 1)


def _test_split(meta: CheckpointMeta, target: Any, args: argparse.Namespace) -> Dataset:
    return test_data(meta, target, args)


def _prepare(args: argparse.Namespace, paths: list[Path], half: bool = False,
             ) -> tuple[list[dict], list[CheckpointMeta], Any, float]:
    """Inputs (``half``: as :func:`_load` reads them), their metadata, and the checked target config and width
    multiplier."""
    from glmc.io.formats import read
    from glmc.merging.merge import check_inputs, target_config

    natives, metas = _load(paths, half)
    width_of = read(args.width_of)[1] if getattr(args, "width_of", None) else None
    target, mult = target_config(metas, width_of, getattr(args, "width_mult", None))
    check_inputs(metas, target)
    return natives, metas, target, mult


def run_merge(args: argparse.Namespace) -> int:
    """Merge the checkpoints into one of the target width; report every model, the merge, the ensemble, Eq. 2."""
    from glmc.data.generated import writing_seconds
    from glmc.io.formats import check_output
    from glmc.merging.evaluation import grid_steps

    get_method(args.method, merging=True)
    if len(args.checkpoints) < 2:
        raise ConfigError(f"merge needs at least 2 checkpoints, got {len(args.checkpoints)}")
    weights = _weights(args.weights, len(args.checkpoints))  # checked before any work
    check_output(args.out, early_format(args), args.force)
    natives, metas, target, mult = _prepare(args, args.checkpoints, half=True)
    fmt = output_format(args, metas[0])
    configs = [m.config for m in metas]
    # Before the merge: a bad --limit or missing data costs nothing. Outside models with no --data-file are merged
    # and written, not evaluated.
    test = _test_split(metas[0], target, args) if args.data_file or metas[0].dataset else None
    setup = _setup(args, args.method, target, natives, metas)
    written = {"generate_seconds": round(writing_seconds(setup.train), 3)} if args.generated else {}
    result, report = _merge_and_save(args, natives, metas, setup, (mult, fmt), weights)
    report |= written  # the time the inputs took to write the training text, beside universe_seconds
    if test is None:
        _print_unevaluated(report)
        return 0
    steps = grid_steps(len(natives), simplex_points(args, len(natives)))
    report |= _evaluate(args, natives, configs, setup, test, steps, result)
    _print_merge(report)
    if args.json:
        write_report(args.json, report, "merge")
    return 0


def merge(natives: list[dict], metas: list[CheckpointMeta], setup: MergeSetup,
          weights: list[float] | None = None) -> UniverseResult:
    """The checkpoints merged by the library's one merge (:func:`glmc.merging.merge.merge_models`), weighted by
    ``weights`` (None: equally), lazily: the inputs are mapped from their files, and no copy of a model is held."""
    from glmc.merging.merge import merge_models
    from glmc.merging.universe import members

    return merge_models(members(natives, [m.config for m in metas], weights), setup, lazy=True).universe


def _print_unevaluated(report: dict[str, Any]) -> None:
    print("no held-out data (these models name no glmc dataset): the merge is written but not evaluated; pass "
          "--data-file to measure it", file=sys.stderr)
    print(json.dumps({k: report[k] for k in ("out", "format", "method", "universe_seconds")}))


def _write_merged(args: argparse.Namespace, native: Mapping[str, Any], metas: list[CheckpointMeta],
                  setup: MergeSetup, written_as: tuple[float, str]) -> None:
    """The merged native model written to --out as a standard checkpoint of width multiplier and format
    ``written_as``, stored as --dtype."""
    from glmc.io.formats import write

    mult, fmt = written_as
    inputs = ", ".join(p.name for p in args.checkpoints)
    split = f"merged from {len(metas)} checkpoints by {setup.options.method}: {inputs}"
    meta = dataclasses.replace(metas[0], config=setup.target, width_mult=mult, seed=None, split=split, metrics={},
                               train={})
    write(args.out, fmt, native, meta, args.dtype)


def _merge_and_save(args: argparse.Namespace, natives: list[dict], metas: list[CheckpointMeta], setup: MergeSetup,
                    written_as: tuple[float, str], weights: list[float] | None,
                    ) -> tuple[UniverseResult, dict[str, Any]]:
    """The merge, then the merged model written (:func:`_write_merged`)."""
    from glmc.archs import get_arch

    result = merge(natives, metas, setup, weights)
    # the native model made tensor by tensor as it is written: no native copy of the merged model is held
    _write_merged(args, get_arch(setup.target.family).native_view(result.merged, setup.target), metas, setup,
                  written_as)
    options, corrections = setup.options, setup.options.corrections
    return result, {"out": str(args.out), "format": written_as[1], "dtype": args.dtype, "method": options.method,
                    "circuit_heads": corrections.circuit_heads, "restore_norms": corrections.restore_norms,
                    "repair": corrections.repair,
                    "refit": corrections.refit, "matcher": dataclasses.asdict(options.match.weight),
                    "target": setup.target.to_dict(),
                    "weights": weights, "universe": result.history_dicts(), "universe_seconds": result.seconds}


def _evaluate(args: argparse.Namespace, natives: list[dict], configs: list, setup: MergeSetup, test: Dataset,
              steps: int, result: UniverseResult) -> dict[str, Any]:
    """Test metrics of every input, the merge and the ensemble; the simplex barrier; across widths, Fig. 3c."""
    from glmc.merging.evaluation import evaluate_merge, width_barriers

    report = evaluate_merge(result, natives, configs, setup, test, steps)
    report["inputs"] = [{"path": str(p), "width": c.width} | m
                        for p, c, m in zip(args.checkpoints, configs, report["inputs"], strict=True)]
    if len({(c.width, c.mlp, c.heads) for c in configs}) > 1:
        report["width_barriers"] = width_barriers(natives, configs, setup, test)
    return report


def _print_merge(report: dict[str, Any]) -> None:
    """A short human summary, then the headline figures as one JSON line."""
    for row in report["inputs"]:
        print(f"input   {row['path']:48s} width {row['width']:4d}  loss {row['loss']:.4f}  acc {row['accuracy']:.4f}")
    for name in ("merged", "ensemble"):
        print(f"{name:8s}{'':55s}  loss {report[name]['loss']:.4f}  acc {report[name]['accuracy']:.4f}")
    simplex = report["simplex"]
    print(f"simplex barrier (Eq. 2) {simplex['barrier']:.4f} over {len(simplex['weights'])} weights; "
          f"universe matching {report['universe_seconds']:.1f} s", file=sys.stderr)
    headline = {"method": report["method"], "merged_accuracy": report["merged"]["accuracy"],
                "merged_loss": report["merged"]["loss"], "ensemble_accuracy": report["ensemble"]["accuracy"],
                "mean_input_accuracy": sum(r["accuracy"] for r in report["inputs"]) / len(report["inputs"]),
                "simplex_barrier": simplex["barrier"], "universe_seconds": round(report["universe_seconds"], 2)}
    print(json.dumps(headline | {"width_barriers": [round(w["barrier"], 4) for w in report.get("width_barriers", [])]}))


def width_curves(args: argparse.Namespace, natives: list[dict], metas: list[CheckpointMeta]) -> list[dict[str, Any]]:
    """``glmc barrier WIDE NARROW``: per method, NARROW embedded into WIDE's width and aligned to it as ``glmc merge``
    aligns an input (paper Fig. 3c); the pair's barrier curves."""
    from glmc.merging.evaluation import width_barriers

    methods = args.method or ["weight"]
    check_across_widths(args, methods, {"--repair": args.repair, "--form": args.form != "standard",
                                        "--circuit-heads": args.circuit_heads})
    target = metas[0].config
    test = _test_split(metas[0], target, args)
    curves = []
    for method in methods:
        setup = _setup(args, method, target, natives, metas, learn_samples=None)  # learned: the whole split
        (row,) = width_barriers(natives, [m.config for m in metas], setup, test, args.points)
        curves.append(row["curve"] | {"align_seconds": row["align_seconds"]})
        print(f"{method:12s} barrier {row['barrier']:.4f}  align {row['align_seconds']:.2f} s", file=sys.stderr)
    return curves


def check_across_widths(args: argparse.Namespace, methods: list[str], flags: dict[str, Any]) -> None:
    """Refuse, before any work, the methods and the given ``flags`` that only pairs of one width support: a narrower
    B is embedded into A's width and aligned as ``glmc merge`` aligns an input (weight-matching flags included)."""

    for flag, given in flags.items():
        if given:
            raise ConfigError(f"{flag} applies to two models of one width, not to {args.a} and {args.b}")
    if unknown := [m for m in methods if m not in MERGE_METHODS]:
        raise ConfigError(f"across widths the methods are {', '.join(MERGE_METHODS)}; not {', '.join(unknown)}")


def align_across_widths(args: argparse.Namespace, natives: list[dict], metas: list[CheckpointMeta],
                        ) -> tuple[dict, ModelConfig, float]:
    """``glmc align WIDE NARROW``: NARROW embedded into WIDE's width and aligned to it (canonical, float64), the
    config that computes it exactly (WIDE's, LayerNorm eps scaled by d/D) and the seconds it took."""
    import torch

    from glmc.archs import get_arch
    from glmc.merging.merge import align_to_wide
    from glmc.merging.widths import embedding_config
    from glmc.symmetry.canonical import canonicalize

    check_across_widths(args, [args.method], {})
    target = metas[0].config
    wide = canonicalize(get_arch(target.family), natives[0], target, dtype=torch.float64)
    pair = align_to_wide(wide, natives[1], metas[1].config, _setup(args, args.method, target, natives, metas,
                                                                   learn_samples=None))
    return pair.aligned[0], embedding_config(pair.placements[0]), pair.seconds


def add_simplex_arguments(parser: argparse.ArgumentParser) -> None:
    """``glmc barrier --simplex A B C``: A is the flag's value, B and C the pair positionals."""
    parser.add_argument("--simplex", type=Path, metavar="A", help="with the positionals B C: loss over the simplex "
                        "of three models A B C, merged per --method (paper Fig. 4; default: the pair's curves)")
    parser.add_argument("--simplex-steps", type=int, default=10, help="simplex grid: weights in multiples of 1/N")
    add_universe_arguments(parser)


def run_simplex(args: argparse.Namespace) -> int:
    """Align A, B, C into one universe per method; the loss over the simplex grid, its barrier, a heat map."""
    import torch

    from glmc.merging.evaluation import simplex_barrier

    if args.simplex_steps < 2:
        raise ConfigError("--simplex-steps must be at least 2")
    paths = [args.simplex, args.a, args.b]
    natives, metas, target, _ = _prepare(args, paths)
    test = _test_split(metas[0], target, args)
    panels = []
    for method in args.method or ["none", "weight"]:
        setup = _setup(args, method, target, natives, metas)
        result = merge(natives, metas, setup)
        panel = simplex_barrier(result.aligned, target, test, args.simplex_steps, method=method,
                                dtype=torch.float32).to_dict()
        panels.append(panel | {"universe_seconds": result.seconds})
        print(f"{method:12s} simplex barrier {panel['barrier']:.4f}  merge {result.seconds:.2f} s", file=sys.stderr)
    _write_simplex(args, paths, panels)
    return 0


def _write_simplex(args: argparse.Namespace, paths: list[Path], panels: list[dict[str, Any]]) -> None:
    from glmc.plots import plot_simplex

    if args.json:
        write_report(args.json, {"models": [str(p) for p in paths], "steps": args.simplex_steps, "panels": panels},
                     "barrier")
    if args.plot:
        plot_simplex([(f"{p['method']} (barrier {p['barrier']:.3f})", p["weights"], p["losses"]) for p in panels],
                     args.plot, names=[f"{p.parent.name}/{p.stem}" for p in paths])
    print(json.dumps({p["method"]: round(p["barrier"], 4) for p in panels}))
