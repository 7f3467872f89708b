"""Options of weight matching, declared once for ``glmc align``, ``barrier`` and ``merge``: where it starts, its
costs and when it stops."""

from __future__ import annotations

import argparse
import typing
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from glmc.match.weight import Start, WeightOptions

START_NAMES = ["relaxed", "identity", "embeddings"]  # glmc.match.weight.STARTS, the default (DEFAULT_START) first
# glmc.match.weight.WeightOptions' choices, each field's default first: flag → (field, choices, what they mean)
WEIGHT_FLAGS = {
    "--head-cost": ("head_cost", ["norm", "squared"], "the head assignment's cost: ‖ΔQK‖ + ‖ΔOV‖ or ‖ΔQK‖² + ‖ΔOV‖²"),
    "--mlp-cost": ("mlp_cost", ["inner", "l1"], "the MLP assignment's: the inner product of the units' weights, "
                   "or the L1 distance between their L2-normalised rows (slow at large widths)"),
    "--stop": ("stop", ["converged", "fixed"], "sweeps end when the objective stops improving, or run all 15"),
    "--biases": ("biases", ["skip", "read"], "the residual Procrustes leaves the stream's biases (LayerNorm and "
                 "output biases) out, as the official code does, or reads them, each weighted as a whole tensor"),
    "--ov-maps": ("ov_maps", ["orthogonal", "path"], "the within-head v/o maps: orthogonal, or invertible maps that "
                  "bring the models' own path onto the circuit path (method weight only; data-free)"),
}


def add_weight_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--start", choices=START_NAMES,
                        help="where weight matching (and the learned methods, which begin from it) starts the "
                             "residual map: 'relaxed' (default): solved first with every unit map relaxed to an "
                             "orthogonal one, which assumes nothing of B's basis; 'identity' (the old default, "
                             "which can end in a local optimum even for a transformed copy of B); or 'embeddings': "
                             "Procrustes on the embeddings and the head alone (the official GLMC code's first step)")
    for flag, (_, choices, what) in WEIGHT_FLAGS.items():
        parser.add_argument(flag, choices=choices, help=f"weight matching: {what} (default {choices[0]})")


def _given(args: argparse.Namespace) -> dict[str, str | None]:
    """Each weight flag's value, None where it was not given."""
    return {flag: getattr(args, flag[2:].replace("-", "_")) for flag in ["--start", *WEIGHT_FLAGS]}


def weight_start(args: argparse.Namespace) -> Start:
    """The residual start the flags give."""
    return typing.cast("Start", args.start or START_NAMES[0])


def weight_options(args: argparse.Namespace) -> WeightOptions:
    """The weight-matching options the flags give (the defaults for those not given)."""
    from glmc.match.weight import WeightOptions

    given = _given(args)
    return WeightOptions(**{field: given[flag] for flag, (field, _, _) in WEIGHT_FLAGS.items()  # type: ignore[arg-type]
                            if given[flag] is not None})


def parse_weight_flags(flags: list[str]) -> tuple[Start, WeightOptions]:
    """The start and options that a list of these flags names (a bench config's ``matcher``), for library calls."""
    parser = argparse.ArgumentParser(prog="matcher")
    add_weight_arguments(parser)
    given = parser.parse_args(flags)
    return weight_start(given), weight_options(given)
