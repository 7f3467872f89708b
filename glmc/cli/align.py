"""``glmc align``: checkpoint B moved next to A by a symmetry, written as a checkpoint that computes B."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from glmc.cli import export as cli_export
from glmc.cli import merge as cli_merge
from glmc.cli.pair import METHOD_NAMES, PRECISIONS, add_pair_arguments, align_loaded, load_pair
from glmc.errors import ConfigError

PRECISION_HELP = ("what B is folded and moved in, and, for data-driven methods, what the two models are held in: "
                  "float64 (exact), float32 or stored, each model in its file's precision (the search reads it "
                  "tensor by tensor in float32, and B is moved in float32 and rounded once; data-free methods only). "
                  "Data-free methods hold only the two models as stored and make every canonical and moved tensor "
                  "one at a time")


def add_align_arguments(parser: argparse.ArgumentParser) -> None:
    add_pair_arguments(parser)
    parser.add_argument("--method", default="weight", help=f"one of {METHOD_NAMES}")
    parser.add_argument("--out", required=True, type=Path, help="aligned B, a standard checkpoint (at A's width)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out")
    parser.add_argument("--precision", choices=PRECISIONS, default="float64", help=PRECISION_HELP)
    cli_export.add_format_argument(parser)
    cli_merge.add_fill_argument(parser)


def run_align(args: argparse.Namespace) -> int:
    """Write B transformed towards A as a standard checkpoint (same function as B)."""
    import dataclasses

    from glmc.archs import get_arch
    from glmc.core.state import Lazy
    from glmc.device import release_heap
    from glmc.io.formats import check_output, write
    from glmc.match.registry import get_method

    check_output(args.out, cli_export.early_format(args), args.force)
    lazy = not get_method(args.method).reads_data  # data-free: the pair is folded, moved and written tensor by tensor
    state_a, state_b, meta, meta_b = load_pair(args.a, args.b, stored=args.precision == "stored", half=lazy)
    fmt = cli_export.output_format(args, meta_b)
    config = meta.config
    if meta_b.config != config and args.precision != "float64":
        raise ConfigError("--precision applies to a pair of one width; B is embedded into A's width in float64")
    if not lazy:
        require_room([state_a, state_b], args.precision)
    if meta_b.config != config:  # embedded into A's width: a checkpoint of A's shapes computing B
        moved, config, seconds = cli_merge.align_across_widths(args, [state_a, state_b], [meta, meta_b])
        report: dict = {"seconds": round(seconds, 3), "width": [meta_b.config.width, config.width]}
    else:
        aligned = align_loaded(args, args.method, state_a, state_b, meta, precision=args.precision, lazy=lazy)
        moved, result = aligned.b, aligned.result
        report = {"seconds": round(result.seconds, 3), "objective": result.objective,
                  **{k: v for k, v in result.info.items() if k != "sweeps"}}
    arch = get_arch(config.family)
    release_heap()  # what the matching freed, before B is made and written tensor by tensor
    native = arch.native_view(moved, config) if isinstance(moved, Lazy) else arch.to_native(moved, config)
    split = f"{meta_b.split}; aligned to {args.a.name} by {args.method}"
    out_meta = dataclasses.replace(meta_b, config=config, width_mult=meta.width_mult, split=split)
    write(args.out, fmt, native, out_meta, args.dtype)
    print(json.dumps({"out": str(args.out), "format": fmt, "dtype": args.dtype, "method": args.method, **report}))
    return 0


WORKING_COPIES = 4  # what aligning by a data-driven method holds beyond the two models read, in models of the
# precision: the folded canonical tensors, the moved B and the matching's per-layer copies (measured: a float32
# TinyLlama-1.1B pair peaked above 24 GB, 8.8 GB of it the two models). Data-free methods hold none of them whole.


def require_room(states: list[dict], precision: str) -> None:
    """ConfigError before the work where aligning by a data-driven method in ``precision`` would need more memory
    than the system has available now (Linux's MemAvailable; elsewhere, and for ``stored``, nothing is checked)."""
    from glmc.device import available_memory

    itemsize = {"float64": 8, "float32": 4}.get(precision)
    available = available_memory()
    if itemsize is None or available is None:
        return
    params = max(sum(v.numel() for v in state.values()) for state in states)
    need = WORKING_COPIES * itemsize * params
    if need > available:
        raise ConfigError(f"aligning {params / 1e9:.2f}B-parameter models in {precision} needs about {need / 1e9:.1f} "
                          f"GB beyond the two read, and {available / 1e9:.1f} GB is available: "
                          f"{'pass --precision float32, or ' * (precision == 'float64')}align them by a data-free "
                          "method (weight), which holds only the two models")
