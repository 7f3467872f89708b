"""Barriers and merges of a declared family's seeds, trained here, through the same commands a user runs: ``glmc
train`` for each seed, ``glmc barrier`` (none, weight, learned) for the pair of the first two, ``glmc merge`` of all of
them by weight and by learned matching.

    .venv/bin/python -m simulations.bench.families [--model llama-tiny] [--seeds 3] [--steps 100]

Prints the figures and writes outputs/bench/families-<model>.json (the seeds' commands, the barriers, the merges, the
wall time); the barriers use the first 256 held-out windows and 5 points, the merges 3 simplex points per model.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import time
from pathlib import Path

import torch

from glmc.cli import main as glmc

OUT = Path("outputs/bench")


def _run(argv: list[str]) -> dict:
    """One glmc command; its last stdout line, a JSON object."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = glmc(argv)
    if code != 0:
        raise SystemExit(f"glmc {' '.join(argv)} exited {code}")
    return json.loads(stdout.getvalue().strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations.bench.families", description=__doc__)
    parser.add_argument("--model", default="llama-tiny", help="a preset of the family (default: llama-tiny)")
    parser.add_argument("--dataset", default="shakespeare", help="default: shakespeare")
    parser.add_argument("--seeds", type=int, default=3, help="models trained, seeds 0.. (default: 3)")
    parser.add_argument("--steps", type=int, default=100, help="training steps per seed (default: 100)")
    parser.add_argument("--learn-steps", type=int, default=20, help="learned matching's steps (default: 20)")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    root = OUT / f"families-{args.model}"
    paths = [root / f"seed{seed}.safetensors" for seed in range(args.seeds)]
    trained = [_run(["train", "--model", args.model, "--dataset", args.dataset, "--max-steps", str(args.steps),
                     "--seed", str(seed), "--threads", "1", "--quiet", "--force", "--out", str(path)])
               for seed, path in enumerate(paths)]
    barriers = _run(["barrier", str(paths[0]), str(paths[1]), "--method", "none", "--method", "weight", "--method",
                     "learned", "--steps", str(args.learn_steps), "--points", "5", "--limit", "256",
                     "--json", str(root / "barrier.json")])
    merges = {method: _run(["merge", *map(str, paths), "--method", method, "--steps", str(args.learn_steps),
                            "--simplex-points", "3", "--force", "--out", str(root / f"merged-{method}.safetensors")])
              for method in ("weight", "learned")}
    report = {"model": args.model, "dataset": args.dataset, "steps": args.steps, "seeds": args.seeds,
              "test_losses": [t["test_loss"] for t in trained], "barriers": barriers, "merges": merges,
              "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
              "seconds": round(time.perf_counter() - began, 1)}
    print(json.dumps(report, indent=1))
    (OUT / f"families-{args.model}.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
