"""Barrier benchmark of the symmetry core: trains the configured seeds (once), measures every pair's loss
barrier for every method through ``glmc barrier``, times weight matching, and writes a summary. A config with a
``[pair]`` table names two given checkpoints instead, and its ``[[rows]]`` are measured on them
(:mod:`simulations.bench.pair_rows`; the official GLMC pair: ``configs/official-pair.toml``).

    .venv/bin/python -m simulations.bench.barriers [--config simulations/bench/configs/barriers.toml]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from glmc.cli import main as glmc
from harness.tomlfile import config_or_exit

if TYPE_CHECKING:
    from glmc.match.options import Start


def label(model: dict[str, Any]) -> str:
    """A model entry's name: its ``name`` (e.g. a preset trained longer), else its preset."""
    return model.get("name", model["preset"])


def checkpoint(out: Path, name: str, seed: int) -> Path:
    return out / name / f"seed{seed}.safetensors"


def seed_checkpoints(run: dict[str, Any], model: dict[str, Any]) -> list[Path]:
    """The model's seed checkpoints, for the benches that measure this bench's seeds without training them."""
    paths = [checkpoint(Path(run["out"]), label(model), s) for s in model["seeds"]]
    if missing := [str(p) for p in paths if not p.is_file()]:
        raise SystemExit(f"missing checkpoints (run simulations.bench.barriers first): {', '.join(missing)}")
    return paths


def machine() -> str:
    """This machine and software, for a summary: with its GPU where there is one (``glmc``'s default device)."""
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{platform.machine()}, {os.cpu_count()} cores{gpu}, python {platform.python_version()}, torch "
            f"{torch.__version__}, {torch.get_num_threads()} thread(s)")


def table_main(argv: list[str] | None, table: str, prog: str, description: str,
               measure: Callable[[dict[str, Any], dict[str, Any], dict[str, Any], str], dict[str, Any]],
               results: Path | None, heading: list[str], markdown: Callable[[str, dict[str, Any]], list[str]],
               after: Callable[[str, dict[str, Any]], None] | None = None,
               config: str = "simulations/bench/configs/barriers.toml") -> int:
    """The entry point of a bench over this bench's seeds, driven by its config's ``[table]``: for each of the
    table's models (or of ``--models``), in config order, ``entry = measure(run, table, model, command)``, then
    :func:`publish` of the entry in the table's own ``results`` folder, else ``results``, else the config's
    ``run.results``, and ``after(name, entry)`` (e.g. a plot)."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=description)
    parser.add_argument("--config", default=config)
    parser.add_argument("--models", nargs="+", help=f"measure only these of the config's [{table}] models")
    args = parser.parse_args(argv)
    loaded = config_or_exit(parser, args.config)
    run, options = loaded["run"], loaded[table]
    results = Path(options["results"]) if "results" in options else results or Path(run["results"])
    torch.set_num_threads(run["threads"])
    wanted = args.models or options["models"]
    if unknown := sorted(set(wanted) - set(options["models"])):
        raise SystemExit(f"not in [{table}] models of {args.config}: {', '.join(unknown)}")
    command = " ".join([f"python -m {prog}", *(argv if argv is not None else sys.argv[1:])])
    for model in (m for m in loaded["models"] if label(m) in wanted):
        entry = measure(run, options, model, command)
        publish(Path(run["out"]), results, heading, markdown, label(model), entry, options["models"])
        if after is not None:
            after(label(model), entry)
    return 0


def publish(out: Path, results: Path, heading: list[str], markdown: Callable[[str, dict[str, Any]], list[str]],
            name: str, entry: dict[str, Any], order: list[str]) -> None:
    """Add one model's entry to ``results``/results.json and rewrite summary.md from ``heading`` and every stored
    model's ``markdown``, in ``order``, under the lock (runs of other models may end at the same time); print the
    new model's part."""
    with results_lock(out):
        stored = previous_results(results) | {name: entry}
        results.mkdir(parents=True, exist_ok=True)
        (results / "results.json").write_text(json.dumps(stored, indent=1))
        ordered = sorted(stored, key=lambda n: order.index(n) if n in order else len(order))
        (results / "summary.md").write_text("\n".join([*heading, *(line for n in ordered
                                                                   for line in markdown(n, stored[n]))]))
    print("\n".join(markdown(name, entry)))


