"""Accelerator benchmark: train steps, learned matching of a pair, a 10-client learned aggregation and (on a GPU)
weight matching of a GPT-2-small pair, each a fixed piece of work timed on one device.

    .venv/bin/python -m simulations.bench.accelerator --device cuda   # on a GPU machine
    .venv/bin/python -m simulations.bench.accelerator --device cpu    # on this CPU, the rows beside them
    .venv/bin/python -m simulations.bench.accelerator --table         # summary.md from every results-*.json

Each run writes ``results-<device>.json`` (rows, device name, machine, wall time); ``--table`` puts the devices
side by side with the speed-up of every row present on both. The work is the same on both devices (sizes and step
counts from the config), so a speed-up is a ratio of two times of one workload.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from federation.protocol import Client
from glmc.archs import Arch, build_model, get_arch
from glmc.core.config import ModelConfig, preset
from glmc.device import peak_memory_mb, reset_peak_memory, resolve
from glmc.match.learned import learned_match
from glmc.match.options import LearnConfig, MatchOptions
from glmc.match.weight import weight_match
from glmc.merging.options import MergeOptions
from glmc.symmetry import groups
from glmc.symmetry.canonical import canonicalize
from glmc.symmetry.transforms import MATCHABLE, apply, random_transform
from glmc.train import TrainConfig, make_optimizer, seed_everything, set_threads, train_step
from harness.tomlfile import config_or_exit
from server.aggregation import merge

VOCAB = 80  # about the character vocabulary of the Shakespeare corpus
log = logging.getLogger(__name__)


def task_config(name: str) -> ModelConfig:
    """A preset at its dataset's shapes: 28×28 Fashion-MNIST for a ViT, character Shakespeare for GPT-2."""
    cfg = preset(name)
    if cfg.family == "vit":
        return cfg.replace(img_size=28, patch=7, in_chans=1, num_classes=10)
    return cfg.replace(vocab_size=VOCAB)


