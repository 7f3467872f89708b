"""What one federated round's alignment costs the server as more clients report: the strategy's merge
(:func:`glmc.merging.merge.merge_models` with the run config's merge options, as ``server.aggregation.merge`` runs
it around the global model) of N clients, N = 10, 30, 100 by default, with its wall time, CPU time and peak memory,
and the growth fitted to them.

    nice -n 10 .venv/bin/python -m simulations.bench.server_cost [--config simulations/bench/configs/server-cost.toml]

The clients are what a round receives: the global model (the preset's seeded initialisation) each moved by its own
local drift, Gaussian noise of ``drift`` times each tensor's RMS. Each N runs in a fresh process, which reports its
peak resident memory (VmHWM); the growth is the least-squares slope of log time (and of log added memory) on log N.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from federation.settings import RunSettings
from glmc.core.config import preset
from glmc.merging.merge import MergeSetup, merge_models
from glmc.merging.universe import members
from glmc.symmetry.exactness import random_native
from harness.tomlfile import config_or_exit
from simulations.bench.barriers import machine

HEADING = "# The server's cost of one round's alignment, against the number of clients"


def clients(run: dict[str, Any], n: int) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The global model and ``n`` clients drifted from it (float32, as clients send them)."""
    cfg = preset(run["model"]).replace(**run.get("config", {}))
    base = {k: v.float() for k, v in random_native(cfg, run["seed"]).items()}
    torch.manual_seed(run["seed"] + 1)
    drift = run["drift"]
    return base, [{k: v + drift * v.pow(2).mean().sqrt() * torch.randn_like(v) for k, v in base.items()}
                  for _ in range(n)]


def child(config: str, n: int) -> None:
    """One merge of ``n`` clients in this process; prints its report as JSON."""
    run = config_or_exit(argparse.ArgumentParser(), config)["run"]
    torch.set_num_threads(run["threads"])
    cfg = preset(run["model"]).replace(**run.get("config", {}))
    base, states = clients(run, n)
    before = _rss_mb()
    began, cpu = time.perf_counter(), time.process_time()
    options = RunSettings(aggregation=run["aggregation"], server_device="cpu").merge_options
    merged = merge_models(members(states, [cfg] * n), MergeSetup(cfg, options), anchor=base)
    wall, cpu = time.perf_counter() - began, time.process_time() - cpu
    print(json.dumps({"clients": n, "wall_seconds": wall, "cpu_seconds": cpu, "rss_before_mb": before,
                      "iterations": len(merged.universe.history),
                      "align_seconds": sum(r.align_seconds for r in merged.universe.history),
                      "distance_before": merged.distance_before, "distance_after": merged.distance_after}))


def _rss_mb() -> float:
    """This process's resident memory now (VmRSS), in MB."""
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) / 1024


def measure(config: str, n: int) -> dict[str, Any]:
    """One N in a fresh process: its report and its peak resident memory (VmHWM, since exec)."""
    code = (f"import sys\nfrom simulations.bench.server_cost import child\ntry:\n    child({config!r}, {n})\n"
            "finally:\n    print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).strip(), "
            "file=sys.stderr)")
    load = os.getloadavg()[0]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"N = {n}: exited {done.returncode}: {done.stderr.strip().splitlines()[-2:]}")
    peak = int(done.stderr.strip().splitlines()[-1].split()[1]) / 1024
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return row | {"peak_rss_mb": peak, "added_rss_mb": peak - row["rss_before_mb"], "load_before": load}


def slope(rows: list[dict[str, Any]], key: str) -> float | None:
    """The least-squares slope of log ``key`` on log N (None with fewer than two rows)."""
    if len(rows) < 2:
        return None
    xs, ys = [math.log(r["clients"]) for r in rows], [math.log(max(r[key], 1e-9)) for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def markdown(data: dict[str, Any]) -> list[str]:
    """The committed summary from results.json."""
    run, rows = data["config"]["run"], data["rows"]
    lines = [f"Command: `{data['command']}`; machine: {data['machine']}; wall time {data['wall_minutes']:.1f} min.",
             "", f"`{run['model']}` ({run.get('config', {}) or 'the preset'}), aggregation `{run['aggregation']}` at "
             "the run config's defaults, around the global model; clients drifted by "
             f"{run['drift']} "
             f"of each tensor's RMS from it (seed {run['seed']}); {run['threads']} torch thread(s).", "",
             "| clients | wall s | CPU s | align s | iterations | peak RSS MB | added MB | load before |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['clients']} | {r['wall_seconds']:.1f} | {r['cpu_seconds']:.1f} | {r['align_seconds']:.1f} | "
              f"{r['iterations']} | {r['peak_rss_mb']:.0f} | {r['added_rss_mb']:.0f} | {r['load_before']:.1f} |"
              for r in rows]
    growth = {key: slope(rows, key) for key in ("cpu_seconds", "added_rss_mb")}
    if growth["cpu_seconds"] is not None:
        lines += ["", f"Fitted growth (log-log slope over N): CPU time N^{growth['cpu_seconds']:.2f}, added memory "
                  f"N^{growth['added_rss_mb']:.2f}."]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations.bench.server_cost",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="simulations/bench/configs/server-cost.toml")
    args = parser.parse_args(argv)
    config = config_or_exit(parser, args.config)
    run, out = config["run"], Path(config["run"]["results"])
    began = time.perf_counter()
    rows = []
    for n in run["clients"]:
        rows.append(measure(args.config, n))
        print(f"N = {n}: {rows[-1]['wall_seconds']:.1f} s, peak {rows[-1]['peak_rss_mb']:.0f} MB", flush=True)
    data = {"config": config, "command": " ".join(["python -m simulations.bench.server_cost",
                                                   *(sys.argv[1:] if argv is None else argv)]),
            "machine": machine(), "wall_minutes": (time.perf_counter() - began) / 60, "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "summary.md").write_text("\n".join([HEADING, "", *markdown(data)]) + "\n")
    print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