def train_args(model: dict[str, Any], seed: int) -> list[str]:
    """The ``glmc`` arguments that train one seed of a model entry (its ``train`` flags), before ``--out``."""
    return ["train", "--model", model["preset"], "--dataset", model["dataset"], "--seed", str(seed), *model["train"]]


def train_missing(run: dict[str, Any], model: dict[str, Any]) -> list[Path]:
    """Train every configured seed that has no checkpoint yet; return all checkpoint paths."""
    paths = []
    for seed in model["seeds"]:
        path = checkpoint(Path(run["out"]), label(model), seed)
        if not path.exists() and glmc([*train_args(model, seed), "--out", str(path), "--quiet"]) != 0:
            raise SystemExit(f"training {path} failed")
        paths.append(path)
    return paths


def report_path(run: dict[str, Any], model: dict[str, Any], a: Path, b: Path, tag: str) -> Path:
    """Where one pair's ``glmc barrier`` report with the run flags named by ``tag`` is cached."""
    return Path(run["out"]) / "barriers" / f"{label(model)}_{a.stem}_{b.stem}{tag}.json"


def pair_barriers(run: dict[str, Any], model: dict[str, Any], a: Path, b: Path, methods: list[str],
                  extra: list[str], tag: str) -> dict[str, Any]:
    """Run ``glmc barrier`` for one pair with ``methods`` and extra flags, unless a report with the same settings
    exists (so an interrupted benchmark resumes where it stopped). The run's ``matcher`` flags come first: the weight
    matcher a published table ran with."""
    extra = [*run.get("matcher", []), *extra]
    out = report_path(run, model, a, b, tag)
    settings = {"points": run["points"], "methods": methods, "extra": extra}
    if out.exists():
        cached = json.loads(out.read_text())
        if {k: cached.get(k) for k in settings} == settings:
            return cached
    args = ["barrier", str(a), str(b), "--points", str(run["points"]), "--limit", str(run["limit"]),
            "--json", str(out), "--quiet", *extra]
    for method in methods:
        args += ["--method", method]
    if glmc(args) != 0:
        raise SystemExit(f"glmc barrier failed for {a} {b}")
    report = json.loads(out.read_text()) | settings
    out.write_text(json.dumps(report, indent=2))
    return report


def learned_methods(learned: dict[str, Any], model: dict[str, Any]) -> list[str]:
    """The learned methods measured for ``model``: its own ``learn_methods``, else the ``[learned]`` table's."""
    return model.get("learn_methods", learned["methods"])


