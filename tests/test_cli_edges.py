"""The command line's edges: bad input is refused in one line before any work, and what the package ships."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch

import glmc
from glmc.archs import build_model
from glmc.cli import main
from glmc.cli.outputs import PLOT_FORMATS
from glmc.core.config import preset
from glmc.data.fashion_mnist import load_fashion_mnist
from glmc.errors import ConfigError, DataNotFoundError
from glmc.io.checkpoint import CheckpointMeta, save_checkpoint
from glmc.merging.evaluation import grid_steps

ROOT = Path(__file__).resolve().parent.parent
VIT = preset("vit-tiny").replace(num_classes=10, in_chans=1, img_size=28, depth=1)


def _checkpoint(path: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    return save_checkpoint(path, build_model(VIT), CheckpointMeta(preset="vit-tiny", config=VIT, seed=seed,
                                                                  dataset="fashion-mnist"))


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], expect: str, seconds: float = 10.0) -> None:
    """``glmc ARGV`` exits 2 at once with one stderr line naming the problem, and prints nothing else."""
    start = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - start < seconds
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("glmc: error: ") and err.count("\n") == 1, err
    assert expect in err, err


def test_merge_of_one_checkpoint_is_refused_at_once(tmp_path, capsys):
    out = tmp_path / "merged.safetensors"
    _refused(["merge", str(_checkpoint(tmp_path / "a.safetensors")), "--out", str(out)], capsys,
             "at least 2 checkpoints")
    assert not out.exists()


def test_simplex_grid_of_one_model_is_an_error_not_a_hang():
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="at least 2 models"):
        grid_steps(1, 66)
    assert time.perf_counter() - start < 1.0
    assert grid_steps(2, 3) == 2 and grid_steps(2, 11) == 10  # 1/10 gives 11 weights on a segment


def test_explicit_data_that_does_not_exist_is_refused(tmp_path, capsys):
    out, missing = tmp_path / "m.safetensors", tmp_path / "no-such-copy"
    _refused(["train", "--model", "vit-tiny", "--dataset", "fashion-mnist", "--data", str(missing), "--out", str(out),
              "--max-steps", "1"], capsys, str(missing))
    assert not out.exists()


def test_explicit_fashion_mnist_path_is_never_replaced_by_another_copy(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataNotFoundError, match=r"not found in .*empty"):
        load_fashion_mnist(tmp_path / "empty")


@pytest.mark.parametrize(("flag", "bad", "expect"), [
    ("--json", "file/report.json", "is a file, not a directory"),
    ("--json", "folder", "is a directory"),
    ("--plot", "curves.pnx", "unknown image format 'pnx'"),
    ("--plot", "curves", "unknown image format '(none)'"),
])
def test_barrier_outputs_are_checked_before_the_checkpoints_are_read(flag, bad, expect, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "folder").mkdir()
    outputs = {"--json": str(tmp_path / "ok.json"), flag: str(tmp_path / bad)}
    # The checkpoints do not exist: the output error comes first, before anything is loaded.
    _refused(["barrier", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"),
              *[x for item in outputs.items() for x in item]], capsys, expect)
    assert not (tmp_path / "ok.json").exists()


@pytest.mark.parametrize("command", ["merge", "align"])
def test_merge_and_align_outputs_are_checked_before_any_work(command, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    inputs = [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]
    _refused([command, *inputs, "--out", str(tmp_path / "file" / "m.safetensors")], capsys, "--out")
    if command == "merge":
        _refused([command, *inputs, "--out", str(tmp_path / "m.safetensors"), "--json",
                  str(tmp_path / "file" / "r.json")], capsys, "--json")


@pytest.mark.parametrize("flag", ["--out", "--json"])
def test_a_folder_that_cannot_be_created_is_refused_before_any_work(flag, tmp_path, capsys):
    """/proc takes no new folder, even from root, whose permission bits say yes to everything."""
    out = {"--out": "/proc/glmc-nope/m.safetensors", "--json": "/proc/glmc-nope/r.json"}[flag]
    others = ["--out", str(tmp_path / "m.safetensors")] if flag == "--json" else []
    _refused(["merge", "a.safetensors", "b.safetensors", *others, flag, out], capsys, f"{flag} {out} cannot be created")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_read_only_directory_is_refused(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        _refused(["merge", "a.safetensors", "b.safetensors", "--out", str(locked / "m.safetensors")], capsys,
                 "cannot be created")
    finally:
        locked.chmod(0o700)


def test_plot_formats_are_matplotlibs_own():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    assert set(PLOT_FORMATS) == set(FigureCanvasAgg.get_supported_filetypes())


@pytest.mark.parametrize("lr", ["0", "-0.001", "nan", "inf"])
@pytest.mark.parametrize("command", ["barrier", "align", "merge", "train"])
def test_learning_rate_must_be_positive(command, lr, tmp_path, capsys):
    pair = [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]
    argv = {"barrier": ["barrier", *pair, "--method", "learned", "--json", str(tmp_path / "r.json")],
            "align": ["align", *pair, "--method", "learned", "--out", str(tmp_path / "o.safetensors")],
            "merge": ["merge", *pair, "--method", "learned", "--out", str(tmp_path / "o.safetensors")],
            "train": ["train", "--model", "vit-tiny", "--dataset", "fashion-mnist", "--out",
                      str(tmp_path / "o.safetensors")]}[command]
    _refused([*argv, f"--lr={lr}"], capsys, "--lr")


def test_version_names_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert capsys.readouterr().out.strip() == f"glmc {project['version']}" == f"glmc {glmc.__version__}"


@pytest.mark.slow
def test_the_wheel_ships_py_typed_and_every_config(tmp_path):
    """Build the wheel from a copy of the sources (seconds, offline, no build isolation) and read its file list."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "results", "*.safetensors")
    for package in ("glmc", "server", "client", "simulations", "deploy"):
        shutil.copytree(ROOT / package, src / package, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("glmc_fl-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    wanted = {"glmc/py.typed"} | {p.relative_to(ROOT).as_posix() for p in (ROOT / "simulations").rglob("*.toml")
                                  if "results" not in p.parts}
    assert len(wanted) > 10 and wanted <= shipped, sorted(wanted - shipped)


def test_every_option_states_its_default_in_help():
    """--help gives every option's default: argparse's value, or the help's own words where the default is a rule."""
    import argparse

    from glmc.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    silent = []
    for name, parser in sub.choices.items():
        one_of = {a for g in parser._mutually_exclusive_groups if g.required for a in g._group_actions}
        for action in parser._actions:
            if action.required or action in one_of or not action.option_strings or isinstance(
                    action, argparse._HelpAction | argparse._StoreTrueAction | argparse._VersionAction):
                continue
            text = (parser._get_formatter()._get_help_string(action) or "") if action.help else ""  # no help: no line
            if "default" not in text or ("%(default)s" in text and action.default is None):
                silent.append(f"{name} {action.option_strings[0]}")
    assert not silent, silent
    merge_help = sub.choices["merge"].format_help()
    assert "(default: weight)" in merge_help and "(default: 5)" in merge_help  # --method, --iters


@pytest.mark.parametrize(("model", "shown", "hidden"), [("llama-tiny", "rotary_pct", "patch"),
                                                        ("vit-tiny", "patch", "vocab_size")])
def test_check_shows_only_the_fields_its_models_family_reads(model, shown, hidden, capsys):
    """A Llama has no image size, patch or class count, and a ViT no vocabulary: check prints neither."""
    assert main(["check", "--model", model]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert shown in config and hidden not in config and config["family"] == preset(model).family
