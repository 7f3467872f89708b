"""docs/interop.md's recipes and the API's docstring examples run as written."""

from __future__ import annotations

import doctest
import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

import glmc.api
from glmc.cli import main
from tests.interop_models import GPT2_BASE, HF, TIMM, gpt2, logits, vit, vit_kwargs

DOCS = Path(__file__).resolve().parent.parent / "docs" / "interop.md"


def _blocks(section: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block in the section of docs/interop.md under ``section``."""
    text = DOCS.read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", text, flags=re.S)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """Two GPT-2s and two timm ViTs, saved by their own libraries under the names the recipes use."""
    monkeypatch.chdir(tmp_path)
    for name, seed in (("a", 0), ("b", 1)):
        HF.save(gpt2(tied=True, seed=seed), tmp_path / f"gpt2-{name}", {})
        TIMM.save(vit("vit-no-cls-avg", seed=seed), tmp_path / f"vit-{name}.safetensors", vit_kwargs("vit-no-cls-avg"))
    return tmp_path


def _run(language: str, code: str) -> None:
    if language == "python":
        exec(compile(code, str(DOCS), "exec"), {})
        return
    for line in code.strip().splitlines():
        argv = shlex.split(line)
        assert argv[0] == "glmc" and main(argv[1:]) == 0, line


def test_the_recipes_run_as_written_in_five_lines_at_most(workdir):
    blocks = _blocks("Recipes")
    assert [lang for lang, _ in blocks] == ["sh", "python", "sh", "python"]
    for language, code in blocks:
        assert len(code.strip().splitlines()) <= 5
        _run(language, code)
    x = HF.inputs(gpt2(tied=True))
    merged = [HF.load(workdir / name) for name in ("gpt2-merged", "gpt2-merged-py")]
    assert (logits(merged[0], x) - logits(merged[1], x)).abs().max() <= 1e-4  # the CLI and the API agree
    vits = [TIMM.load(workdir / name) for name in ("vit-merged.safetensors", "vit-a.safetensors")]
    assert vits[0].global_pool == "avg" and vits[0].cls_token is None


def test_barrier_on_a_data_file(workdir):
    ids = torch.randint(0, GPT2_BASE["vocab_size"], (12, GPT2_BASE["n_positions"] + 1),
                        generator=torch.Generator().manual_seed(0))
    np.save(workdir / "heldout.npy", ids.numpy())
    commands = [code for lang, code in _blocks("Your own data") if lang == "sh"]
    assert len(commands) == 2  # on the held-out file; then learned on the models' own text
    for command in commands:
        _run("sh", command)
        curve = json.loads((workdir / "curve.json").read_text())
        assert len(curve["lambdas"]) == 21 and curve["barrier"] == max(curve["barriers"])
    assert curve["method"] == "learned" and curve["align_info"]["generate_seconds"] > 0


def test_the_api_docstring_examples_run():
    result = doctest.testmod(glmc.api, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 4 * 3 and result.failed == 0
