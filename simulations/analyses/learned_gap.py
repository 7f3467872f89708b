"""Where learned matching's gain over weight matching lies. The paper (its Section 6) finds that learned matching
keeps weight matching's permutations and only corrects the residual map Q, so that a better data-free Q would close
most of the gap. Here each pair is weight-matched and learned, then the two are crossed: weight matching with the
learned Q, and learned matching with weight matching's Q. Uses the barrier benchmark's checkpoints (no training).

    .venv/bin/python -m simulations.analyses.learned_gap [--config simulations/bench/configs/barriers.toml]
        [--models NAME ...]

Both matchings run with glmc's defaults but for the table's ``matcher`` weight flags (the learned one after the
model's ``learn`` flags, then the table's ``args``), so the learned one starts from the same weight matching. The
learned correction R = Q_wᵀ Q_l turns a set of invariant planes (its real Schur form); the bench applies it in the
planes that turn most alone, and measures how much of A's stream variance those planes carry: a data-free Q would
have to find them.
Both maps are saved, ``q_weight`` and ``q_learned`` in ``<out>/gap/<model>/<A>-<B>.safetensors``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import scipy.linalg
import torch
from safetensors.torch import save_file
from torch.utils.data import Dataset

from glmc.archs import get_arch
from glmc.cli.data_options import add_data_arguments, train_subset
from glmc.cli.options import add_match_arguments, match_options
from glmc.core.config import ModelConfig
from glmc.core.state import State
from glmc.data.tasks import held_out, inputs_of
from glmc.io.checkpoint import load_checkpoint
from glmc.match.align import align_pair
from glmc.match.options import MatchOptions
from glmc.merging.activations import Hook, Site, hooked_passes
from glmc.symmetry.canonical import canonicalize, to_model
from glmc.symmetry.transforms import Transform, apply
from simulations.analyses.weight_starts import barrier
from simulations.bench.barriers import label, machine, mean_se, seed_checkpoints, table_main

CURVES = ("vanilla", "weight", "weight, learned Q", "learned, weight Q", "learned")
PLANE_SHARES = {"top plane": 0.0, "top eighth of planes": 1 / 8, "top quarter of planes": 1 / 4}  # 0: just one
STREAM_SAMPLES = 64  # test inputs whose every token measures the stream's second moment


def learn_flags(flags: list[str]) -> tuple[MatchOptions, int | None]:
    """The matchers' options and training-sample count that ``glmc barrier`` would take from ``flags``."""
    parser = argparse.ArgumentParser(prog="learning flags")
    add_data_arguments(parser, "training samples")
    add_match_arguments(parser)
    args = parser.parse_args([*flags, "--quiet"])
    return match_options(args), args.batch


def crossed(weight: Transform, learned: Transform) -> dict[str, Transform]:
    """The two matchings and their crossings: each one's unit maps with the other's residual map Q."""
    return {"weight": weight, "weight, learned Q": dataclasses.replace(weight, residual=learned.residual),
            "learned, weight Q": dataclasses.replace(learned, residual=weight.residual), "learned": learned}


def angles(q: torch.Tensor) -> torch.Tensor:
    """The eigen-angles of an orthogonal map, in degrees in [0, 180]: how far it turns each of its planes."""
    return torch.linalg.eigvals(q.double()).angle().abs().rad2deg()


def real_schur(r: torch.Tensor) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
    """The real Schur form R = Z T Zᵀ of an orthogonal R (block diagonal, R being normal: a 2×2 rotation block per
    invariant plane, a 1×1 block at ±1): T, Z and each block's indices, in float64."""
    schur, basis = scipy.linalg.schur(r.double().cpu().numpy(), output="real")
    blocks, k = [], 0
    while k < len(schur):
        size = 2 if k + 1 < len(schur) and schur[k + 1, k] != 0 else 1
        blocks.append(list(range(k, k + size)))
        k += size
    return schur, basis, blocks


def correction_planes(q_w: torch.Tensor, q_l: torch.Tensor) -> tuple[torch.Tensor, list[list[int]], list[float]]:
    """The invariant planes of the learned correction R = Q_wᵀ Q_l (:func:`real_schur`): the basis Z (float64,
    B's side), each plane's columns of Z and its angle in degrees, the planes that turn most first."""
    schur, basis, planes = real_schur(q_w.T @ q_l.to(q_w))
    turns = [float(np.degrees(np.arctan2(abs(schur[k[1], k[0]]), schur[k[0], k[0]]))) if len(k) == 2
             else 180.0 * float(schur[k[0], k[0]] < 0) for k in planes]
    order = sorted(range(len(planes)), key=lambda i: -turns[i])
    return torch.from_numpy(basis), [planes[i] for i in order], [turns[i] for i in order]


