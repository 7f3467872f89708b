"""``glmc barrier``: the loss barrier between two checkpoints on held-out data, per alignment method (paper Eq. 1)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from glmc.cli import merge as cli_merge
from glmc.cli.data_options import count, test_data, training_data
from glmc.cli.outputs import write_report
from glmc.cli.pair import FORM_NAMES, METHOD_NAMES, add_pair_arguments, align_loaded, load_pair
from glmc.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from glmc.core.config import ModelConfig
    from glmc.core.state import State
    from glmc.io.checkpoint import CheckpointMeta
    from glmc.match.common import MatchResult


def add_barrier_arguments(parser: argparse.ArgumentParser) -> None:
    add_pair_arguments(parser)
    parser.add_argument("--method", action="append", help=f"repeatable: {METHOD_NAMES}; default: weight")
    parser.add_argument("--points", type=int, default=21, help="λ grid size, both ends included")
    parser.add_argument("--limit", type=int, help="evaluate on the first N held-out samples only (default: all)")
    parser.add_argument("--form", choices=FORM_NAMES, default="standard",
                        help="the parameters the path interpolates: standard (the models as they are), rmsnorm "
                             "(LayerNorm as RMSNorm, the residual aligned over the whole O(d)), circuit (each head "
                             "multiplied out into its QK and OV circuits, paper §3.2.2) or circuit-rmsnorm (both, as "
                             "the official GLMC code interpolates); all but standard change the architecture, as the "
                             "paper's barriers do")
    parser.add_argument("--json", type=Path, help="write the curves here (default: none; the barriers are printed)")
    parser.add_argument("--plot", type=Path, help="write a loss/accuracy plot here (.png; default: none)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --json or --plot that glmc did "
                        "not write (a report or plot glmc wrote is replaced without it)")
    parser.add_argument("--repair", type=count, metavar="N",
                        help="REPAIR every point of the path first (Jordan et al. 2022): reset each channel's mean "
                             "and std to the λ-mean of A's and B's, measured on N training samples; each curve is "
                             "named METHOD+repair (default: off)")
    parser.add_argument("--circuit-heads", action="store_true",
                        help="merge every point's heads as circuits: refit each head's factors to the λ-mean of A's "
                             "and B's QK and OV circuits (truncated SVD), so a standard model follows the circuits' "
                             "path; each curve is named METHOD+circuits (every family; default: off)")
    cli_merge.add_simplex_arguments(parser)


def run_barrier(args: argparse.Namespace) -> int:
    """Align B to A by each method and measure the loss barrier on held-out data (paper Eq. 1)."""
    import torch

    from glmc.merging.circuits import require_circuit_layout
    from glmc.merging.interpolation import barrier_curve

    if args.simplex:
        for flag, given in (("--repair", args.repair), ("--form", args.form != "standard"),
                            ("--circuit-heads", args.circuit_heads)):
            if given:
                raise ConfigError(f"{flag} applies to the pairwise curves, not to --simplex")
        return cli_merge.run_simplex(args)
    if args.points < 2:
        raise ConfigError("--points must be at least 2")
    if args.repair and args.form != "standard":
        raise ConfigError(f"--repair needs the standard form, not --form {args.form}")
    methods = args.method or ["weight"]
    state_a, state_b, meta, meta_b = load_pair(args.a, args.b, half=all(_streamed(args, m) for m in methods))
    if args.circuit_heads:
        require_circuit_layout(meta.config, args.form)  # before any alignment
    if meta_b.config != meta.config:
        _write_barrier_outputs(args, cli_merge.width_curves(args, [state_a, state_b], [meta, meta_b]))
        return 0
    test = test_data(meta, meta.config, args)
    repair = training_data(meta, args, args.repair, ([state_a, state_b], [meta.config] * 2)) if args.repair else None
    curves = []
    for method in methods:
        (a, b, cfg), result = _endpoints(args, method, state_a, state_b, meta)
        name = method + "+circuits" * args.circuit_heads + "+repair" * (repair is not None)
        curve = barrier_curve(a, b, cfg, test, args.points, form=args.form, method=name, dtype=torch.float32,
                              repair_data=repair, circuit_heads=args.circuit_heads)
        curves.append(curve.to_dict() | {"align_seconds": result.seconds, "align_info": result.info})
        print(f"{name:12s} barrier {curve.barrier:.4f}  align {result.seconds:.2f} s", file=sys.stderr)
    _write_barrier_outputs(args, curves)
    return 0


def _streamed(args: argparse.Namespace, method: str) -> bool:
    """Whether ``method``'s path is made one tensor at a time at each λ from the aligned pair, itself folded and moved
    per tensor from the inputs as read (half precision as stored): a data-free matching in the standard form, without
    --circuit-heads or --repair. The rest round the aligned pair to float32 and hold it whole (:func:`_in_float32`):
    ``none``'s pair (the models' own parameters), a data-driven method's alignment and a centred form's canonical
    pair are made whole anyway, a circuit form multiplies whole layers out, and --circuit-heads and --repair read
    every tensor of both ends at each point (docs/scaling.md)."""
    from glmc.match.registry import get_method

    entry, whole = get_method(method), args.form != "standard" or args.circuit_heads or bool(args.repair)
    return entry.matches and not entry.reads_data and not whole


def _endpoints(args: argparse.Namespace, method: str, state_a: dict, state_b: dict, meta: CheckpointMeta,
               ) -> tuple[tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor], ModelConfig], MatchResult]:
    """A and B aligned by ``method`` in the form's parameters, and how B was moved. Where :func:`_streamed`, both are
    :class:`glmc.core.state.Lazy` (float64, made on each read), so the curve holds the inputs and the one model it
    evaluates; else both are rounded to float32 one at a time (a data-driven method's float64 pair dropped once
    rounded), so the curve holds the inputs, these two endpoints and that model."""
    from glmc.device import release_heap

    aligned = align_loaded(args, method, state_a, state_b, meta, args.form, lazy=True)  # learned: the form's path
    if _streamed(args, method):
        release_heap()  # what the matching freed, before the path's model is built and its points made into it
        return (aligned.a, aligned.b, meta.config), aligned.result
    (a, cfg), (b, _) = (_in_float32(s, meta.config, args.form) for s in (aligned.a, aligned.b))  # one at a time
    return (a, b, cfg), aligned.result


def _in_float32(state: Mapping[str, torch.Tensor], cfg: ModelConfig, form: str) -> tuple[State, ModelConfig]:
    """An aligned canonical endpoint in the form's parameters (a circuit form's made from the standard state in its
    precision), rounded to float32, and its config."""
    import torch

    from glmc.core.state import cast
    from glmc.symmetry.canonical import CIRCUITS, to_circuit

    if form in CIRCUITS:
        state, cfg = to_circuit(state, cfg)
    return cast(state, torch.float32), cfg


def _write_barrier_outputs(args: argparse.Namespace, curves: list[dict]) -> None:
    from glmc.merging.interpolation import BarrierCurve
    from glmc.plots import plot_barrier_curves

    report = {"a": str(args.a), "b": str(args.b), "points": args.points, "form": args.form,
              "curves": curves}
    if len(curves) == 1:
        report |= curves[0]
    if args.json:
        write_report(args.json, report, "barrier")
    if args.plot:
        fields = BarrierCurve.__dataclass_fields__
        plot_barrier_curves([BarrierCurve(**{k: c[k] for k in fields}) for c in curves], args.plot)
    print(json.dumps({c["method"]: round(c["barrier"], 4) for c in curves}))