def pair_report(run: dict[str, Any], learned: dict[str, Any], model: dict[str, Any], a: Path, b: Path) -> dict:
    """Every method's curve for one pair: the data-free and activation methods in one run, then each of the
    model's learned methods in its own (cached) run with the model's learning flags."""
    report = pair_barriers(run, model, a, b, run["methods"], ["--batch", str(run["batch"])], "")
    extra = model.get("learn", learned["args"])
    for method in learned_methods(learned, model):
        report["curves"] += pair_barriers(run, model, a, b, [method], extra, f"_{method}")["curves"]
    return report


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (0 for a single value)."""
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return statistics.fmean(values), se


def time_weight_matching(preset_name: str, repeats: int, pair: tuple[Path, Path] | None = None,
                         start: Start = "identity") -> dict[str, float]:
    """Time of weight matching (float64, after canonical form) from residual ``start`` between two random-init
    models of a preset, or between the trained checkpoints ``pair``."""
    from glmc.archs import get_arch
    from glmc.core.config import preset
    from glmc.io.checkpoint import load_checkpoint
    from glmc.match.options import WeightOptions
    from glmc.match.weight import weight_match
    from glmc.symmetry.canonical import canonicalize
    from glmc.symmetry.exactness import random_native

    if pair is None:
        cfg = preset(preset_name)
        cfg = cfg.replace(vocab_size=83) if cfg.family == "gpt2" else cfg
        natives = [random_native(cfg, s) for s in (0, 1)]
    else:
        (first, meta), (second, _) = (load_checkpoint(path) for path in pair)
        cfg, natives = meta.config, [first, second]
    arch = get_arch(cfg.family)
    a, b = (canonicalize(arch, native, cfg) for native in natives)
    times, cpu, sweeps = [], [], []
    for _ in range(repeats):
        began = time.process_time()
        result = weight_match(a, b, arch.spec, cfg.depth, cfg.heads, options=WeightOptions(start=start))
        cpu.append(time.process_time() - began)
        times.append(result.seconds)
        sweeps.append(len(result.objective))
    return {"median_seconds": statistics.median(times), "median_cpu_seconds": statistics.median(cpu),
            "sweeps": statistics.median(sweeps)}


def summarise(model: dict[str, Any], reports: list[dict[str, Any]], methods: list[str]) -> list[dict[str, Any]]:
    """One row per method: barrier mean ± s.e. over pairs, ratio to vanilla, midpoint accuracy, align time."""
    rows = []
    for method in methods:
        measured = [r for r in reports if any(c["method"] == method for c in r["curves"])]
        curves = [next(c for c in r["curves"] if c["method"] == method) for r in measured]
        vanilla = [next(c for c in r["curves"] if c["method"] == "none")["barrier"] for r in measured]
        barrier, se = mean_se([c["barrier"] for c in curves])
        ratio, ratio_se = mean_se([c["barrier"] / v for c, v in zip(curves, vanilla, strict=True)])
        mid, _ = mean_se([c["accuracies"][len(c["lambdas"]) // 2] for c in curves])
        seconds = statistics.median(c["align_seconds"] for c in curves)
        rows.append({"model": label(model), "preset": model["preset"], "dataset": model["dataset"], "method": method,
                     "pairs": len(curves),
                     "barrier": barrier, "barrier_se": se, "ratio_to_vanilla": ratio, "ratio_se": ratio_se,
                     "midpoint_accuracy": mid, "align_seconds": seconds})
    return rows


def approximate_table(reports: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Markdown lines for the methods whose aligned B only approximates B (soft permutations, paper App. D):
    the validation midpoint gain, and how far the aligned endpoint is from B, mean ± s.e. over pairs."""
    cells: dict[tuple[str, str], list[dict[str, float]]] = {}
    for name, pairs in reports.items():
        for curve in (c for pair in pairs for c in pair["curves"]):
            if "endpoint_loss_change" in curve.get("align_info", {}):
                cells.setdefault((name, curve["method"]), []).append(curve["align_info"])
    lines = ["| model | method | pairs | midpoint gain | endpoint max abs Δlogit | endpoint loss change |",
             "|---|---|---|---|---|---|"]
    for (name, method), infos in cells.items():
        stats = [mean_se([i[k] for i in infos])
                 for k in ("midpoint_gain", "endpoint_max_logit_error", "endpoint_loss_change")]
        lines.append(f"| {name} | {method} | {len(infos)} | " + " | ".join(f"{m:.3f} ± {se:.3f}" for m, se in stats)
                     + " |")
    return lines if cells else []


def markdown(rows: list[dict[str, Any]], timing: dict[str, Any], meta: dict[str, Any],
             approximate: list[str]) -> str:
    """The committed summary: the barrier table, the approximate methods' endpoint errors, the timing table and
    how it was produced."""
    lines = ["# Pairwise loss barriers (symmetry core)", "",
             f"Command: `{meta['command']}`, config `{meta['config']}`.",
             f"Machine: {meta['machine']}; torch threads {meta['threads']}; wall time {meta['wall_minutes']:.1f} min "
             "(of this run: cached pair reports are reused, and each keeps its own align time)"
             + (f"; kept from the run before: {', '.join(meta['kept'])}." if meta.get("kept") else "."),
             f"Barrier = max over {meta['points']} λ of L(θ(λ)) − [λ L(θ_A) + (1−λ) L(θ_B)] on the first "
             f"{meta['limit']} held-out samples (fewer where a model overrides it); mean ± s.e. over the seed pairs "
             "counted in `pairs`.",
             "",
             "| model | data | method | pairs | barrier | ÷ vanilla | midpoint acc | align s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.get('model', r['preset'])} | {r['dataset']} | {r['method']} | {r['pairs']} | "
                     f"{r['barrier']:.3f} ± {r['barrier_se']:.3f} | {100 * r['ratio_to_vanilla']:.1f}% ± "
                     f"{100 * r['ratio_se']:.1f} | {r['midpoint_accuracy']:.3f} | {r['align_seconds']:.2f} |")
    cost = "; the table below measures the weight-matching cost itself." if timing else "."
    lines += ["", "`align s` is the median wall time of the pair runs' alignment (for learned methods: the learning "
              f"time), on a machine shared with other jobs{cost}",
              f"Learned methods' flags: {meta['learn']}.",
              *(["", "Soft permutations are not exact symmetries, so the aligned B is not B: its barrier above is "
                 "measured against the aligned B's own loss. The learning's midpoint gain (validation loss at "
                 "λ = 0.5, before minus after) and the aligned B's distance from B, both on the learning's validation "
                 "share of the training split:", "",
                 *approximate] if approximate else []),
              *(["", "Weight-matching time at each torch thread count, between two random-init models of each preset "
                 "and between two trained seeds (median of repeats; CPU time is the steadier figure on a shared "
                 "machine):", "", *timing_table(timing)] if timing else [])]
    return "\n".join(lines) + "\n"


