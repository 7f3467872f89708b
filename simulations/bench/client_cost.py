"""What a client's round costs besides training: its local epochs against its central-test score (``client-test``),
on one thread, for one client of a grid's own run config.

    nice -n 10 .venv/bin/python -m simulations.bench.client_cost [--config simulations/configs/width-baselines.toml]
        [--partition 0] [--repeats 3]

The client is built as the ClientApp builds it (its partition of the grid's split, full width, the ClientApp's own
round-1 training config and central-test score, ``eval-limit`` samples), trained from the seeded initial model.
CPU seconds, so a shared machine's load does not count; the figures and the machine go to
``simulations/results/client-cost/`` (results.json, summary.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from client.app import client_test, train_config
from federation.data import client_share, eval_subset, pool
from federation.settings import RunSettings
from glmc.archs import build_model, get_arch
from glmc.train import seed_everything, set_threads, train
from harness.tomlfile import read_toml
from simulations.bench.barriers import machine

RESULTS = Path("simulations/results/client-cost")


def _settings(config: Path) -> RunSettings:
    """The grid's run config with its first split (the cells' own keys, the seed and outputs aside)."""
    raw = read_toml(config)
    split = {k: v for k, v in raw.get("splits", [{}])[0].items() if k != "label"}
    return RunSettings.from_run_config({**raw["run"], **split})


def _cpu(fn: Any) -> tuple[float, Any]:
    """(CPU seconds of this process, result) of ``fn()``."""
    start = time.process_time()
    result = fn()
    return time.process_time() - start, result


def measure(settings: RunSettings, partition: int, clients: int, repeats: int) -> dict[str, Any]:
    """Each repeat: a fresh seeded model's local training on ``partition``, then its central-test score."""
    set_threads(1)
    data = pool(settings)
    share = client_share(settings, partition, clients)
    config = train_config(settings, data.task.defaults, settings.seed, torch.device("cpu"), 1)
    arch, runs = get_arch(data.task.config.family), []
    for _ in range(repeats):
        seed_everything(settings.seed)
        model = build_model(data.task.config)
        train_s, fit = _cpu(lambda m=model: train(m, arch, share.train, config, progress=False))
        test_s, _ = _cpu(lambda m=model: client_test(m, arch, settings))
        runs.append({"train_cpu_s": train_s, "steps": int(fit["steps"]), "test_cpu_s": test_s,
                     "test_share": test_s / train_s})
    test = eval_subset(data.test, settings.eval_limit, settings.seed)
    return {"model": settings.model, "dataset": settings.dataset, "partition": partition, "clients": clients,
            "train_samples": len(share.train), "test_samples": len(test), "runs": runs,  # type: ignore[arg-type]
            "test_share_median": statistics.median(r["test_share"] for r in runs), "machine": machine()}


def markdown(result: dict[str, Any]) -> list[str]:
    """The repeats' table and the median share (docs/results.md renders this too)."""
    lines = ["| repeat | steps | training CPU s | test CPU s | test / training |", "|---|---|---|---|---|"]
    lines += [f"| {i} | {r['steps']} | {r['train_cpu_s']:.2f} | {r['test_cpu_s']:.2f} | {r['test_share']:.2f} |"
              for i, r in enumerate(result["runs"])]
    return [*lines, "", f"Median test / training: {result['test_share_median']:.2f}."]


def summary(result: dict[str, Any], command: str) -> str:
    """summary.md: the command, the machine and each repeat's CPU seconds."""
    head = (f"# Client cost: training against the central-test score\n\nCommand: `{command}`. Machine: "
            f"{result['machine']}. {result['model']} on {result['dataset']}, partition {result['partition']} of "
            f"{result['clients']} ({result['train_samples']} training samples), scored on {result['test_samples']} "
            "central test samples.\n")
    return "\n".join([head, *markdown(result)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations.bench.client_cost", description=__doc__)
    parser.add_argument("--config", type=Path, default=Path("simulations/configs/width-baselines.toml"))
    parser.add_argument("--partition", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    clients = int(read_toml(args.config)["experiment"]["num-supernodes"])
    result = measure(_settings(args.config), args.partition, clients, args.repeats)
    command = f"python -m simulations.bench.client_cost --config {args.config} --repeats {args.repeats}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "results.json").write_text(json.dumps(result, indent=1))
    (RESULTS / "summary.md").write_text(summary(result, command))
    print(summary(result, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
