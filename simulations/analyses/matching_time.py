"""Weight-matching time alone, apart from the barrier benchmark: the ``[timing]`` presets of its config between
random inits, and every configured model's first trained pair whose checkpoints exist (no training here).

    .venv/bin/python -m simulations.analyses.matching_time [--config simulations/bench/configs/barriers.toml]

Run it on an idle machine: it is the figure that a shared CPU distorts most.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from harness.tomlfile import config_or_exit
from simulations.bench.barriers import measure_timing, timing_table

RESULTS = Path("simulations/results/matching-time")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="simulations/bench/configs/barriers.toml")
    args = parser.parse_args(argv)
    config = config_or_exit(parser, args.config)
    repeats, start = config["timing"]["repeats"], time.perf_counter()
    timing = measure_timing(config)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = ["# Weight-matching time", "",
             f"Command: `python -m simulations.analyses.matching_time --config {args.config}`. Machine: "
             f"{platform.machine()}, {os.cpu_count()} cores, python "
             f"{platform.python_version()}, torch {torch.__version__}; wall time {time.perf_counter() - start:.0f} s; "
             f"load average at the end {load}.",
             f"Weight matching (float64 in, float32 search, canonical form), median of {repeats} repeats at each "
             "torch thread count.", "",
             *timing_table(timing)]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "summary.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "results.json").write_text(json.dumps({"load_average": os.getloadavg(), "timing": timing}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
