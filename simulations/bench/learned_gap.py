"""Where learned matching's gain over weight matching lies. The paper (its Section 6) finds that learned matching
keeps weight matching's permutations and only corrects the residual map Q, so that a better data-free Q would close
most of the gap. Here each pair is weight-matched and learned, then the two are crossed: weight matching with the
learned Q, and learned matching with weight matching's Q. Uses the barrier benchmark's checkpoints (no training).

    .venv/bin/python -m simulations.bench.learned_gap [--config simulations/bench/configs/barriers.toml]
        [--models NAME ...]

Both matchings run with glmc's defaults (the learned one after the model's ``learn`` flags, then the table's
``args``), so the learned one starts from the same weight matching as the other.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import torch
from torch.utils.data import Dataset

from glmc.align import align_pair
from glmc.archs import ModelConfig, State, get_arch
from glmc.canonical import canonicalize
from glmc.checkpoint import load_checkpoint
from glmc.cli_learn import add_learn_arguments, learn_options, train_subset
from glmc.match.learned import LearnConfig
from glmc.tasks import held_out
from glmc.transforms import Transform, apply
from simulations.bench.barriers import machine, mean_se, seed_checkpoints, table_main
from simulations.bench.weight_starts import barrier

CURVES = ("vanilla", "weight", "weight, learned Q", "learned, weight Q", "learned")


def learn_flags(flags: list[str]) -> tuple[LearnConfig, int | None]:
    """The learning options and training-sample count that ``glmc barrier`` would take from ``flags``."""
    parser = argparse.ArgumentParser(prog="learning flags")
    add_learn_arguments(parser, "training samples")
    args = parser.parse_args([*flags, "--quiet"])
    return learn_options(args), args.batch


def crossed(weight: Transform, learned: Transform) -> dict[str, Transform]:
    """The two matchings and their crossings: each one's unit maps with the other's residual map Q."""
    return {"weight": weight, "weight, learned Q": dataclasses.replace(weight, residual=learned.residual),
            "learned, weight Q": dataclasses.replace(learned, residual=weight.residual), "learned": learned}


def angles(q: torch.Tensor) -> torch.Tensor:
    """The eigen-angles of an orthogonal map, in degrees in [0, 180]: how far it turns each of its planes."""
    return torch.linalg.eigvals(q.double()).angle().abs().rad2deg()


def changed_units(weight: Transform, learned: Transform) -> tuple[int, int]:
    """How many heads and MLP units the learned matching assigns elsewhere than weight matching did, and of how
    many."""
    pairs = [*zip(weight.heads, learned.heads, strict=True), *zip(weight.mlp, learned.mlp, strict=True)]
    moved = [(p != q).sum().item() for p, q in pairs if p is not None and q is not None]
    total = [p.numel() for p, _ in pairs if p is not None]
    return int(sum(moved)), int(sum(total))


def pair_gap(names: tuple[str, str], natives: tuple[State, State], cfg: ModelConfig, test: Dataset,
             train: Dataset, options: LearnConfig) -> dict[str, Any]:
    """One pair's barrier under each of :data:`CURVES`, the eigen-angles of Q and of the learned correction
    Q_wᵀ Q_l, and the units whose assignment learning changed."""
    arch = get_arch(cfg.family)
    a, b = (canonicalize(arch, s, cfg.depth, dtype=torch.float64) for s in natives)  # as align_pair matches them
    weight = align_pair(*natives, cfg, "weight").result
    learned = align_pair(*natives, cfg, "learned", data=train, learn=options).result
    barriers = {name: barrier(a, apply(b, arch.spec, t, cfg.heads), cfg, test)
                for name, t in crossed(weight.transform, learned.transform).items()}
    plain = align_pair(*natives, cfg, "none")
    barriers["vanilla"] = barrier(plain.a, plain.b, cfg, test)
    q_w, q_l = weight.transform.residual, learned.transform.residual
    assert q_w is not None and q_l is not None
    moved, units = changed_units(weight.transform, learned.transform)
    correction, turn = angles(q_w.T @ q_l.to(q_w)), angles(q_w)
    return {"pair": list(names), "barriers": {c: barriers[c] for c in CURVES}, "moved_units": moved, "units": units,
            "q_angle_median": turn.median().item(), "correction_angle_median": correction.median().item(),
            "correction_angle_max": correction.max().item(), "learn_seconds": learned.seconds,
            "correction_norm": (q_l.to(q_w) - q_w).norm().item() / q_w.norm().item()}


def measure_model(run: dict[str, Any], gap: dict[str, Any], model: dict[str, Any], command: str) -> dict[str, Any]:
    """The first ``pairs`` seed pairs of one model, with the settings and wall time."""
    began, limit = time.perf_counter(), model.get("run", {}).get("limit", run["limit"])
    flags = [*model.get("learn", []), *gap.get("args", [])]
    options, batch = learn_flags(flags)
    paths = seed_checkpoints(run, model)
    pairs = [(paths[0], p) for p in paths[1:]][:gap["pairs"]]
    loaded = {p: load_checkpoint(p) for p in {q for pair in pairs for q in pair}}
    meta = loaded[paths[0]][1]
    test, train = held_out(model["dataset"], meta.config, limit=limit), train_subset(meta, None, batch)
    reports = [pair_gap((a.stem, b.stem), (loaded[a][0], loaded[b][0]), meta.config, test, train, options)
               for a, b in pairs]
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
    return [*lines, "", f"Learning flags: {flags}. Barriers on the first {entry['limit']} test samples, 21 λ values. "
            f"Command: `{entry['command']}`. Machine: {entry['machine']}; wall time {entry['seconds'] / 60:.1f} min.",
            ""]


HEADING = ["# Where learned matching's gain lies: the residual map or the unit maps", "",
           "Weight matching (glmc's defaults) and learned matching from it, then crossed: weight matching's unit "
           "maps (heads, MLP units, within-head maps) with the learned residual map Q, and the learned unit maps "
           "with weight matching's Q. Barrier ÷ the pair's vanilla barrier.", ""]


def main(argv: list[str] | None = None) -> int:
    return table_main(argv, "gap", "simulations.bench.learned_gap", __doc__.splitlines()[0], measure_model,
                      None, HEADING, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
