"""Checkpoint round-trip and every way a checkpoint can be bad."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import glmc.io.checkpoint as ckpt
from glmc.archs import build_model, get_arch
from glmc.core.config import ModelConfig
from glmc.errors import CheckpointError
from glmc.io.checkpoint import CheckpointMeta, load_checkpoint, load_model, save_checkpoint


def _meta(cfg: ModelConfig, **changes: object) -> CheckpointMeta:
    fields = {
        "preset": f"{cfg.family}-tiny",
        "config": cfg,
        "width_mult": 1.0,
        "seed": 3,
        "dataset": "synthetic",
        "split": "all rows",
        "metrics": {"test_loss": 0.5, "test_accuracy": 0.75},
        "train": {"lr": 0.001, "epochs": 1},
        "vocab": '{"kind": "char", "chars": "abc"}' if cfg.family == "gpt2" else None,
    }
    return CheckpointMeta(**(fields | changes))  # type: ignore[arg-type]


def _inputs(cfg: ModelConfig) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if cfg.family == "vit":
        return torch.randn(4, cfg.in_chans, cfg.img_size, cfg.img_size, generator=g)
    return torch.randint(0, cfg.vocab_size, (2, cfg.context), generator=g)


@pytest.fixture(params=["vit", "gpt2"])
def saved(request, tmp_path, tiny_vit, tiny_gpt2) -> tuple[Path, torch.nn.Module, CheckpointMeta]:
    """A checkpoint of a freshly built tiny model of each family, and the model and metadata written."""
    cfg = tiny_vit if request.param == "vit" else tiny_gpt2
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    meta = _meta(cfg)
    path = save_checkpoint(tmp_path / "model.safetensors", model, meta)
    return path, model, meta


def test_round_trip_keeps_tensors_and_metadata(saved):
    path, model, meta = saved
    state, loaded_meta = load_checkpoint(path)
    assert loaded_meta == meta
    assert state.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key


def test_loaded_model_computes_identical_logits(saved):
    path, model, meta = saved
    loaded, _ = load_model(path, expect=meta.config)
    arch = get_arch(meta.config.family)
    x = _inputs(meta.config)
    with torch.no_grad():
        assert torch.equal(arch.logits(loaded, x), arch.logits(model, x))


def test_metadata_is_one_json_string_in_the_header(saved):
    path, _, meta = saved
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    blob = json.loads(header["__metadata__"]["glmc"])
    assert list(header["__metadata__"]) == ["glmc"]
    assert blob["preset"] == meta.preset and blob["config"] == meta.config.to_dict()


def test_mismatched_config_is_refused(saved):
    path, _, meta = saved
    with pytest.raises(CheckpointError, match="width"):
        load_model(path, expect=meta.config.replace(width=64, heads=2))


def test_tensors_that_do_not_fit_the_config_are_refused(tmp_path, tiny_vit):
    path = save_checkpoint(tmp_path / "x.safetensors", build_model(tiny_vit), _meta(tiny_vit.replace(depth=3)))
    with pytest.raises(CheckpointError, match="do not fit"):
        load_model(path)


def _one_line_error(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_non_safetensors_file(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"this is not a safetensors file at all, just some bytes")
    assert "not a readable safetensors" in _one_line_error(path)


def test_truncated_file(saved):
    path, _, _ = saved
    path.write_bytes(path.read_bytes()[:-100])
    assert "not a readable safetensors" in _one_line_error(path)


def test_flipped_byte_is_caught_by_checksum(saved):
    path, _, _ = saved
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    assert "checksum" in _one_line_error(path)


def test_missing_glmc_metadata(tmp_path):
    path = tmp_path / "foreign.safetensors"
    save_file({"w": torch.zeros(2)}, str(path), metadata={"format": "pt"})
    assert "no 'glmc' metadata" in _one_line_error(path)


def test_unreadable_metadata(tmp_path):
    path = tmp_path / "foreign.safetensors"
    save_file({"w": torch.zeros(2)}, str(path), metadata={"glmc": "{not json"})
    assert "unreadable" in _one_line_error(path)


def test_missing_file(tmp_path):
    assert "no checkpoint file" in _one_line_error(tmp_path / "absent.safetensors")


def test_unknown_metadata_field_is_refused(tiny_vit):
    with pytest.raises(CheckpointError, match="unknown checkpoint metadata"):
        CheckpointMeta.from_dict(_meta(tiny_vit).to_dict() | {"colour": "blue"})


def test_no_overwrite_leaves_the_file_untouched(saved, tiny_vit):
    path, _, _ = saved
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match="already exists"):
        save_checkpoint(path, build_model(tiny_vit), _meta(tiny_vit), overwrite=False)
    assert path.read_bytes() == before


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(saved, monkeypatch, tiny_vit):
    path, _, _ = saved
    before = path.read_bytes()

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        save_checkpoint(path, build_model(tiny_vit), _meta(tiny_vit))
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_checkpoint_gets_the_usual_permissions(tmp_path, tiny_vit):
    old = os.umask(0o022)
    try:
        path = save_checkpoint(tmp_path / "m.safetensors", build_model(tiny_vit), _meta(tiny_vit))
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644
