"""The GPU session's runner (simulations.bench.gpu_session): a step that fails or overruns is recorded and the
next one runs; the plan trains a seed two bench configs share once; what it packs comes back."""

from __future__ import annotations

import sys
import tarfile
from pathlib import Path

import pytest
import torch

from glmc.archs import build_model
from glmc.io.checkpoint import CheckpointMeta, load_checkpoint, save_checkpoint
from glmc.io.formats import read, write
from simulations.analyses import learning_budget, weight_options
from simulations.bench import gpu_session
from simulations.bench.barriers import label
from simulations.bench.gpu_session import Step, pack, results_of, run_steps, seed_paths, seed_training, tiny_configs

PY = [sys.executable, "-c"]


def test_a_failed_or_overrunning_step_is_recorded_and_the_next_still_runs(tmp_path):
    made, copy = tmp_path / "made.txt", tmp_path / "copy" / "made.txt"
    never, no_copy = tmp_path / "never.txt", tmp_path / "copy" / "never.txt"
    steps = [Step("fails", 30, [[*PY, "raise SystemExit(3)"], [*PY, "pass"]]),
             Step("overruns", 1, [[*PY, "import time; time.sleep(60)"]]),
             Step("writes", 30, [[*PY, f"open({str(made)!r}, 'w').write('x')"], [*PY, "raise SystemExit(1)"]],
                  then=[(made, copy), (never, no_copy)])]
    failed, overran, wrote = run_steps(steps, 60, tmp_path)
    assert (failed["ok"], failed["codes"], failed["timed_out"]) == (False, [3, 0], False)
    assert overran["ok"] is False and overran["timed_out"] and overran["seconds"] < 30
    assert not wrote["ok"] and copy.read_text() == "x" and not no_copy.exists()  # what was made is kept
    assert (tmp_path / "fails-0.log").exists() and (tmp_path / "fails-1.log").exists()


def test_steps_past_the_deadline_are_skipped(tmp_path):
    records = run_steps([Step("late", 30, [[*PY, "pass"]])], 5, tmp_path)
    assert records == [{"step": "late", "ok": False, "skipped": "deadline"}]


def test_a_seed_both_configs_train_alike_is_trained_once_and_copied(tmp_path):
    configs = tiny_configs(tmp_path, ["gpt2-paper"])
    commands, copies = seed_training(configs, ["gpt2-paper"])
    outs = [Path(c[c.index("--out") + 1]) for c in commands]
    assert sorted(p.name for p in outs) == [f"seed{s}.safetensors" for s in range(6)]  # matcher.toml's seeds
    assert all("--max-steps" in c for c in commands)
    assert [(a.name, b.name) for a, b in copies] == [(f"seed{s}.safetensors",) * 2 for s in range(3)]
    assert all(a in outs and b.parent == tmp_path / "barriers" / "gpt2-paper" for a, b in copies)


def test_the_archive_holds_the_results_and_pair_reports_of_the_chosen_models(tmp_path):
    configs = tiny_configs(tmp_path / "tiny", ["gpt2-paper"])
    for name in ("matcher", "barriers"):
        (tmp_path / "tiny/results" / name).mkdir(parents=True)
        (tmp_path / "tiny/results" / name / "summary.md").write_text(name)
    (tmp_path / "tiny/matcher/barriers").mkdir(parents=True)
    for report in ("gpt2-paper_seed0_seed1.json", "vit-bench_seed0_seed1.json"):
        (tmp_path / "tiny/matcher/barriers" / report).write_text("{}")
    with tarfile.open(pack(tmp_path, results_of(configs, ["gpt2-paper"]))) as tar:
        names = {name.split("/tiny/", 1)[1] for name in tar.getnames() if "/tiny/" in name}
    assert names >= {"matcher/barriers/gpt2-paper_seed0_seed1.json", "results/matcher/summary.md",
                     "results/barriers/summary.md"}
    assert "matcher/barriers/vit-bench_seed0_seed1.json" not in names


@pytest.mark.parametrize(("bench", "config", "folder"), [(weight_options, "matcher", "matcher"),
                                                        (learning_budget, "barriers", "budget")])
def test_a_tiny_session_bench_publishes_under_its_own_folder(bench, config, folder, tmp_path, monkeypatch):
    """A tiny session must not touch the committed tables: each bench publishes where its config says."""
    configs = tiny_configs(tmp_path, ["gpt2-paper"])
    monkeypatch.setattr(bench, "measure_model", lambda run, table, model, command: {"model": label(model)})
    monkeypatch.setattr(bench, "markdown", lambda name, entry: [f"{name}: {entry['model']}"])
    assert bench.main(["--config", str(configs[config]), "--models", "gpt2-paper"]) == 0
    assert "gpt2-paper: gpt2-paper" in (tmp_path / "results" / folder / "summary.md").read_text()


def test_seeds_come_back_in_float16_within_the_budget_and_are_placed_in_float32(tmp_path, monkeypatch, tiny_gpt2):
    """Two of the six seeds fit the budget; cut into parts, they are put back at every path their group names."""
    monkeypatch.setattr(gpu_session, "LOGS", tmp_path / "logs")
    configs = tiny_configs(tmp_path / "there", ["gpt2-paper"])
    groups = list(seed_paths(configs, ["gpt2-paper"]).values())
    cfg = tiny_gpt2
    for i, paths in enumerate(groups):
        torch.manual_seed(i)
        save_checkpoint(paths[0], build_model(cfg), CheckpointMeta(preset="gpt2-tiny", config=cfg, seed=i))
    one = write(tmp_path / "half.safetensors", "glmc", *read(paths[0]), "float16").stat().st_size
    out = tmp_path / "out"
    out.mkdir()
    pack(out, [])
    parts = gpu_session.return_seeds(configs, ["gpt2-paper"], out, budget=2 * one + one // 2, part=one // 2)
    assert len(parts) > 4 and all(p.stat().st_size <= one // 2 for p in parts)
    for paths in groups:
        for path in paths:
            path.unlink(missing_ok=True)
    monkeypatch.chdir(tmp_path)
    placed = gpu_session.unpack(out, configs, ["gpt2-paper"])
    assert placed == [*groups[0], *groups[1]]  # seeds 0 and 1, each where the matcher and the barrier bench read it
    for i, paths in enumerate(groups[:2]):
        torch.manual_seed(i)
        want = build_model(cfg).state_dict()
        for path in paths:
            state, meta = load_checkpoint(path)
            assert meta.seed == i and {v.dtype for v in state.values()} == {torch.float32}
            assert all(torch.equal(state[k], v.half().float()) for k, v in want.items())
