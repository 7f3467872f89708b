"""Barriers and merges of a declared family's seeds, trained here, through the same commands a user runs: ``glmc
train`` for each seed, ``glmc barrier`` (none, weight, learned) for the pair of the first two, ``glmc merge`` of all of
them by weight and by learned matching.

    .venv/bin/python -m simulations.bench.families [--model llama-tiny] [--seeds 3] [--steps 100]

Prints the figures and writes outputs/bench/families-<model>.json (the seeds' test losses, the barriers, the merges,
the machine and wall time); the barriers use the first 256 held-out windows and 5 points, the merges 3 simplex points
per model. ``--publish`` also writes simulations/results/families-<model>/ (results.json and summary.md).
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
RESULTS = Path(__file__).resolve().parent.parent / "results"


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
    parser.add_argument("--publish", action="store_true", help="write simulations/results/families-<model>/ too")
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
    print("\n".join(markdown(report)))
    (OUT / f"families-{args.model}.json").write_text(json.dumps(report, indent=1))
    if args.publish:
        folder = RESULTS / f"families-{args.model}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "results.json").write_text(json.dumps(report, indent=1) + "\n")
        command = f"python -m simulations.bench.families --model {args.model} --seeds {args.seeds} --steps {args.steps}"
        (folder / "summary.md").write_text("\n".join([
            f"# {args.model}: barriers and merges of seeds trained here", "",
            f"Command: `{command} --publish`. Machine: {report['machine']}; {report['seconds']:.0f} s of wall time "
            "in all (training included, on a CPU shared with other jobs).", "", *markdown(report), ""]))
    return 0


def markdown(report: dict) -> list[str]:
    """The seeds' test losses, the pair's barriers and the merges, as a table."""
    barriers, merges = report["barriers"], report["merges"]
    losses = ", ".join(f"{x:.3f}" for x in report["test_losses"])
    return [f"{report['seeds']} seeds of {report['model']}, {report['steps']} steps each on {report['dataset']} "
            f"(test losses {losses}); barriers of seeds 0 and 1 on 256 held-out windows, 5 points; merges of all "
            "seeds, 3 simplex points per model.", "",
            "| | none | weight | learned |", "|---|---|---|---|",
            f"| pair barrier | {barriers['none']:.4f} | {barriers['weight']:.4f} | {barriers['learned']:.4f} |",
            f"| merge: simplex barrier | – | {merges['weight']['simplex_barrier']:.4f} | "
            f"{merges['learned']['simplex_barrier']:.4f} |",
            f"| merge: accuracy % (inputs' mean {100 * merges['weight']['mean_input_accuracy']:.1f}) | – | "
            f"{100 * merges['weight']['merged_accuracy']:.1f} | {100 * merges['learned']['merged_accuracy']:.1f} |"]


if __name__ == "__main__":
    raise SystemExit(main())