def random_batch(cfg: ModelConfig, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and targets of the real shapes."""
    g = torch.Generator().manual_seed(seed)
    if cfg.family == "vit":
        return (torch.randn(n, cfg.in_chans, cfg.img_size, cfg.img_size, generator=g),
                torch.randint(0, cfg.num_classes, (n,), generator=g))
    tokens = torch.randint(0, cfg.vocab_size, (n, cfg.context + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def timed(device: torch.device, work: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds of ``work()`` with the device's queue drained before and after, and what it returned. On a CPU, the
    process's CPU seconds: on a shared machine (this project's 2 cores run other jobs) wall time counts the waits
    for a core too, and with one torch thread the CPU time is what an idle machine's wall time would be."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    start, wall = clock(), time.perf_counter()
    out = work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    else:
        log.info("%.1f CPU seconds in %.1f wall seconds", clock() - start, time.perf_counter() - wall)
    return clock() - start, out


def _steps(model: nn.Module, arch: Arch, x: torch.Tensor, y: torch.Tensor, optimizer: torch.optim.Optimizer,
           precision: str, steps: int) -> None:
    for _ in range(steps):
        train_step(model, arch, x, y, optimizer, 1.0, precision)


def train_rows(section: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    """Milliseconds per optimizer step of each preset at its dataset's batch size, in each precision."""
    rows = []
    for name in section["presets"]:
        cfg = task_config(name)
        batch = 128 if cfg.family == "vit" else 32
        for precision in section["precisions"][device.type]:
            seed_everything(0)
            model, arch = build_model(cfg).to(device).train(), get_arch(cfg.family)
            optimizer = make_optimizer(model, TrainConfig())
            x, y = (t.to(device) for t in random_batch(cfg, batch))
            for _ in range(section["warmup"]):
                train_step(model, arch, x, y, optimizer, 1.0, precision)
            reset_peak_memory(device)
            steps = section["steps"][device.type]
            seconds, _ = timed(device, partial(_steps, model, arch, x, y, optimizer, precision, steps))
            rows.append({"row": f"train step {name} ({precision}, batch {batch})", "unit": "ms/step",
                         "value": 1000 * seconds / steps, "steps": steps, "peak_gpu_mb": peak_memory_mb(device)})
    return rows


def _canonical_pair(cfg: ModelConfig, device: torch.device) -> tuple[dict, dict]:
    """Two independently initialised models of ``cfg``, canonical float64, on ``device``."""
    arch = get_arch(cfg.family)
    states = []
    for seed in (0, 1):
        seed_everything(seed)
        states.append(canonicalize(arch, {k: v.to(device) for k, v in build_model(cfg).state_dict().items()},
                                   cfg, dtype=torch.float64))
    return states[0], states[1]


def pair_rows(section: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    """Learned matching of one pair: its weight-matching start and ``steps`` steps of Algorithm 1."""
    cfg = task_config(section["preset"])
    a, b = _canonical_pair(cfg, device)
    data = TensorDataset(*random_batch(cfg, section["samples"], seed=2))
    options = MatchOptions(learn=LearnConfig(steps=section["steps"], batch_size=section["batch-size"],
                                             eval_every=section["eval-every"], patience=0))
    arch = get_arch(cfg.family)
    reset_peak_memory(device)
    start_seconds, _ = timed(device, lambda: weight_match(a, b, arch.spec, cfg.depth, cfg.heads))
    seconds, result = timed(device, lambda: learned_match(a, b, cfg, data, options))
    return [{"row": f"learned matching, {section['preset']} pair ({section['steps']} steps, batch "
                    f"{section['batch-size']}, with its weight-matching start)", "unit": "s", "value": seconds,
             "weight_start_seconds": start_seconds, "learn_seconds": result.info["learn_seconds"],
             "peak_gpu_mb": peak_memory_mb(device)}]


def round_rows(section: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    """One ``learned`` aggregation of the Flower strategy: N clients aligned to the global model and refined."""
    cfg = task_config(section["preset"])
    natives = []
    for seed in range(section["clients"] + 1):
        seed_everything(seed)
        natives.append(build_model(cfg).state_dict())
    clients = [Client(s, 100.0 + i, 1.0) for i, s in enumerate(natives[1:])]
    server = TensorDataset(*random_batch(cfg, section["server-data"], seed=3))
    learn = LearnConfig(steps=section["steps"], batch_size=section["batch-size"], eval_every=section["steps"],
                        patience=0)
    reset_peak_memory(device)
    options = MergeOptions(max_iters=1, match=MatchOptions(learn=learn), device=str(device))
    seconds, result = timed(device, lambda: merge(clients, cfg, "learned", options, anchor=natives[0], data=server))
    return [{"row": f"{section['clients']}-client learned aggregation, {section['preset']} ({section['steps']} "
                    "refinement steps)", "unit": "s", "value": seconds, "align_seconds": result.align_seconds,
             "peak_gpu_mb": peak_memory_mb(device)}]


def big_rows(section: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    """Weight matching of a large GPT-2 and a planted transform of it: time, and the distance left (0 = found)."""
    if device.type not in section["devices"]:
        return []
    cfg = preset("gpt2-tiny").replace(width=section["width"], depth=section["depth"], heads=section["heads"],
                                      mlp=section["mlp"], vocab_size=section["vocab"], context=section["context"])
    arch = get_arch(cfg.family)
    a, _ = _canonical_pair(cfg, device)
    b = apply(a, arch.spec, random_transform(cfg, MATCHABLE, torch.Generator().manual_seed(7)), cfg.heads)
    reset_peak_memory(device)
    seconds, result = timed(device, lambda: weight_match(a, b, arch.spec, cfg.depth, cfg.heads))
    moved = apply(b, arch.spec, result.transform, cfg.heads)
    left = float(sum(((a[k] - moved[k]) ** 2).sum() for k in a) / sum((a[k] ** 2).sum() for k in a))
    params = sum(v.numel() for v in a.values())
    return [{"row": f"weight matching, GPT-2 d{cfg.width} × {cfg.depth} layers, vocabulary {cfg.vocab_size} "
                    f"({params / 1e6:.0f}M parameters), planted transform", "unit": "s", "value": seconds,
             "relative_distance_left": left, "sweeps": len(result.objective), "peak_gpu_mb": peak_memory_mb(device)}]


@contextlib.contextmanager
def cpu_svd_max(size: int) -> Iterator[None]:
    """``glmc.symmetry.groups.CPU_SVD_MAX`` set to ``size`` inside the block, restored after."""
    before, groups.CPU_SVD_MAX = groups.CPU_SVD_MAX, size
    try:
        yield
    finally:
        groups.CPU_SVD_MAX = before


def svd_rows(section: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    """Weight matching of two independent inits of each preset at each ``CPU_SVD_MAX`` (on a GPU, the largest
    matrix factored on the CPU): the threshold was chosen before it was measured."""
    if device.type not in section["devices"]:
        return []
    rows = []
    for name in section["presets"]:
        cfg = task_config(name)
        arch, (a, b) = get_arch(cfg.family), _canonical_pair(cfg, device)
        work = partial(weight_match, a, b, arch.spec, cfg.depth, cfg.heads)
        work()  # warm-up: the solver libraries load on first use
        for size in section["cpu-svd-max"]:
            with cpu_svd_max(size):
                seconds, result = timed(device, work)
            rows.append({"row": f"weight matching, {name} pair, CPU_SVD_MAX {size}", "unit": "s", "value": seconds,
                         "sweeps": len(result.objective)})
    return rows


SECTIONS = {"train": train_rows, "pair": pair_rows, "round": round_rows, "big": big_rows, "svd": svd_rows}


def device_name(device: torch.device) -> str:
    """The GPU's marketing name, or the CPU's model and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return f"{model}, {os.cpu_count()} cores"


def measure(config: dict[str, Any], device: torch.device, sections: list[str], out: Path) -> dict[str, Any]:
    """Every section's rows on ``device``, written to ``results-<device type>.json`` after each section (a run cut
    short keeps what it measured). Rows of an earlier run there that this one does not measure again are kept, so
    sections may be run one at a time; the wall time is summed over the runs."""
    set_threads(config["run"]["threads"] if device.type == "cpu" else 0)
    path = out / f"results-{device.type}.json"
    earlier: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {"rows": [], "wall_seconds": 0.0}
    began, fresh = time.perf_counter(), []
    report: dict[str, Any] = {"device": device.type, "name": device_name(device), "torch": torch.__version__,
                              "python": platform.python_version()}
    out.mkdir(parents=True, exist_ok=True)
    for name in sections:
        new = SECTIONS[name](config[name], device)
        fresh.extend(new)
        names = {row["row"] for row in fresh}
        report |= {"rows": [r for r in earlier["rows"] if r["row"] not in names] + fresh,
                   "wall_seconds": round(earlier["wall_seconds"] + time.perf_counter() - began, 1),
                   "load_average": os.getloadavg()}
        path.write_text(json.dumps(report, indent=1))
        for row in new:
            print(f"{device.type:5s} {row['row']}: {row['value']:.4g} {row['unit']}", flush=True)
    return report


def combine(out: Path) -> dict[str, Any]:
    """Every device's report in ``out`` (its results-*.json), by device type: what results.json holds."""
    return {r["device"]: r for r in (json.loads(p.read_text()) for p in sorted(out.glob("results-*.json")))}


def table(reports: dict[str, Any]) -> str:
    """summary.md: every row on every device measured, with the CPU-to-GPU speed-up where both have it."""
    devices = [d for d in ("cuda", "cpu") if d in reports]
    names = list(dict.fromkeys(row["row"] for d in devices for row in reports[d]["rows"]))
    values = {d: {row["row"]: row for row in reports[d]["rows"]} for d in devices}
    lines = ["# Accelerator benchmark", "",
             "Command: `python -m simulations.bench.accelerator --device DEVICE` on each machine, then `--table`. "
             "Config: `simulations/bench/configs/accelerator.toml`. GPU times are wall seconds with the device "
             "synchronised; CPU times are the process's CPU seconds with one torch thread (what an idle core's wall "
             "time would be: the project's 2-core machine is shared), so a speed-up is per core of this CPU.", ""]
    lines += [f"- {d}: {reports[d]['name']}; torch {reports[d]['torch']}, python {reports[d]['python']}; wall time "
              f"{reports[d]['wall_seconds']:.0f} s; load average {reports[d]['load_average'][0]:.1f}" for d in devices]
    lines += ["", "| workload | unit | " + " | ".join(devices) + " | speed-up | peak GPU MiB |",
              "|---|---|" + "---|" * len(devices) + "---|---|"]
    for name in names:
        cells = [f"{values[d][name]['value']:.4g}" if name in values[d] else "–" for d in devices]
        both = all(name in values[d] for d in ("cuda", "cpu") if d in values) and len(devices) == 2
        speed = f"{values['cpu'][name]['value'] / values['cuda'][name]['value']:.1f}×" if both else "–"
        unit = next(values[d][name]["unit"] for d in devices if name in values[d])
        peak = values["cuda"][name]["peak_gpu_mb"] if "cuda" in values and name in values["cuda"] else 0
        lines.append(f"| {name} | {unit} | " + " | ".join(cells) + f" | {speed} | {peak:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="simulations/bench/configs/accelerator.toml")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--out", type=Path, help="results folder (default: the config's run.results)")
    parser.add_argument("--table", action="store_true", help="measure nothing: write summary.md from results-*.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    config = config_or_exit(parser, args.config)
    out = args.out or Path(config["run"]["results"])
    if not args.table:
        sections = [s for s in args.sections.split(",") if s]
        unknown = [s for s in sections if s not in SECTIONS]
        if unknown:
            parser.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
        measure(config, resolve(args.device), sections, out)
    reports = combine(out)
    (out / "results.json").write_text(json.dumps(reports, indent=1))
    summary = table(reports)
    (out / "summary.md").write_text(summary)
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
