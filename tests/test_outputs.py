"""No glmc command writes over its inputs, over another of its own outputs, or, without --force, over a file glmc
did not write for that purpose: each is refused in one line before any work, the input byte for byte unchanged."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from glmc.archs import build_model
from glmc.cli import main
from glmc.cli.outputs import REPORT_MARK
from glmc.core.config import preset
from glmc.data.fashion_mnist import find_fashion_mnist
from glmc.io.checkpoint import CheckpointMeta, save_checkpoint

VIT = preset("vit-tiny").replace(num_classes=10, in_chans=1, img_size=28, depth=1)
needs_data = pytest.mark.skipif(find_fashion_mnist() is None, reason="Fashion-MNIST not installed (make setup)")


@pytest.fixture
def pair(tmp_path: Path) -> list[Path]:
    """Two untrained checkpoints: real inputs that every command could read, and would write over."""
    paths = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        meta = CheckpointMeta(preset="vit-tiny", config=VIT, seed=seed, dataset="fashion-mnist")
        paths.append(save_checkpoint(tmp_path / f"m{seed}.safetensors", build_model(VIT), meta))
    return paths


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], expect: str) -> None:
    """``glmc ARGV`` exits 2 within seconds, with one stderr line containing ``expect`` and nothing on stdout."""
    start = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - start < 10
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("glmc: error: ") and err.count("\n") == 1, err
    assert expect in err, err


def _unchanged(paths: list[Path], before: list[bytes]) -> None:
    assert [p.read_bytes() for p in paths] == before


@pytest.mark.parametrize("command", [
    ["merge", "{0}", "{1}", "--out", "{tmp}/merged.safetensors", "--json", "{1}"],
    ["merge", "{0}", "{1}", "--out", "{0}", "--force"],
    ["barrier", "{0}", "{1}", "--json", "{0}", "--force"],
    ["barrier", "--simplex", "{0}", "{1}", "{tmp}/m2.safetensors", "--json", "{0}"],
    ["align", "{0}", "{1}", "--out", "{1}", "--force"],
    ["export", "{0}", "--glmc", "{0}", "--force"],
    ["export", "{0}", "--hf", "{tmp}", "--force"],  # a model folder is replaced whole: here, the inputs' folder
])
def test_an_output_naming_an_input_is_refused_even_with_force(command, pair, tmp_path, capsys):
    argv = [arg.format(*pair, tmp=tmp_path) for arg in command]
    before = [p.read_bytes() for p in pair]
    _refused(argv, capsys, "glmc never writes over its inputs")
    _unchanged(pair, before)


def test_train_never_writes_into_its_data(tmp_path, capsys):
    data = tmp_path / "copy"
    data.mkdir()
    kept = data / "t.safetensors"
    kept.write_bytes(b"part of the data")
    _refused(["train", "--model", "vit-tiny", "--dataset", "fashion-mnist", "--data", str(data), "--out", str(kept),
              "--force"], capsys, f"would write over --data {data}")
    assert kept.read_bytes() == b"part of the data"


def test_a_timm_inputs_kwargs_are_an_input_too(pair, tmp_path, capsys):
    kwargs = pair[0].with_suffix(".json")
    kwargs.write_text('{"model_name": "vit_tiny_patch16_224"}')
    _refused(["merge", *map(str, pair), "--out", str(tmp_path / "out.safetensors"), "--json", str(kwargs),
              "--force"], capsys, "input's timm kwargs")
    assert kwargs.read_text() == '{"model_name": "vit_tiny_patch16_224"}'


@pytest.mark.parametrize(("extra", "expect"), [
    (["--out", "{tmp}/x.safetensors", "--json", "{tmp}/x.safetensors"], "overlap"),
    (["--format", "timm", "--out", "{tmp}/x.safetensors", "--json", "{tmp}/x.json"], "timm kwargs"),
    (["--out", "{tmp}/folder", "--json", "{tmp}/folder/report.json"], "overlap"),
])
def test_two_outputs_of_one_command_may_not_meet(extra, expect, pair, tmp_path, capsys):
    _refused(["merge", *map(str, pair), *[a.format(tmp=tmp_path) for a in extra]], capsys, expect)
    assert sorted(tmp_path.iterdir()) == pair


def test_a_file_glmc_did_not_write_needs_force(pair, tmp_path, capsys):
    notes = tmp_path / "notes.json"
    notes.write_text("my notes")
    _refused(["barrier", *map(str, pair), "--json", str(notes)], capsys, "is not a report glmc wrote; pass --force")
    picture = tmp_path / "holiday.png"
    picture.write_bytes(b"\x89PNG from a camera")
    _refused(["barrier", *map(str, pair), "--plot", str(picture)], capsys, "is not a plot glmc wrote")
    assert notes.read_text() == "my notes" and picture.read_bytes() == b"\x89PNG from a camera"


@needs_data
def test_barrier_prints_its_result_and_writes_over_its_own_report_and_plot(pair, tmp_path, capsys):
    common = ["barrier", *map(str, pair), "--limit", "16", "--points", "3"]
    assert main(common) == 0  # no --json: the barriers are printed
    assert set(json.loads(capsys.readouterr().out.strip().splitlines()[-1])) == {"weight"}
    report, plot = tmp_path / "r.json", tmp_path / "r.png"
    for _ in range(2):  # the second run replaces what the first wrote, without --force
        assert main([*common, "--json", str(report), "--plot", str(plot)]) == 0
    assert json.loads(report.read_text())[REPORT_MARK] == "glmc barrier" and plot.stat().st_size > 0
