"""One command for a session lent a GPU machine: the CUDA tests, the gpt2-paper seeds and their barrier tables,
then the accelerator benchmark, each under its share of one deadline, with every log and result packed into one
archive (that machine gives back at most eight files).

    python3 -m simulations.bench.gpu_session --out "$OUT"                     # there (docs/accelerators.md)
    .venv/bin/python -m simulations.bench.gpu_session --out /tmp/gpu --tiny   # here: every step at toy sizes

Steps run in order; a failed or timed-out step is recorded and the next one starts. The seeds of every config
are trained side by side (a seed two configs train with one command is trained once and copied), and each bench
caches its pair reports, so a step cut short still returns what it finished. Back here, ``--unpack DIR`` puts
the archive and the seeds (returned in float16, as many as fit) in place; then run ``python -m harness.docs``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmc.core.config import preset
from glmc.io.formats import read, write
from simulations.bench.barriers import checkpoint, label, train_args

CONFIGS = {"barriers": Path("simulations/bench/configs/barriers.toml"),
           "matcher": Path("simulations/analyses/configs/matcher.toml"),
           "accelerator": Path("simulations/bench/configs/accelerator.toml")}
PY = [sys.executable]
LOGS = Path("outputs/gpu-session")  # git-ignored; packed, not returned file by file (eight files come back at most)
SEED_BYTES = 44 << 20  # of the 64 MiB the machine returns: two gpt2-paper seeds in float16, room left for the rest
SEED_PART = 15 << 20  # under the 16 MiB one returned file may hold


@dataclass(frozen=True)
class Step:
    """Commands run side by side under one time limit; ``then`` are file copies made after them, of each source
    that exists (a command that failed leaves its own missing)."""

    name: str
    seconds: float
    commands: list[list[str]]
    then: list[tuple[Path, Path]] = field(default_factory=list)
    ok: tuple[int, ...] = (0,)


def seed_paths(configs: dict[str, Path], models: list[str]) -> dict[tuple[str, ...], list[Path]]:
    """Every seed checkpoint of ``models`` the bench configs name, grouped by the ``glmc train`` arguments that
    make it (a seed two configs train alike is one group), the matcher config's first."""
    groups: dict[tuple[str, ...], list[Path]] = {}
    for name in ("matcher", "barriers"):
        config = tomllib.loads(configs[name].read_text())
        for model in (m for m in config["models"] if label(m) in models):
            for seed in model["seeds"]:
                path = checkpoint(Path(config["run"]["out"]), label(model), seed)
                groups.setdefault(tuple(train_args(model, seed)), []).append(path)
    return groups


def seed_training(configs: dict[str, Path], models: list[str]) -> tuple[list[list[str]], list[tuple[Path, Path]]]:
    """One ``glmc train`` command for every group of :func:`seed_paths` with a missing checkpoint, and the copies
    to make after: a seed trained by the same command in two configs is trained once."""
    commands, copies = [], []
    for key, paths in seed_paths(configs, models).items():
        if missing := [p for p in paths if not p.exists()]:
            commands.append([*PY, "-m", "glmc.cli", *key, "--out", str(missing[0]), "--quiet"])
            copies += [(missing[0], path) for path in missing[1:]]
    return commands, copies