def in_planes(q_w: torch.Tensor, q_l: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q_w with the learned correction applied only in its ``count`` planes that turn most (the identity in the
    others), and an orthonormal basis of those planes in A's coordinates (columns)."""
    basis, planes, _ = correction_planes(q_w, q_l)
    span = basis[:, [i for plane in planes[:count] for i in plane]]
    q_w, r = q_w.double().cpu(), (q_w.T @ q_l.to(q_w)).double().cpu()
    eye = torch.eye(span.shape[1], dtype=torch.float64)
    return q_w @ (torch.eye(len(r), dtype=torch.float64) + span @ (span.T @ r @ span - eye) @ span.T), q_w @ span


def stream_tokens(state: State, cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """The normalised stream that each block's attention reads, for every token of the inputs ``x`` and every
    block, in forward order (so two models' rows correspond): (blocks × tokens, d), float64."""
    rows: list[torch.Tensor] = []

    def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        rows.append(args[0].reshape(-1, cfg.width).double())

    hooks: dict[Site, Hook] = {("blocks.{l}.attn.qkv", layer): record for layer in range(cfg.depth)}
    hooked_passes(cfg, to_model(state, cfg), hooks, [x])
    return torch.cat(rows)


def stream_moment(state: State, cfg: ModelConfig, data: Dataset) -> torch.Tensor:
    """E[x xᵀ] of :func:`stream_tokens` over the first :data:`STREAM_SAMPLES` inputs of ``data``: the directions in
    which a model's stream varies."""
    x = stream_tokens(state, cfg, inputs_of(data, STREAM_SAMPLES))
    return x.T @ x / len(x)


def variance_share(moment: torch.Tensor, span: torch.Tensor) -> float:
    """The stream variance in the columns of ``span`` per dimension, over its mean per dimension (1: average)."""
    return float(torch.trace(span.T @ moment @ span) / span.shape[1] / (torch.trace(moment) / len(moment)))


def changed_units(weight: Transform, learned: Transform) -> tuple[int, int]:
    """How many heads and MLP units the learned matching assigns elsewhere than weight matching did, and of how
    many."""
    pairs = [*zip(weight.heads, learned.heads, strict=True), *zip(weight.mlp, learned.mlp, strict=True)]
    moved = [(p != q).sum().item() for p, q in pairs if p is not None and q is not None]
    total = [p.numel() for p, _ in pairs if p is not None]
    return int(sum(moved)), int(sum(total))


def plane_rows(a: State, b: State, cfg: ModelConfig, test: Dataset, weight: Transform, q_l: torch.Tensor,
               ) -> dict[str, dict[str, float]]:
    """For each of :data:`PLANE_SHARES`: weight matching with the learned correction in only that many of its
    planes (those that turn most), the barrier, and how much of A's stream variance the planes carry."""
    assert weight.residual is not None
    arch, moment = get_arch(cfg.family), stream_moment(a, cfg, test)
    rows = {}
    for row, share in PLANE_SHARES.items():
        count = max(1, int(share * (cfg.width // 2)))
        q, span = in_planes(weight.residual, q_l, count)
        moved = apply(b, arch.spec, dataclasses.replace(weight, residual=q.to(weight.residual)), cfg.heads)
        rows[row] = {"planes": count, "barrier": barrier(a, moved, cfg, test),
                     "variance": variance_share(moment, span)}
    return rows


def pair_gap(names: tuple[str, str], natives: tuple[State, State], cfg: ModelConfig, test: Dataset,
             train: Dataset, options: MatchOptions, maps: Path) -> dict[str, Any]:
    """One pair's barrier under each of :data:`CURVES` and with the correction in its top planes
    (:func:`plane_rows`), the eigen-angles of Q and of the learned correction Q_wᵀ Q_l, and the units whose
    assignment learning changed; Q_w and Q_l saved in ``maps``. ``options``: both matchings' (the table's
    ``matcher`` weight flags and the learning flags)."""
    arch = get_arch(cfg.family)
    a, b = (canonicalize(arch, s, cfg, dtype=torch.float64) for s in natives)  # as align_pair matches them
    weight = align_pair(*natives, cfg, "weight", options).result
    learned = align_pair(*natives, cfg, "learned", options, data=train).result
    barriers = {name: barrier(a, apply(b, arch.spec, t, cfg.heads), cfg, test)
                for name, t in crossed(weight.transform, learned.transform).items()}
    plain = align_pair(*natives, cfg, "none")
    barriers["vanilla"] = barrier(plain.a, plain.b, cfg, test)
    q_w, q_l = weight.transform.residual, learned.transform.residual
    assert q_w is not None and q_l is not None
    maps.parent.mkdir(parents=True, exist_ok=True)
    save_file({"q_weight": q_w.contiguous().cpu(), "q_learned": q_l.contiguous().cpu()}, str(maps))
    moved, units = changed_units(weight.transform, learned.transform)
    correction, turn = angles(q_w.T @ q_l.to(q_w)), angles(q_w)
    return {"pair": list(names), "barriers": {c: barriers[c] for c in CURVES}, "moved_units": moved, "units": units,
            "planes": plane_rows(a, b, cfg, test, weight.transform, q_l),
            "q_angle_median": turn.median().item(), "correction_angle_median": correction.median().item(),
            "correction_angle_max": correction.max().item(), "learn_seconds": learned.seconds,
            "correction_norm": (q_l.to(q_w) - q_w).norm().item() / q_w.norm().item()}


def measure_model(run: dict[str, Any], gap: dict[str, Any], model: dict[str, Any], command: str) -> dict[str, Any]:
    """The first ``pairs`` seed pairs of one model, with the settings and wall time."""
    began, limit = time.perf_counter(), model.get("run", {}).get("limit", run["limit"])
    flags = [*model.get("learn", []), *gap.get("args", [])]
    options, batch = learn_flags([*flags, *gap.get("matcher", [])])
    paths = seed_checkpoints(run, model)
    pairs = [(paths[0], p) for p in paths[1:]][:gap["pairs"]]
    loaded = {p: load_checkpoint(p) for p in {q for pair in pairs for q in pair}}
    meta = loaded[paths[0]][1]
    test, train = held_out(model["dataset"], meta.config, limit=limit), train_subset(meta, None, batch)
    maps = Path(run["out"]) / "gap" / label(model)
    reports = [pair_gap((a.stem, b.stem), (loaded[a][0], loaded[b][0]), meta.config, test, train, options,
                        maps / f"{a.stem}-{b.stem}.safetensors") for a, b in pairs]
    return {"reports": reports, "flags": flags, "limit": limit, "command": command, "machine": machine(),
            "seconds": time.perf_counter() - began}


def markdown(name: str, entry: dict[str, Any]) -> list[str]:
    """One model's barriers per pair and curve, their mean share of vanilla, and the angles of Q."""
    reports = entry["reports"]
    lines = [f"## {name}", "", "| curve | barrier ÷ vanilla | " + " | ".join(" / ".join(r["pair"]) for r in reports)
             + " |", "|---|---|" + "---|" * len(reports)]
    for curve in CURVES:
        ratio, se = mean_se([r["barriers"][curve] / r["barriers"]["vanilla"] for r in reports])
        lines.append(f"| {curve} | {100 * ratio:.1f}% ± {100 * se:.1f} | "
                     + " | ".join(f"{r['barriers'][curve]:.3f}" for r in reports) + " |")
    lines += ["", "Per pair: how far Q_w turns (median eigen-angle), how far learning corrects it (eigen-angles of "
              "Q_wᵀ Q_l, median and largest; ‖Q_l − Q_w‖ ÷ ‖Q_w‖), the heads and MLP units learning assigned "
              "elsewhere, and the share of the learned gain (weight − learned) that the learned Q alone brings.", ""]
    for r in reports:
        b = r["barriers"]
        share = (b["weight"] - b["weight, learned Q"]) / (b["weight"] - b["learned"])
        lines.append(f"- {' / '.join(r['pair'])}: Q_w {r['q_angle_median']:.0f}°; correction "
                     f"{r['correction_angle_median']:.1f}° (largest {r['correction_angle_max']:.1f}°, norm "
                     f"{r['correction_norm']:.3f}); units moved {r['moved_units']} of {r['units']}; learned Q alone "
                     f"{100 * share:.0f}% of the gain; learning {r['learn_seconds'] / 60:.1f} min")
    flags = " ".join(entry["flags"]) or "none (glmc's defaults)"
    return [*lines, *plane_lines(reports), "", f"Learning flags: {flags}. Barriers on the first {entry['limit']} "
            "test samples, 21 λ values. "
            f"Command: `{entry['command']}`. Machine: {entry['machine']}; wall time {entry['seconds'] / 60:.1f} min.",
            ""]


def plane_lines(reports: list[dict[str, Any]]) -> list[str]:
    """Weight matching with the learned correction in its top planes only, and the stream variance they carry."""
    if not all("planes" in r for r in reports):
        return []
    lines = ["", "Weight matching with the learned correction in only the planes it turns most (the identity in the "
             "others): barrier ÷ vanilla, and the variance of A's stream (what its attention blocks read, over "
             f"every token of {STREAM_SAMPLES} test inputs) per dimension of those planes, ÷ the mean per dimension.",
             "", "| correction in | planes | barrier ÷ vanilla | " + " | ".join(" / ".join(r["pair"]) for r in reports)
             + " | stream variance |", "|---|---|---|" + "---|" * len(reports) + "---|"]
    for row in PLANE_SHARES:
        ratio, se = mean_se([r["planes"][row]["barrier"] / r["barriers"]["vanilla"] for r in reports])
        variance, _ = mean_se([r["planes"][row]["variance"] for r in reports])
        lines.append(f"| {row} | {reports[0]['planes'][row]['planes']} | {100 * ratio:.1f}% ± {100 * se:.1f} | "
                     + " | ".join(f"{r['planes'][row]['barrier']:.3f}" for r in reports) + f" | {variance:.2f}× |")
    return lines


HEADING = ["# Where learned matching's gain lies: the residual map or the unit maps", "",
           "Weight matching (glmc's defaults) and learned matching from it, then crossed: weight matching's unit "
           "maps (heads, MLP units, within-head maps) with the learned residual map Q, and the learned unit maps "
           "with weight matching's Q. Barrier ÷ the pair's vanilla barrier.", ""]


def main(argv: list[str] | None = None) -> int:
    return table_main(argv, "gap", "simulations.analyses.learned_gap", __doc__.splitlines()[0], measure_model,
                      None, HEADING, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
