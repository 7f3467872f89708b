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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from glmc.archs import build_model
from glmc.core.config import ModelConfig
from glmc.io.formats import read
from harness.tomlfile import config_or_exit
from simulations.bench.barriers import machine
from simulations.bench.planting import PLANTERS


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
    """One ``glmc align`` run in a fresh process: exit code, wall time, peak RSS (None where the kernel killed it)
    and its report or the last line it wrote."""
    out = folder / f"aligned-{precision}"
    args = ["align", str(folder / "a"), str(folder / "b"), "--out", str(out), "--precision", precision, "--dtype",
            "bfloat16", "--force", "--threads", str(threads), *flags]
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, check=False)
    said = done.stderr.strip().splitlines() or [""]
    peak = int(said.pop().split()[1]) / 2**20 if said[-1].startswith("VmHWM") else None
    row: dict[str, Any] = {"precision": precision, "exit": done.returncode, "wall_seconds": time.perf_counter() - began,
                           "peak_rss_gb": peak, "command": "glmc " + " ".join(args)}
    if done.returncode < 0:
        row["refusal"] = f"killed by signal {-done.returncode} (out of memory: {_last_oom()})"
    elif done.returncode:
        row["refusal"] = said[-1] if said else ""
    else:
        row["report"] = json.loads(done.stdout.strip().splitlines()[-1])
    return row


def _last_oom() -> str:
    """The kernel's last out-of-memory line about a killed process, or what is known without it."""
    try:
        lines = subprocess.run(["dmesg"], capture_output=True, text=True, check=False).stdout.splitlines()
    except OSError:
        lines = []
    killed = [line.split("] ", 1)[-1] for line in lines if "Killed process" in line]
    return killed[-1] if killed else "the kernel's log is not readable"


def pair_facts(folder: Path) -> dict[str, Any]:
    """A's parameter count and B's distance from A (run in a spawned process, as :func:`checked` is)."""
    target, _ = read(folder / "a", stored=True)
    return {"params": sum(v.numel() for v in target.values()),
            "b_distance": distance(read(folder / "b", stored=True)[0], target)}


def checked(folder: Path, precision: str) -> float:
    """The aligned B's distance from A."""
    return distance(read(folder / f"aligned-{precision}", stored=True)[0], read(folder / "a", stored=True)[0])


def _spawned(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` in a fresh spawned process, so that this one stays small while the alignments run."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def measure(model: dict[str, Any], run: dict[str, Any], work: Path) -> Iterator[dict[str, Any]]:
    """Every precision's row for one model, each as soon as it is measured: the pair written once, each
    alignment checked against A."""
    cfg = ModelConfig.from_dict(model["config"])
    folder = work / model["name"]
    _spawned(write_pair, cfg, getattr(torch, run["stored"]), run["seed"], folder)
    facts = _spawned(pair_facts, folder)
    for precision in run["precisions"]:
        row = align(folder, precision, run["flags"], run["threads"])
        if row["exit"] == 0:
            row["distance"] = _spawned(checked, folder, precision)
            row["recovered"] = row["distance"] <= run["tolerance"] < facts["b_distance"]
        peak = "–" if row["peak_rss_gb"] is None else f"{row['peak_rss_gb']:.1f} GB"
        print(f"{model['name']} {precision}: exit {row['exit']}, {row['wall_seconds']:.0f} s, peak {peak}, "
              f"{row.get('distance', row.get('refusal'))}", flush=True)
        yield {"model": model["name"], **facts, **row}


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
        peak = "killed" if r["peak_rss_gb"] is None else f"{r['peak_rss_gb']:.1f}"
        result = f"{r['distance']:.1e}" if "distance" in r else f"refused: {r.get('refusal', '')}"
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.0f} | {r['precision']} | {r['exit']} | "
                     f"{r['wall_seconds']:.0f} | {'–' if seconds is None else f'{seconds:.0f}'} | "
                     f"{peak} | {result} | {r['b_distance']:.2f} | "
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
    for row in (row for name in names for row in measure(shapes[name], run, work)):
        rows.append(row | {"run": len(runs) - 1})  # saved after every row: a run cut off keeps what it measured
        runs[-1]["wall_minutes"] = (time.perf_counter() - began) / 60
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"runs": runs, "rows": rows}, indent=1) + "\n")
        (out / "summary.md").write_text(markdown(rows, runs, run["tolerance"]))
    print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
