"""``glmc align`` on billion-parameter pairs stored in bfloat16, as a user runs it: wall time and the process's
peak memory at each ``--precision``, and whether the planted transform was undone.

    nice -n 10 .venv/bin/python -m simulations.bench.precision [--config simulations/bench/configs/precision.toml]
        [--models NAME ...]

For each model (a shape of the scaling bench's config, by name): A is its seeded initialisation rounded to the
stored dtype and saved by transformers; B is A moved by a transform planted on the HF names by
:mod:`simulations.bench.planting` (in float32, then rounded and saved). Each precision runs ``glmc align A B`` in a
fresh process; its peak resident memory is the kernel's (``os.wait4``). Recovered: the aligned B within ``tolerance``
of A (relative Frobenius distance over every tensor; the stored dtype's rounding is about 1e-3), B itself far from it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from glmc.archs import ModelConfig, build_model
from glmc.io.formats import read
from simulations.bench.barriers import machine
from simulations.bench.planting import PLANTERS
from simulations.tomlfile import config_or_exit


def write_pair(cfg: ModelConfig, dtype: torch.dtype, seed: int, folder: Path) -> None:
    """A (seeded init, rounded to ``dtype``) and B = planted(A) as save_pretrained folders ``folder``/a, /b."""
    if (folder / "b" / "config.json").is_file():
        return
    torch.manual_seed(seed)
    model: Any = build_model(cfg).to(dtype)  # a transformers model: save_pretrained, config
    model.save_pretrained(str(folder / "a"))
    native = {k: v.float() for k, v in model.state_dict().items()}
    moved = PLANTERS[cfg.family](native, model.config, seed)
    model.load_state_dict({k: v.to(dtype) for k, v in moved.items()})
    model.save_pretrained(str(folder / "b"))


def distance(state: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> float:
    """‖state − target‖ / ‖target‖ over every tensor, in float64 one tensor at a time."""
    num = sum(float(((state[k].double() - v.double()) ** 2).sum()) for k, v in target.items())
    return (num / sum(float((v.double() ** 2).sum()) for v in target.values())) ** 0.5


# The child runs glmc's CLI and reports its own peak RSS (VmHWM: the kernel's high-water mark of this process's
# memory since exec; rusage's maxrss would include the parent's, which fork copied before exec).
CHILD = ("import sys\nfrom glmc.cli import main\ntry:\n    code = main(sys.argv[1:])\nfinally:\n"
         "    print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).strip(), file=sys.stderr)\n"
         "sys.exit(code)")


def align(folder: Path, precision: str, flags: list[str], threads: int) -> dict[str, Any]:
    """One ``glmc align`` run in a fresh process: exit code, wall time, peak RSS and its report or its one-line
    refusal."""
    out = folder / f"aligned-{precision}"
    args = ["align", str(folder / "a"), str(folder / "b"), "--out", str(out), "--precision", precision, "--dtype",
            "bfloat16", "--force", "--threads", str(threads), *flags]
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, check=False)
    *said, peak = done.stderr.strip().splitlines()
    row: dict[str, Any] = {"precision": precision, "exit": done.returncode, "wall_seconds": time.perf_counter() - began,
                           "peak_rss_gb": int(peak.split()[1]) / 2**20, "command": "glmc " + " ".join(args)}
    if done.returncode:
        row["refusal"] = said[-1] if said else ""
    else:
        row["report"] = json.loads(done.stdout.strip().splitlines()[-1])
    return row


def measure(model: dict[str, Any], run: dict[str, Any], work: Path) -> list[dict[str, Any]]:
    """Every precision's row for one model: the pair written once (in a spawned process, so this one stays small
    while the alignments run), each alignment then checked against A."""
    cfg = ModelConfig.from_dict(model["config"])
    folder = work / model["name"]
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(write_pair, cfg, getattr(torch, run["stored"]), run["seed"], folder).result()
    rows = [align(folder, precision, run["flags"], run["threads"]) for precision in run["precisions"]]
    target, _ = read(folder / "a", stored=True)
    far = distance(read(folder / "b", stored=True)[0], target)
    for row in rows:
        if row["exit"] == 0:
            row["distance"] = distance(read(folder / f"aligned-{row['precision']}", stored=True)[0], target)
            row["recovered"] = row["distance"] <= run["tolerance"] < far
        print(f"{model['name']} {row['precision']}: exit {row['exit']}, {row['wall_seconds']:.0f} s, peak "
              f"{row['peak_rss_gb']:.1f} GB, {row.get('distance', row.get('refusal'))}", flush=True)
    params = sum(v.numel() for v in target.values())
    return [{"model": model["name"], "params": params, "b_distance": far, **row} for row in rows]


def markdown(rows: list[dict[str, Any]], runs: list[dict[str, Any]], tolerance: float) -> str:
    """The committed summary: the runs, then one row per (model, precision)."""
    lines = ["# glmc align on bfloat16 pairs at each --precision", "",
             *(f"Run {i}: `{r['command']}`; machine: {r['machine']}; {r['wall_minutes']:.1f} min; load average "
               f"{r['load_before']} before." for i, r in enumerate(runs)), "",
             "A: the shape's seeded initialisation in bfloat16, saved by transformers; B: A moved by a transform "
             "planted on the HF names (simulations.bench.planting), rounded to bfloat16. Peak RSS: the whole "
             f"`glmc align` process (reading, the read check, matching, writing). Recovered: aligned B within "
             f"{tolerance:g} of A (relative distance), B itself at the distance given.", "",
             "| model | params (M) | precision | exit | wall s | align s | peak RSS GB | aligned B to A | B to A "
             "| recovered | run |", "|" + "---|" * 11]
    for r in rows:
        seconds = r.get("report", {}).get("seconds")
        result = f"{r['distance']:.1e}" if "distance" in r else f"refused: {r.get('refusal', '')}"
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.0f} | {r['precision']} | {r['exit']} | "
                     f"{r['wall_seconds']:.0f} | {'–' if seconds is None else f'{seconds:.0f}'} | "
                     f"{r['peak_rss_gb']:.1f} | {result} | {r['b_distance']:.2f} | "
                     f"{'yes' if r.get('recovered') else ('–' if r['exit'] else 'NO')} | {r['run']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="simulations/bench/configs/precision.toml")
    parser.add_argument("--models", nargs="*", help="run only these shapes; the others' rows are kept")
    args = parser.parse_args(argv)
    config = config_or_exit(parser, args.config)
    run = config["run"]
    shapes = {m["name"]: m for m in config_or_exit(parser, run["shapes"])["models"]}
    names = args.models or run["models"]
    if unknown := sorted(set(names) - set(shapes)):
        parser.exit(2, f"{parser.prog}: error: no shape named {unknown[0]!r} in {run['shapes']}\n")
    out, work, began = Path(run["results"]), Path(run["work"]), time.perf_counter()
    kept = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
    command = " ".join(["python -m simulations.bench.precision", *(sys.argv[1:] if argv is None else argv)])
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    runs = [*kept.get("runs", []), {"command": command, "machine": machine(), "load_before": load}]
    rows = [r for r in kept.get("rows", []) if r["model"] not in names]
    for name in names:  # saved after every shape: a run cut off keeps what it measured
        rows += [r | {"run": len(runs) - 1} for r in measure(shapes[name], run, work)]
        runs[-1]["wall_minutes"] = (time.perf_counter() - began) / 60
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"runs": runs, "rows": rows}, indent=1) + "\n")
        (out / "summary.md").write_text(markdown(rows, runs, run["tolerance"]))
    print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
