"""Weight and activation matching against model size: time, peak memory and fitted growth exponents, on
random-init pairs where B is a planted symmetry transform of A, so that every row also checks the answer.

    nice -n 10 .venv/bin/python -m simulations.bench.scaling [--config simulations/bench/configs/scaling.toml]
        [--models NAME ...]

Each (model, method) runs in a fresh process: A is the model's own (seeded) initialisation in float32, canonical,
and B = T(A) for a T drawn by ``glmc.symmetry.transforms.random_transform`` (a model with ``plant = "hand"``: T
planted on the native names by :mod:`simulations.bench.planting`, apart from glmc). Once the pair is built, the
process's peak resident memory is reset (Linux ``/proc/self/clear_refs``, after glibc's ``malloc_trim`` hands back
what building the pair freed), so ``peak RSS`` is the whole process's peak during the matching (both states
included) and ``added`` that peak minus the resident size just before it. ``recovered`` asks for
‖A − T̂(B)‖² ≤ 1e-10 ‖A‖² (float64) and T̂ ∘ T = identity: permutations equal, continuous maps within 1e-3. With
``--models`` only those models run; the others' rows are kept from the results file.

A model with ``through = "cli"`` is measured as a user runs it instead: A (its seeded initialisation) and B (A moved
by the orthogonal classes planted on the HF names by :mod:`simulations.bench.planting`) are saved by transformers in
the ``stored`` dtype, and ``glmc align A B --method weight --threads N --out C`` (plus the row's ``flags``) runs in a
fresh process: wall time, the process's CPU time and peak RSS (its own VmHWM: reading, the read check, matching and
writing), the inputs' size on disk, and the load average before and after. Recovered: C within ``tolerance`` of A
(relative Frobenius distance over the native tensors, float64 one tensor at a time), B itself far from it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import gc
import json
import math
import multiprocessing
import os
import resource
import subprocess
import sys
import time
import typing
from pathlib import Path
from typing import Any

import numpy as np
import torch

from glmc.archs import build_model, get_arch, random_inputs
from glmc.core.config import ModelConfig
from glmc.core.state import Lazy, State
from glmc.io.formats import read
from glmc.match.activation import activation_match
from glmc.match.common import MatchResult
from glmc.match.options import Start, WeightOptions
from glmc.match.weight import weight_match
from glmc.symmetry.canonical import canonicalize, fixes_ones
from glmc.symmetry.transforms import Transform, apply, compose, random_transform
from harness.tomlfile import config_or_exit
from simulations.bench import precision
from simulations.bench.barriers import machine
from simulations.bench.planting import PLANTERS

MAP_TOLERANCE = 1e-3  # T̂ ∘ T's continuous maps from the identity (max abs entry): float32 search, exact group
DISTANCE_TOLERANCE = 1e-10  # ‖A − T̂(B)‖² / ‖A‖²


def planted_pair(cfg: ModelConfig, classes: tuple[str, ...], seed: int) -> tuple[State, State, Transform]:
    """A (the seeded initialisation, canonical float32), B = T(A) and T."""
    arch = get_arch(cfg.family)
    torch.manual_seed(seed)
    a = canonicalize(arch, build_model(cfg).state_dict(), cfg, dtype=torch.float32)
    t = random_transform(cfg, classes, torch.Generator().manual_seed(seed))
    return a, apply(a, arch.spec, t, cfg.heads), t


def hand_planted_pair(cfg: ModelConfig, seed: int) -> tuple[State, State]:
    """A and B = T(A) for a T planted on the native names by :mod:`simulations.bench.planting`, not by glmc; one
    native copy at a time, so a billion-parameter pair peaks near three float32 models while it is built."""
    arch = get_arch(cfg.family)
    torch.manual_seed(seed)
    model = build_model(cfg)
    hf, native = model.config, dict(model.state_dict())
    del model
    a = canonicalize(arch, native, cfg, dtype=torch.float32)
    native = PLANTERS[cfg.family](native, hf, seed)
    return a, canonicalize(arch, native, cfg, dtype=torch.float32)


def transform_error(found: Transform, planted: Transform) -> dict[str, float]:
    """How far found ∘ planted is from the identity: permutation entries out of place, largest map deviation."""
    both = compose(found, planted)
    misplaced = sum(int((p.cpu() != torch.arange(len(p))).sum()) for p in both.heads + both.mlp if p is not None)
    maps = [m for m in [both.residual, *both.qk, *both.ov] if m is not None]
    deviation = max((float((m.cpu().double() - torch.eye(m.shape[-1], dtype=torch.float64)).abs().max())
                     for m in maps), default=0.0)
    return {"misplaced": misplaced, "map_deviation": deviation}


def relative_distance(a: State, b: State) -> float:
    """‖A − B‖² / ‖A‖², summed in float64 one tensor at a time (a billion-parameter state is not copied)."""
    def square(x: torch.Tensor) -> float:
        return float(x.double().square().sum())
    return sum(square(a[k].double() - b[k]) for k in a) / sum(square(v) for v in a.values())


def _rss_mb(field: str) -> float:
    """A field of /proc/self/status (VmRSS, VmHWM) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _match(method: str, a: State, b: State, cfg: ModelConfig, run: dict[str, Any]) -> MatchResult:
    """``weight`` starts where the config's ``weight_start`` says; ``weight-<start>`` from that start."""
    if method.startswith("weight"):
        start = method.removeprefix("weight").removeprefix("-") or run["weight_start"]
        arch = get_arch(cfg.family)
        options = WeightOptions(start=typing.cast(Start, start))
        return weight_match(a, b, arch.spec, cfg.depth, cfg.heads, options=options,
                            fix_ones=fixes_ones("standard", arch), rotary=cfg.rotary_dim)
    samples = run["activation_samples"][cfg.family]
    return activation_match(a, b, cfg, random_inputs(cfg, samples, seed=1), batch_size=max(1, samples // 2))


def measure(model: dict[str, Any], method: str, run: dict[str, Any]) -> dict[str, Any]:
    """One (model, method) row: build the planted pair, reset the peak RSS, match, check the answer."""
    torch.set_num_threads(run["threads"])
    cfg = ModelConfig.from_dict(model["config"])
    if model.get("plant") == "hand":
        (a, b), planted = hand_planted_pair(cfg, run["seed"]), None
    else:
        a, b, planted = planted_pair(cfg, tuple(run[f"{method.split('-')[0]}_classes"]), run["seed"])
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # building the pair's freed heap back to the OS: a checkpoint load leaves none
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before, load = _rss_mb("VmRSS"), os.getloadavg()[0]
    wall, cpu = time.perf_counter(), time.process_time()
    result = _match(method, a, b, cfg, run)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = _rss_mb("VmHWM")
    distance = relative_distance(a, apply(b, get_arch(cfg.family).spec, result.transform, cfg.heads))
    # a hand-planted T is not a glmc Transform: the distance alone says whether it was undone
    error: dict[str, Any] = {"misplaced": None, "map_deviation": None}
    if planted is not None:
        error = transform_error(result.transform, planted)
    inverse = planted is None or (error["misplaced"] == 0 and error["map_deviation"] <= MAP_TOLERANCE)
    return {"model": model["name"], "method": method, "family": cfg.family, "width": cfg.width, "depth": cfg.depth,
            "params": sum(v.numel() for v in a.values()), "wall_seconds": wall, "cpu_seconds": cpu,
            "peak_rss_mb": peak, "added_rss_mb": peak - before, "sweeps": len(result.objective),
            "relative_distance": distance, **error, "load_at_start": load, "threads": run["threads"],
            "recovered": distance <= DISTANCE_TOLERANCE and inverse}


def write_pair(cfg: ModelConfig, dtype: torch.dtype, seed: int, folder: Path) -> None:
    """A (seeded init in ``dtype``) and B = planted(A) as save_pretrained folders ``folder``/a, /b, as
    :func:`simulations.bench.precision.write_pair` writes them (planted in float32, rounded once) but holding one
    float32 copy of the model at most besides the stored one: a billion-parameter pair is built in about 7 GB."""
    if (folder / "b" / "config.json").is_file():
        return
    torch.manual_seed(seed)
    model: Any = build_model(cfg).to(dtype)  # a transformers model: save_pretrained, config
    model.save_pretrained(str(folder / "a"))
    stored = model.state_dict()
    moved = PLANTERS[cfg.family](Lazy(stored, lambda name: stored[name].float()), model.config, seed)
    with torch.no_grad():
        for name in list(moved):
            stored[name].copy_(moved.pop(name))  # rounded to the stored dtype, one tensor at a time
    model.save_pretrained(str(folder / "b"))


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def through_cli(model: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """One ``through = "cli"`` row: the pair written once (in a spawned process), ``glmc align`` timed in a fresh
    one, C checked against A."""
    cfg = ModelConfig.from_dict(model["config"])
    folder = Path(run["work"]) / model["name"]
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(write_pair, cfg, getattr(torch, model["stored"]), run["seed"], folder).result()
    args = ["align", str(folder / "a"), str(folder / "b"), "--method", "weight", "--threads", str(run["threads"]),
            "--out", str(folder / "c"), "--force", "--dtype", model["stored"], *model.get("flags", [])]
    load, began, cpu = os.getloadavg(), time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-c", precision.CHILD, *args], capture_output=True, text=True, check=False)
    wall, after = time.perf_counter() - began, resource.getrusage(resource.RUSAGE_CHILDREN)
    said = done.stderr.strip().splitlines() or [""]
    peak = int(said.pop().split()[1]) / 1024 if said[-1].startswith("VmHWM") else None
    row: dict[str, Any] = {
        "model": model["name"], "method": "weight", "family": cfg.family, "width": cfg.width, "depth": cfg.depth,
        "through": "cli", "stored": model["stored"], "command": "glmc " + " ".join(args), "exit": done.returncode,
        "inputs_gb": (_bytes(folder / "a") + _bytes(folder / "b")) / 1e9, "wall_seconds": wall,
        "cpu_seconds": (after.ru_utime + after.ru_stime) - (cpu.ru_utime + cpu.ru_stime), "peak_rss_mb": peak,
        "load_at_start": load[0], "load_at_end": os.getloadavg()[0], "threads": run["threads"],
        "target": model.get("target", ""), "recovered": False}
    if done.returncode:
        return row | {"refusal": said[-1] if said else ""}
    report = json.loads(done.stdout.strip().splitlines()[-1])
    target, _ = read(folder / "a", stored=True)
    error, apart = (precision.distance(read(folder / x, stored=True)[0], target) for x in ("c", "b"))
    return row | {"params": sum(v.numel() for v in target.values()), "matching_seconds": report["seconds"],
                  "sweeps": len(report["objective"]), "relative_error": error, "b_error": apart,
                  "recovered": error <= model["tolerance"] < apart}


def fit(rows: list[dict[str, Any]], x: str, y: str) -> float | None:
    """The least-squares slope of log y against log x (the growth exponent), None for fewer than two rows."""
    if len(rows) < 2:
        return None
    return float(np.polyfit([math.log(r[x]) for r in rows], [math.log(r[y]) for r in rows], 1)[0])


def growth(rows: list[dict[str, Any]], models: list[dict[str, Any]], threads: int = 1) -> list[dict[str, Any]]:
    """Exponents per (family, method) over the models in the growth series measured on ``threads`` threads,
    against parameters and width."""
    series = {m["name"] for m in models if m.get("growth", True)}
    rows = [r for r in rows if r.get("threads", 1) == threads and r["model"] in series]
    out = []
    for family, method in sorted({(r["family"], r["method"]) for r in rows}):
        chosen = [r for r in rows if (r["family"], r["method"]) == (family, method)]
        out.append({"family": family, "method": method, "models": len(chosen),
                    **{f"{y}_vs_{x}": fit(chosen, x, y) for x in ("params", "width")
                       for y in ("wall_seconds", "cpu_seconds", "added_rss_mb")}})
    return out


def _exponent(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def markdown(rows: list[dict[str, Any]], fits: list[dict[str, Any]], runs: list[dict[str, Any]]) -> str:
    """The committed summary: the runs, one row per (model, method), then the growth exponents."""
    kept = {row["run"] for row in rows}
    lines = ["# Matching cost against model size", "", "Runs (a row's `run` column; a shared CPU, so CPU time is the "
             "steadier figure and the load average is noted):", "",
             *(f"{i}. `{r['command']}`, config `{r['config']}`; machine: {r['machine']}; wall time "
               f"{r.get('wall_minutes', 0):.1f} min; load average {r['load_before']} before, "
               f"{r.get('load_after', '–')} after." + ("" if i in kept else " No row of it is kept: a later run "
                                                        "measured them again.") for i, r in enumerate(runs)), "",
             "Pairs: random init (seeded), B a planted transform of A. Peak RSS: the matching process's peak "
             "resident memory during the matching (both float32 states included); added: that peak minus the "
             "resident size just before. Recovered: ‖A − T̂(B)‖² ≤ 1e-10 ‖A‖² and T̂ ∘ T = identity.", "",
             "| model | d | layers | params (M) | method | threads | wall s | CPU s | peak RSS MB | added MB | sweeps "
             "| ‖A − T̂(B)‖²/‖A‖² | recovered | load | run |", "|" + "---|" * 15]
    for r in (r for r in rows if r.get("through") != "cli"):
        lines.append(f"| {r['model']} | {r['width']} | {r['depth']} | {r['params'] / 1e6:.1f} | {r['method']} | "
                     f"{r.get('threads', 1)} | "
                     f"{r['wall_seconds']:.1f} | {r['cpu_seconds']:.1f} | {r['peak_rss_mb']:.0f} | "
                     f"{r['added_rss_mb']:.0f} | {r['sweeps']} | {r['relative_distance']:.1e} | "
                     f"{'yes' if r['recovered'] else 'NO'} | {r['load_at_start']:.1f} | {r.get('run', 0)} |")
    lines += _cli_table([r for r in rows if r.get("through") == "cli"])
    lines += ["", "Growth exponents (least-squares slope of log cost against log size, over the 12-layer series on "
              "the config's threads):",
              "", "| family | method | models | wall vs params | CPU vs params | CPU vs d | added memory vs params |",
              "|---|---|---|---|---|---|---|"]
    for f in fits:
        lines.append(f"| {f['family']} | {f['method']} | {f['models']} | {_exponent(f['wall_seconds_vs_params'])} | "
                     f"{_exponent(f['cpu_seconds_vs_params'])} | {_exponent(f['cpu_seconds_vs_width'])} | "
                     f"{_exponent(f['added_rss_mb_vs_params'])} |")
    return "\n".join(lines) + "\n"


def _cli_table(rows: list[dict[str, Any]]) -> list[str]:
    """The rows measured through ``glmc align``, one line each."""
    if not rows:
        return []
    lines = ["", "Through `glmc align A B --method weight` (a fresh process, from the saved pair; peak RSS: the "
             "process's own VmHWM, reading, the read check, matching and writing included; load: the 1-minute load "
             "average at the start and the end of the run). Recovered: C within the row's tolerance of A (relative "
             "Frobenius distance over the native tensors), B itself far from it.", "",
             "| model | params (M) | stored | inputs GB | flags | threads | wall s | matching s | CPU s | "
             "peak RSS GB | target | ‖C − A‖/‖A‖ | ‖B − A‖/‖A‖ | recovered | load | run |", "|" + "---|" * 16]
    for r in rows:
        flags = " ".join(r["command"].split("--force --dtype")[1].split()[1:]) or "–"
        peak = "killed" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb'] / 1024:.2f}"
        done = r["exit"] == 0
        params, matching = (f"{r['params'] / 1e6:.0f}", f"{r['matching_seconds']:.0f}") if done else ("–", "–")
        error, apart = (f"{r['relative_error']:.1e}", f"{r['b_error']:.2f}") if done else ("–", "–")
        lines.append(f"| {r['model']} | {params} | {r['stored']} | {r['inputs_gb']:.2f} | {flags} | {r['threads']} | "
                     f"{r['wall_seconds']:.0f} | {matching} | {r['cpu_seconds']:.0f} | {peak} | {r['target']} | "
                     f"{error} | {apart} | {'yes' if r['recovered'] else 'NO'} | {r['load_at_start']:.1f} → "
                     f"{r['load_at_end']:.1f} | {r.get('run', 0)} |")
    return lines


def selected(config: dict[str, Any], names: list[str] | None, methods: list[str] | None = None,
             ) -> list[tuple[dict[str, Any], str]]:
    """Every (model, method) to run, in the config's order (``methods``: only those of the model's methods)."""
    return [(model, method) for model in config["models"] if not names or model["name"] in names
            for method in model.get("methods", config["run"]["methods"]) if not methods or method in methods]


def measured(model: dict[str, Any], method: str, run: dict[str, Any]) -> dict[str, Any]:
    """:func:`measure` in a fresh spawned process (its own peak RSS, no memory left from the row before); a
    ``through = "cli"`` model by :func:`through_cli`."""
    if model.get("through") == "cli":
        return through_cli(model, run)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure, model, method, run).result()


def save(out: Path, config: dict[str, Any], runs: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    """Write results.json and summary.md: the rows in the config's order, each run that made them, the fits."""
    order = {m["name"]: i for i, m in enumerate(config["models"])}
    rows = sorted((r for r in rows if r["model"] in order),
                  key=lambda r: (order[r["model"]], r["method"] != "weight", r["method"], r.get("threads", 1)))
    fits = growth(rows, config["models"], config["run"]["threads"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"runs": runs, "rows": rows, "growth": fits}, indent=1) + "\n")
    (out / "summary.md").write_text(markdown(rows, fits, runs))


def _load() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="simulations/bench/configs/scaling.toml")
    parser.add_argument("--models", nargs="*", help="run only these models; the others' rows are kept")
    parser.add_argument("--methods", nargs="*", help="run only these methods (weight, weight-relaxed, activation)")
    parser.add_argument("--threads", type=int, help="torch threads instead of the config's (rows kept per count; "
                        "growth is fitted on the config's)")
    args = parser.parse_args(argv)
    config = config_or_exit(parser, args.config)
    threads = args.threads or config["run"]["threads"]
    known = [m["name"] for m in config["models"]]
    unknown = sorted(set(args.models or []) - set(known))
    if unknown:
        parser.exit(2, f"{parser.prog}: error: no model named {unknown[0]!r} in {args.config}; known: "
                       f"{', '.join(known)}\n")
    out, start = Path(config["run"]["results"]), time.perf_counter()
    partial = args.models or args.methods or args.threads
    kept = json.loads((out / "results.json").read_text()) if partial and (out / "results.json").is_file() else {}
    todo = selected(config, args.models, args.methods)
    done = {(m["name"], k, threads) for m, k in todo}
    rows = [r for r in kept.get("rows", []) if (r["model"], r["method"], r.get("threads", 1)) not in done]
    torch.set_num_threads(threads)
    run = {"command": " ".join(["python -m simulations.bench.scaling", *(sys.argv[1:] if argv is None else argv)]),
           "config": args.config, "machine": machine(), "load_before": _load()}
    runs = [*kept.get("runs", []), run]
    for model, method in todo:  # saved after every row: a long run that is cut off keeps what it measured
        rows.append(measured(model, method, config["run"] | {"threads": threads}) | {"run": len(runs) - 1})
        print(f"{model['name']} {method}: {rows[-1]['wall_seconds']:.1f} s wall, {rows[-1]['cpu_seconds']:.1f} s "
              f"CPU, peak {rows[-1]['peak_rss_mb']} MB, recovered {rows[-1]['recovered']}", flush=True)
        run |= {"wall_minutes": (time.perf_counter() - start) / 60, "load_after": _load()}
        save(out, config, runs, rows)
    print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
