"""Candidates for weight matching's residual map Q, scored against the learned one without learning again. The
learned-gap bench found that the learned Q carries most of learned matching's gain, turned furthest in the
directions where A's stream varies most; each candidate here replaces weight matching's Q (its unit maps kept)
and is scored by the barrier and by its distance to the learned Q. Reads the maps that bench saved.

    .venv/bin/python -m simulations.analyses.q_candidates [--config simulations/bench/configs/barriers.toml]
        [--models NAME ...]

The stream candidates solve weight matching's Procrustes step on the cross-moment E[x_A x_Bᵀ] of the two
models' normalised streams (what each block's attention reads) on the same inputs, alone or added to the weights'
Procrustes input at the same norm: on test inputs (this reads data), or on synthetic ones (standard normal images,
uniform random tokens: data-free).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch.utils.data import Dataset

from glmc.archs import get_arch
from glmc.cli.options import parse_match_flags
from glmc.core.config import ModelConfig
from glmc.core.state import State
from glmc.data.tasks import held_out, inputs_of
from glmc.io.checkpoint import load_checkpoint
from glmc.match.align import align_pair
from glmc.match.descent import Descent
from glmc.symmetry import groups
from glmc.symmetry.canonical import canonicalize
from glmc.symmetry.transforms import Transform, apply
from simulations.analyses.learned_gap import STREAM_SAMPLES, real_schur, stream_tokens
from simulations.analyses.weight_starts import barrier
from simulations.bench.barriers import label, machine, mean_se, seed_checkpoints, table_main

BEYOND = 1.25  # the learned correction extrapolated: does learning stop short along its own direction?
DATA_FREE = {"weight": True, "learned Q": False, f"learned correction × {BEYOND}": False,
             "stream cross-moment (test inputs)": False, "weight + stream cross-moment (test inputs)": False,
             "stream cross-moment (synthetic inputs)": True, "weight + stream cross-moment (synthetic inputs)": True}


def synthetic(like: torch.Tensor, cfg: ModelConfig, seed: int = 0) -> torch.Tensor:
    """Inputs shaped like ``like`` that owe nothing to the data: standard normal images, or tokens drawn uniformly
    from the vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    if like.is_floating_point():
        return torch.randn(like.shape, generator=generator, dtype=like.dtype)
    return torch.randint(0, cfg.vocab_size, like.shape, generator=generator)


