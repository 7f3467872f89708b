"""``glmc export`` (a checkpoint of any format written as a Hugging Face folder, a timm state dict or a glmc
checkpoint) and the ``--format`` option that ``align`` and ``merge`` share."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from glmc.io.checkpoint import CheckpointMeta

FORMAT_NAMES = ["glmc", "hf", "timm"]  # glmc.io.formats.FORMATS, without importing torch
DTYPE_NAMES = ["float32", "float16", "bfloat16"]  # glmc.io.formats.DTYPES, likewise
DTYPE_HELP = ("the precision the output's tensors are stored in (default float32); glmc computes in float32 or "
              "float64 and reads any of these back as float32, so float16 and bfloat16 halve the file at the cost of "
              "their rounding")
FORMAT_HELP = ("what --out is: glmc (a .safetensors checkpoint), hf (a Hugging Face folder for from_pretrained) or "
               "timm (a .safetensors state dict with timm.create_model kwargs in a .json beside it, or, for an --out "
               "without .safetensors, a timm Hub folder); default: for an --out without .safetensors a folder, hf "
               "for a GPT-2 or an HF ViT and timm for another ViT, else the format of the model written (B for "
               "align, the first input for merge)")


def add_format_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=FORMAT_NAMES, help=FORMAT_HELP)
    add_dtype_argument(parser)


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="float32", help=DTYPE_HELP)


def early_format(args: argparse.Namespace) -> str:
    """The output format as far as the flags tell before any input is read (timm is told by its input)."""
    return args.format or ("glmc" if args.out.suffix == ".safetensors" else "hf")


def output_format(args: argparse.Namespace, meta: CheckpointMeta) -> str:
    """The output format: --format, else for a folder hf (a GPT-2, or a ViT read from HF) or timm (another ViT),
    else the first input's (timm stays timm)."""
    from glmc.cli.outputs import check_outputs
    from glmc.io.formats import check_output, format_of

    fmt = args.format or early_format(args)
    if args.format is None and ((fmt == "glmc" and format_of(meta) == "timm") or
                                (fmt == "hf" and meta.config.family == "vit" and format_of(meta) != "hf")):
        fmt = "timm"
    check_output(args.out, fmt, args.force)
    check_outputs(args, fmt)  # a timm state dict writes its kwargs JSON too: on no input, no other output
    return fmt


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, help="a glmc checkpoint, Hugging Face folder or timm state dict")
    out = parser.add_mutually_exclusive_group(required=True)
    out.add_argument("--hf", type=Path, metavar="DIR", help="write a Hugging Face folder (a GPT-2, or a ViT "
                     "ViTForImageClassification can hold); one of --hf, --timm, --glmc is required")
    out.add_argument("--timm", type=Path, metavar="PATH", help="write a timm ViT: a state dict PATH.safetensors "
                     "with its create_model kwargs in PATH.json, or a timm Hub folder PATH (no .safetensors); or --hf, "
                     "--glmc")
    out.add_argument("--glmc", type=Path, metavar="FILE", help="write a glmc checkpoint (.safetensors); or --hf, "
                                                               "--timm")
    add_dtype_argument(parser)
    parser.add_argument("--force", action="store_true", help="overwrite an existing output")


def run_export(args: argparse.Namespace) -> int:
    """Read the checkpoint and write it, unchanged but for the asked precision, in the asked format."""
    from glmc.io.formats import check_output, read, write

    fmt, out = next((name, getattr(args, name)) for name in FORMAT_NAMES if getattr(args, name) is not None)
    check_output(out, fmt, args.force)
    state, meta = read(args.checkpoint)
    write(out, fmt, state, meta, args.dtype)
    print(json.dumps({"out": str(out), "format": fmt, "dtype": args.dtype, "family": meta.config.family}))
    return 0