def return_seeds(configs: dict[str, Path], models: list[str], out: Path, budget: int = SEED_BYTES,
                 part: int = SEED_PART) -> list[Path]:
    """The trained seeds in float16, in the configs' order while their bytes stay within ``budget``, as one tar
    cut into ``out``/seeds.tar.<i> files of at most ``part`` bytes (a gpt2-paper seed is 20.9 MiB even in
    float16, over what one returned file may hold): to study them on a CPU afterwards (:func:`unpack`)."""
    staged, size = LOGS / "seeds", 0
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    for paths in seed_paths(configs, models).values():
        if not (source := next((p for p in paths if p.exists()), None)):
            continue
        target = write(staged / seed_name(source), "glmc", *read(source), "float16")
        if size + target.stat().st_size > budget:
            target.unlink()
            break
        size += target.stat().st_size
    if not size:
        return []
    with tarfile.open(staged / "seeds.tar", "w") as tar:
        for seed in sorted(staged.glob("*.safetensors")):
            tar.add(seed, arcname=seed.name)
    data = (staged / "seeds.tar").read_bytes()
    parts = [out / f"seeds.tar.{i}" for i in range(-(-len(data) // part))]
    for i, path in enumerate(parts):
        path.write_bytes(data[i * part:(i + 1) * part])
    return parts


def seed_name(path: Path) -> str:
    """A seed checkpoint's file name in the returned tar: ``<model>-seed<k>.safetensors``."""
    return f"{path.parent.name}-{path.name}"


def unpack(folder: Path, configs: dict[str, Path], models: list[str]) -> list[Path]:
    """Put what a session returned in place here: its archive at the repository root, and each returned seed, in
    float32, at every path of its group that lacks one. Returns the seed checkpoints written."""
    with tarfile.open(folder / "results.tar.gz") as tar:
        tar.extractall(".", filter="data")
    staged = LOGS / "returned"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    if parts := sorted(folder.glob("seeds.tar.*"), key=lambda p: int(p.suffix[1:])):
        with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
            tar.extractall(staged, filter="data")
    placed = []
    for paths in seed_paths(configs, models).values():
        if (returned := staged / seed_name(paths[0])).is_file():
            state, meta = read(returned)
            placed += [write(p, "glmc", state, meta) for p in paths if not p.exists()]
    return placed


def plan(configs: dict[str, Path], models: list[str], device: str) -> list[Step]:
    """The session's steps, most wanted first. The CUDA tests and the seeds' training share the machine, and so do
    the three benches (each reads the seeds, none is timed); the accelerator bench, which is timed, runs alone:
    first the round, whose code changed since the GPU last measured it, and the CPU_SVD_MAX rows, never measured."""
    chosen = ["--models", *models]
    seeds, copies = seed_training(configs, models)
    tests = [*PY, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests/test_device.py"]
    return [
        Step("environment", 60, [[*PY, "-c", "import torch, platform; print(platform.python_version(), "
                                  "torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"]]),
        Step("bpe tokenizer", 60, [[*PY, "-c", "from glmc.data.bpe import load_shakespeare_bpe; "
                                    "load_shakespeare_bpe()"]]),  # cached once, before the seeds read it
        Step("cuda tests and seeds", 300, [tests, *seeds], copies, ok=(0, 5)),  # pytest's 5: none collected
        Step("paper tables", 420, [
            [*PY, "-m", "simulations.analyses.weight_options", "--config", str(configs["matcher"]), *chosen],
            [*PY, "-m", "simulations.bench.barriers", "--config", str(configs["barriers"]), *chosen, "--no-timing"],
            [*PY, "-m", "simulations.analyses.learning_budget", "--config", str(configs["barriers"]), *chosen]]),
        Step("accelerator", 240, [[*PY, "-m", "simulations.bench.accelerator", "--config", str(configs["accelerator"]),
                                   "--device", device, "--sections", "round,svd,pair,train,big"]]),
    ]


def log_stem(step: str) -> str:
    """The file-name stem of a step's logs: ``<stem>-<i>.log``, one per command."""
    return step.replace(" ", "-")


def run_step(step: Step, seconds: float, logs: Path) -> dict[str, Any]:
    """Run one step within ``seconds``; its commands' output goes to ``logs``/<step>-<i>.log. Kills what
    overruns (whole process groups) and returns the step's record."""
    began, procs = time.monotonic(), []
    for i, command in enumerate(step.commands):
        with (logs / f"{log_stem(step.name)}-{i}.log").open("w") as log:  # the child keeps its own copy
            procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                          env=os.environ | {"PYTHONUNBUFFERED": "1"}))
    timed_out = False
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, began + seconds - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    codes = [proc.returncode for proc in procs]
    for source, target in (pair for pair in step.then if pair[0].exists()):
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    ok = not timed_out and all(code in step.ok for code in codes)
    return {"step": step.name, "ok": ok, "timed_out": timed_out, "codes": codes,
            "seconds": round(time.monotonic() - began, 1), "commands": [" ".join(c) for c in step.commands]}


def run_steps(steps: list[Step], deadline: float, logs: Path) -> list[dict[str, Any]]:
    """Every step in order, each within its own limit and what is left of ``deadline`` seconds; a step with under
    ten seconds left is skipped."""
    end, records = time.monotonic() + deadline, []
    for step in steps:
        left = end - time.monotonic()
        if left < 10:
            records.append({"step": step.name, "ok": False, "skipped": "deadline"})
            continue
        records.append(run_step(step, min(step.seconds, left), logs))
        print(f"{step.name}: {'ok' if records[-1]['ok'] else 'FAILED'} in {records[-1]['seconds']} s, exit codes "
              f"{records[-1]['codes']}{' (timed out)' if records[-1]['timed_out'] else ''}", flush=True)
    return records


def results_of(configs: dict[str, Path], models: list[str]) -> list[Path]:
    """What the steps write that should come back: each bench's results folders (its run's and its tables' own),
    and the pair reports of ``models`` in each bench's cache."""
    paths = []
    for path in configs.values():
        config = tomllib.loads(path.read_text())
        run = config["run"]
        paths += [Path(run["results"]), *(Path(t["results"]) for t in config.values()
                                          if isinstance(t, dict) and t is not run and "results" in t)]
        if "out" in run:
            paths += [p for m in models for p in sorted((Path(run["out"]) / "barriers").glob(f"{m}_*.json"))]
    return [p for p in paths if p.exists()]


def pack(out: Path, paths: list[Path]) -> Path:
    """One gzipped archive of ``paths``, relative to the repository root."""
    archive = out / "results.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for path in paths:
            tar.add(path)
    return archive


def failures(records: list[dict[str, Any]], logs: Path, lines: int = 15) -> str:
    """The last lines of every failed step's logs, for the reply's output tail."""
    tails = []
    for record in (r for r in records if not r["ok"] and "skipped" not in r):
        for log in sorted(logs.glob(f"{log_stem(record['step'])}-*.log")):
            tails += [f"--- {log.name}", *log.read_text(errors="replace").splitlines()[-lines:]]
    return "\n".join(tails)


def tiny_model(model: dict[str, Any]) -> dict[str, Any]:
    """A bench model entry at toy size, under its own name: its family's tiny preset, one training step a seed, a
    few test samples, one learned step."""
    return model | {"name": label(model), "preset": f"{preset(model['preset']).family}-tiny", "run": {"limit": 4},
                    "train": [*model["train"], "--max-steps", "1"], "learn": ["--steps", "1", "--batch-size", "2"]}


def tiny_configs(folder: Path, models: list[str]) -> dict[str, Path]:
    """Copies of the bench configs with ``models`` at toy sizes (:func:`tiny_model`) and outputs under ``folder``:
    to try every step of the session on a CPU before spending GPU time on it."""
    import tomli_w  # here only: the GPU machine's image lacks it, and never runs this

    folder.mkdir(parents=True, exist_ok=True)
    configs = {name: tomllib.loads(path.read_text()) for name, path in CONFIGS.items()}
    for name in ("matcher", "barriers"):
        config = configs[name]
        config["run"] |= {"out": str(folder / name), "results": str(folder / "results" / name), "limit": 4,
                          "points": 3, "batch": 8}
        config["models"] = [tiny_model(m) for m in config["models"] if label(m) in models]
    configs["matcher"]["options"] |= {"models": models, "variants": configs["matcher"]["options"]["variants"][:2]}
    budget = configs["barriers"]["budget"]
    budget |= {"results": str(folder / "results" / "budget"), "models": models,
               "settings": [s | {"args": [*s["args"], "--steps", "1"]} for s in budget["settings"]
                            if set(s.get("models", budget["models"])) & set(models)]}
    accel = configs["accelerator"]
    accel["run"]["results"] = str(folder / "results" / "accelerator")
    accel["train"] |= {"presets": ["gpt2-bench"], "warmup": 0, "steps": {"cpu": 1, "cuda": 1}}
    accel["pair"] |= {"steps": 2, "samples": 64, "batch-size": 8, "eval-every": 1}
    accel["round"] |= {"clients": 2, "steps": 1, "batch-size": 8, "server-data": 64}
    accel["svd"] |= {"devices": ["cpu", "cuda"], "presets": ["gpt2-bench"], "cpu-svd-max": [0, 512]}
    paths = {name: folder / f"{name}.toml" for name in configs}
    for name, config in configs.items():
        paths[name].write_text(tomli_w.dumps(config))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="there: where steps.json, results.tar.gz and the seeds go")
    where.add_argument("--unpack", type=Path, metavar="DIR", help="here, after a session: put what it returned "
                       "(DIR, the folder its files lie in) in place")
    parser.add_argument("--models", nargs="+", default=["gpt2-paper"], help="the bench models to train and measure")
    parser.add_argument("--deadline", type=float, default=540, help="seconds for every step together")
    parser.add_argument("--device", default="auto", help="the accelerator bench's device")
    parser.add_argument("--tiny", action="store_true", help="toy sizes, outputs under --out: to try it on a CPU")
    args = parser.parse_args(argv)
    if args.unpack:
        placed = unpack(args.unpack, CONFIGS, args.models)
        print(f"unpacked {args.unpack / 'results.tar.gz'}; {len(placed)} seed checkpoints placed (float16 values); "
              "now run python -m harness.docs")
        return 0
    shutil.rmtree(LOGS, ignore_errors=True)
    LOGS.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    configs = tiny_configs(args.out / "tiny", args.models) if args.tiny else CONFIGS
    records = run_steps(plan(configs, args.models, args.device), args.deadline, LOGS)
    (LOGS / "steps.json").write_text(json.dumps(records, indent=1))
    shutil.copyfile(LOGS / "steps.json", args.out / "steps.json")
    archive = pack(args.out, [*results_of(configs, args.models), LOGS])
    print(failures(records, LOGS))
    parts = return_seeds(configs, args.models, args.out)  # after the archive: a failure here loses no result
    print(f"{sum(r['ok'] for r in records)} of {len(records)} steps ok; {archive}; the seeds in {len(parts)} parts")
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
