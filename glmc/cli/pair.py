"""What ``glmc align`` and ``glmc barrier`` share: the two checkpoints, their loading, one alignment of B to A."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from glmc.cli.data_options import add_data_arguments, training_data
from glmc.cli.options import add_match_arguments, match_options
from glmc.errors import ConfigError
from glmc.match.options import ActivationOptions
from glmc.match.registry import METHODS, get_method

ACTIVATION_SAMPLES = ActivationOptions.batch  # default --batch of activation matching
METHOD_NAMES = ", ".join(METHODS)
PRECISIONS = ["float64", "float32", "stored"]  # what align holds the canonical pair in (stored: the files' own)
FORM_NAMES = ["standard", "rmsnorm", "circuit", "circuit-rmsnorm"]  # canonical.FORMS, torch-free

if TYPE_CHECKING:
    from glmc.io.checkpoint import CheckpointMeta
    from glmc.match.align import Alignment
    from glmc.symmetry.canonical import Form


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", type=Path, help="reference checkpoint A (glmc .safetensors, Hugging Face folder or timm "
                        "state dict)")
    parser.add_argument("b", type=Path, help="checkpoint B, moved towards A (B may be narrower: then it is "
                        "embedded into A's width first, as glmc merge embeds its inputs)")
    add_data_arguments(parser, "training samples given to data-driven methods (default: "
                       f"{ACTIVATION_SAMPLES} for activation, the whole training split for learned ones)")
    add_match_arguments(parser, skip=["concentration"])


def load_pair(a: Path, b: Path, stored: bool = False, half: bool = False,
              ) -> tuple[dict, dict, CheckpointMeta, CheckpointMeta]:
    """Both checkpoints (in float32, or ``stored``: in their files' precision; ``half``: a half-precision file in
    its own, any other in float32, as read so: widening half precision later is exact; a pair of two widths in
    float32, as B is embedded), refusing before any work a NaN or inf (named as the file names it), different
    families or a B that does not fit inside A (only widths may differ, and B is then embedded into A's width)."""
    import torch

    from glmc.core.spec import check_same_shapes
    from glmc.core.state import cast
    from glmc.io.formats import read
    from glmc.match.common import require_finite
    from glmc.merging.widths import check_embeddable

    state_a, meta_a = read(a, stored=stored or half)
    state_b, meta_b = read(b, stored=stored or half)
    if half and not stored:
        state_a, state_b = (half_or_float32(s) if meta_a.config == meta_b.config else cast(s, torch.float32)
                            for s in (state_a, state_b))
    require_finite(state_a, str(a))
    require_finite(state_b, str(b))
    if meta_a.config.family != meta_b.config.family:
        raise ConfigError(f"{a} is a {meta_a.config.family} but {b} is a {meta_b.config.family}")
    if meta_a.config != meta_b.config:
        check_embeddable(meta_b.config, meta_a.config)
    else:
        check_same_shapes(state_a, state_b)
    return state_a, state_b, meta_a, meta_b


def half_or_float32(state: dict) -> dict:
    """Each floating-point tensor in its own precision where that is half, else in float32 (what ``read`` gives)."""
    import torch

    from glmc.core.state import HALF

    return {k: v if v.dtype in HALF or not v.is_floating_point() else v.to(torch.float32) for k, v in state.items()}


def align_loaded(args: argparse.Namespace, method: str, state_a: dict, state_b: dict, meta: CheckpointMeta,
                 form: Form = "standard", precision: str = "float64", lazy: bool = False) -> Alignment:
    """B aligned to A by ``method`` with the flags' options, the canonical states held in ``precision``
    (:data:`PRECISIONS`); ``lazy``: made tensor by tensor, never held whole (``align_pair``'s ``lazy``)."""
    import torch

    from glmc.data.generated import writing_seconds
    from glmc.match.align import align_pair

    entry = get_method(method)
    samples = args.batch or (None if entry.learns else ACTIVATION_SAMPLES)
    options = match_options(args, form, batch=samples)
    data = training_data(meta, args, samples, ([state_a, state_b], [meta.config] * 2)) \
        if entry.reads_data else None
    written = writing_seconds(data)
    aligned = align_pair(state_a, state_b, meta.config, method, options, data=data, device=args.device,
                         dtype=getattr(torch, precision) if precision != "stored" else None, lazy=lazy)
    if written:  # sampling the text is part of the method's cost
        aligned.result.seconds += written
        aligned.result.info["generate_seconds"] = round(written, 3)
    return aligned