def timing_table(timing: dict[str, Any]) -> list[str]:
    """The weight-matching timing as markdown table lines, one row per pair of models."""
    return ["| models | threads | wall s | CPU s | sweeps |", "|---|---|---|---|---|",
            *(f"| {t['models']} | {t['threads']} | {t['median_seconds']:.2f} | "
              f"{t['median_cpu_seconds']:.2f} | {t['sweeps']:.0f} |" for t in timing.values())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="simulations/bench/configs/barriers.toml")
    parser.add_argument("--models", nargs="*", help="measure only these model entries (by name, else preset; their "
                        "pair reports are cached); the others' rows, and the timing under --no-timing, stay as before")
    parser.add_argument("--no-timing", action="store_true", help="skip the weight-matching timing")
    parser.add_argument("--rows", nargs="+", help="a [pair] config: measure only these rows (by name; the others "
                        "are kept from its results.json)")
    args = parser.parse_args(argv)
    config = config_or_exit(parser, args.config)
    if "pair" in config:
        from simulations.bench.pair_rows import run_pair

        torch.set_num_threads(config["run"]["threads"])
        return run_pair(config, args.config, args.rows, command_line(sys.argv[1:] if argv is None else argv,
                                                                     keep_config=True))
    run, start = config["run"], time.perf_counter()
    torch.set_num_threads(run["threads"])
    learned = config.get("learned", {"methods": [], "args": []})
    measured = {label(m): measure_model(run, learned, m) for m in config["models"]
                if not args.models or label(m) in args.models}
    timing = None if args.no_timing else measure_timing(config)
    with results_lock(Path(run["out"])):
        # read only now, under the lock, so that another partial run that finished meanwhile keeps its rows
        previous = previous_results(Path(run["results"])) if args.models else {}
        summarise_run(config, args.config, learned, start, measured, previous, timing,
                      command_line(sys.argv[1:] if argv is None else argv))
    return 0


def summarise_run(config: dict[str, Any], config_path: str, learned: dict[str, Any], start: float,
                  measured: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]], previous: dict[str, Any],
                  timing: dict[str, Any] | None, command: str) -> None:
    """Merge this run's models with the rows kept from ``previous`` (and its timing, when this run measured none)
    and write the results."""
    run = config["run"]
    names = [label(m) for m in config["models"]]
    kept_rows = {name: ([r for r in previous.get("rows", []) if r.get("model", r["preset"]) == name],
                        previous.get("pairs", {}).get(name, [])) for name in names if name not in measured}
    every = measured | kept_rows
    rows = [row for name in names for row in every[name][0]]  # the config's order, measured or kept
    reports_by_model = {name: every[name][1] for name in names}
    kept_timing = previous.get("timing", {}) if timing is None else {}
    learn = "; ".join(f"{label(m)}: {' '.join(m.get('learn', learned['args']))}" for m in config["models"]
                      if learned_methods(learned, m))
    kept = [*kept_rows, *(["timing"] if kept_timing else [])]
    write_results(run, learn, config_path, rows, timing or kept_timing, reports_by_model,
                  time.perf_counter() - start, kept, command)


