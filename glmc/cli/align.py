"""``glmc align``: checkpoint B moved next to A by a symmetry, written as a checkpoint that computes B."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from glmc.cli import export as cli_export
from glmc.cli import merge as cli_merge
from glmc.cli.pair import METHOD_NAMES, add_pair_arguments, align_loaded, load_pair


def add_align_arguments(parser: argparse.ArgumentParser) -> None:
    add_pair_arguments(parser)
    parser.add_argument("--method", default="weight", help=f"one of {METHOD_NAMES}")
    parser.add_argument("--out", required=True, type=Path, help="aligned B, a standard checkpoint (at A's width)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out")
    cli_export.add_format_argument(parser)
    cli_merge.add_fill_argument(parser)


def run_align(args: argparse.Namespace) -> int:
    """Write B transformed towards A as a standard checkpoint (same function as B)."""
    import dataclasses

    from glmc.archs import get_arch
    from glmc.io.formats import check_output, write

    check_output(args.out, cli_export.early_format(args), args.force)
    state_a, state_b, meta, meta_b = load_pair(args.a, args.b)
    fmt = cli_export.output_format(args, meta_b)
    config = meta.config
    if meta_b.config != config:  # embedded into A's width: a checkpoint of A's shapes computing B
        moved, config, seconds = cli_merge.align_across_widths(args, [state_a, state_b], [meta, meta_b])
        report: dict = {"seconds": round(seconds, 3), "width": [meta_b.config.width, config.width]}
    else:
        aligned = align_loaded(args, args.method, state_a, state_b, meta)
        moved, result = aligned.b, aligned.result
        report = {"seconds": round(result.seconds, 3), "objective": result.objective,
                  **{k: v for k, v in result.info.items() if k != "sweeps"}}
    native = get_arch(config.family).to_native(moved, config)
    split = f"{meta_b.split}; aligned to {args.a.name} by {args.method}"
    out_meta = dataclasses.replace(meta_b, config=config, width_mult=meta.width_mult, split=split)
    write(args.out, fmt, native, out_meta, args.dtype)
    print(json.dumps({"out": str(args.out), "format": fmt, "dtype": args.dtype, "method": args.method, **report}))
    return 0