def cross_moment(a: State, b: State, cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """E[x_A x_Bᵀ] of the two models' normalised streams on the same inputs, over every token and block."""
    xa, xb = stream_tokens(a, cfg, x), stream_tokens(b, cfg, x)
    return xa.T @ xb / len(xa)


def extrapolated(q_w: torch.Tensor, q_l: torch.Tensor, scale: float) -> torch.Tensor:
    """Q_w R^scale for the learned correction R = Q_wᵀ Q_l: each of R's invariant planes turned ``scale`` times
    as far (a reflection, R's eigenvalue −1, is kept as it is)."""
    schur, basis, blocks = real_schur(q_w.T @ q_l.to(q_w))
    for plane in (block for block in blocks if len(block) == 2):
        turn = scale * np.arctan2(schur[plane[1], plane[0]], schur[plane[0], plane[0]])
        schur[np.ix_(plane, plane)] = [[np.cos(turn), -np.sin(turn)], [np.sin(turn), np.cos(turn)]]
    return q_w.double().cpu() @ torch.from_numpy(basis @ schur @ basis.T)


def candidates(a: State, b: State, cfg: ModelConfig, weight: Transform, q_l: torch.Tensor, test: Dataset,
               ) -> dict[str, torch.Tensor]:
    """Every candidate Q of :data:`DATA_FREE`, given weight matching's result and the learned Q."""
    assert weight.residual is not None
    work = Descent(a, b, get_arch(cfg.family).spec, cfg.depth, cfg.heads)
    procrustes_input = (work.fixed.scaled + work.residual_step(weight)[0]).double()
    real = inputs_of(test, STREAM_SAMPLES)
    out = {"weight": weight.residual.double(), "learned Q": q_l.double(),
           f"learned correction × {BEYOND}": extrapolated(weight.residual, q_l, BEYOND)}
    for kind, x in (("test", real), ("synthetic", synthetic(real, cfg))):
        moment = cross_moment(a, b, cfg, x)
        out[f"stream cross-moment ({kind} inputs)"] = groups.procrustes(moment, True)
        blend = procrustes_input + moment * procrustes_input.norm() / moment.norm()
        out[f"weight + stream cross-moment ({kind} inputs)"] = groups.procrustes(blend, True)
    return out


def pair_candidates(names: tuple[str, str], natives: tuple[State, State], cfg: ModelConfig, test: Dataset,
                    maps: Path, matcher: list[str]) -> dict[str, Any]:
    """One pair: the vanilla barrier, and each candidate's barrier with weight matching's unit maps and its
    distance to the learned Q (relative Frobenius). ``matcher``: the weight-matching flags the maps were made with."""
    if not maps.is_file():
        raise SystemExit(f"missing {maps}: run simulations.analyses.learned_gap on this model first")
    saved = load_file(str(maps))
    arch = get_arch(cfg.family)
    a, b = (canonicalize(arch, s, cfg, dtype=torch.float64) for s in natives)  # as align_pair matches them
    weight = align_pair(*natives, cfg, "weight", parse_match_flags(matcher)).result.transform
    assert weight.residual is not None
    if not torch.allclose(weight.residual.double(), saved["q_weight"].double(), atol=1e-6):
        raise SystemExit(f"weight matching no longer gives {maps}'s Q_w: run simulations.analyses.learned_gap again")
    q_l = saved["q_learned"].double()
    plain = align_pair(*natives, cfg, "none")
    rows = {}
    for name, q in candidates(a, b, cfg, weight, q_l, test).items():
        moved = apply(b, arch.spec, dataclasses.replace(weight, residual=q), cfg.heads)
        rows[name] = {"barrier": barrier(a, moved, cfg, test), "to_learned": float((q - q_l).norm() / q_l.norm())}
    return {"pair": list(names), "vanilla": barrier(plain.a, plain.b, cfg, test), "candidates": rows}


def measure_model(run: dict[str, Any], table: dict[str, Any], model: dict[str, Any], command: str) -> dict[str, Any]:
    """The first ``pairs`` seed pairs of one model (those the learned-gap bench saved), with the wall time."""
    began, limit = time.perf_counter(), model.get("run", {}).get("limit", run["limit"])
    paths = seed_checkpoints(run, model)
    pairs = [(paths[0], p) for p in paths[1:]][:table["pairs"]]
    loaded = {p: load_checkpoint(p) for p in {q for pair in pairs for q in pair}}
    cfg = loaded[paths[0]][1].config
    test = held_out(model["dataset"], cfg, limit=limit)
    maps = Path(run["out"]) / "gap" / label(model)
    reports = [pair_candidates((a.stem, b.stem), (loaded[a][0], loaded[b][0]), cfg, test,
                               maps / f"{a.stem}-{b.stem}.safetensors", table.get("matcher", [])) for a, b in pairs]
    return {"reports": reports, "limit": limit, "command": command, "machine": machine(),
            "seconds": time.perf_counter() - began}


def markdown(name: str, entry: dict[str, Any]) -> list[str]:
    """One model's candidates: barrier ÷ vanilla (mean ± s.e.), per pair, and the distance to the learned Q."""
    reports = entry["reports"]
    lines = [f"## {name}", "", "| Q | data-free | barrier ÷ vanilla | "
             + " | ".join(" / ".join(r["pair"]) for r in reports) + " | ‖Q − Q_l‖ ÷ ‖Q_l‖ |",
             "|---|---|---|" + "---|" * len(reports) + "---|"]
    for candidate, free in DATA_FREE.items():
        ratio, se = mean_se([r["candidates"][candidate]["barrier"] / r["vanilla"] for r in reports])
        distance, _ = mean_se([r["candidates"][candidate]["to_learned"] for r in reports])
        lines.append(f"| {candidate} | {'yes' if free else 'no'} | {100 * ratio:.1f}% ± {100 * se:.1f} | "
                     + " | ".join(f"{r['candidates'][candidate]['barrier']:.3f}" for r in reports)
                     + f" | {distance:.2f} |")
    return [*lines, "", f"Barriers on the first {entry['limit']} test samples, 21 λ values; stream moments over every "
            f"token of {STREAM_SAMPLES} inputs. Command: `{entry['command']}`. Machine: {entry['machine']}; wall "
            f"time {entry['seconds'] / 60:.1f} min.", ""]


HEADING = ["# Candidates for the residual map Q, against the learned one", "",
           "Weight matching's unit maps (heads, MLP units, within-head maps) with each candidate Q. Learned matching "
           "ran from the same weight matching (simulations/results/learned-gap); its Q is the target.", ""]


def main(argv: list[str] | None = None) -> int:
    return table_main(argv, "candidates", "simulations.analyses.q_candidates", __doc__.splitlines()[0], measure_model,
                      None, HEADING, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