def measure_model(run: dict[str, Any], learned: dict[str, Any],
                  model: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train the model's missing seeds and measure every pair (cached); its summary rows and pair reports."""
    paths = train_missing(run, model)
    settings = run | model.get("run", {})  # a model may override run settings such as limit
    pairs = list(itertools.combinations(paths, 2))
    reports = [pair_report(settings, learned, model, a, b) for a, b in pairs]
    return summarise(model, reports, run["methods"] + learned_methods(learned, model)), reports


def trained_pairs(config: dict[str, Any]) -> dict[str, tuple[Path, Path]]:
    """Each configured model's first seed pair, where both checkpoints are on disk."""
    out = Path(config["run"]["out"])
    pairs = {f"{label(m)} (trained seeds {m['seeds'][0]}, {m['seeds'][1]})":
             (checkpoint(out, label(m), m["seeds"][0]), checkpoint(out, label(m), m["seeds"][1]))
             for m in config["models"]}
    return {name: pair for name, pair in pairs.items() if all(p.is_file() for p in pair)}


def measure_timing(config: dict[str, Any]) -> dict[str, Any]:
    """Weight-matching time for random inits of each timing preset and for each model's first trained pair (trained
    models need more sweeps than random ones), at each of the ``[timing]`` thread counts and residual starts."""
    repeats, before = config["timing"]["repeats"], torch.get_num_threads()
    cases: dict[str, tuple[str, tuple[Path, Path] | None]] = {f"{p} (random init)": (p, None)
                                                              for p in config["timing"]["presets"]}
    cases |= {name: ("", pair) for name, pair in trained_pairs(config).items()}
    timing = {}
    for start, threads in itertools.product(config["timing"].get("starts", ["identity"]), config["timing"]["threads"]):
        torch.set_num_threads(threads)
        for name, (preset_name, pair) in cases.items():
            models = name if start == "identity" else f"{name}, {start} start"
            timing[f"{models}, {threads} threads"] = {"models": models, "threads": threads,
                                                      **time_weight_matching(preset_name, repeats, pair, start)}
    torch.set_num_threads(before)
    return timing


def command_line(argv: list[str], keep_config: bool = False) -> str:
    """The command as run, without ``--config`` (the summary names the config on its own) unless ``keep_config``."""
    flags = argv if keep_config else [a for a, before in zip(argv, ["", *argv], strict=False)
                                      if "--config" not in (a, before)]
    return " ".join(["python -m simulations.bench.barriers", *flags])


@contextlib.contextmanager
def results_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive lock (a file in the git-ignored ``out``), so two partial runs that end together cannot
    interleave their read of results.json and their write of it: each keeps the other's rows."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def previous_results(results: Path) -> dict[str, Any]:
    """The results.json a partial run (``--models``) keeps the other presets' rows from; empty if there is none."""
    path = results / "results.json"
    return json.loads(path.read_text()) if path.exists() else {}


def write_results(run: dict[str, Any], learn: str, config: str, rows: list[dict[str, Any]], timing: dict[str, Any],
                  reports: dict[str, list[dict[str, Any]]], seconds: float, kept: list[str], command: str) -> None:
    """summary.md, results.json and one curve plot per model (its first pair) under the results folder."""
    from glmc.merging.interpolation import BarrierCurve
    from glmc.plots import plot_barrier_curves

    out = Path(run["results"])
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": command, "config": config, "points": run["points"],
            "limit": run["limit"], "threads": run["threads"], "learn": learn, "wall_minutes": seconds / 60,
            "kept": kept,
            "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} threads, "
                       f"python {platform.python_version()}, torch {torch.__version__}".strip()}
    (out / "summary.md").write_text(markdown(rows, timing, meta, approximate_table(reports)))
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "timing": timing,
                                                  "pairs": reports}, indent=1))
    fields = BarrierCurve.__dataclass_fields__
    for preset, pairs in ((p, r) for p, r in reports.items() if r):  # a model kept but never measured: no plot
        curves = [BarrierCurve(**{k: c[k] for k in fields}) for c in pairs[0]["curves"]]
        plot_barrier_curves(curves, out / f"curves_{preset}.png", f"{preset}: {pairs[0]['a']} vs {pairs[0]['b']}")
    print((out / "summary.md").read_text())


if __name__ == "__main__":
    raise SystemExit(main())
