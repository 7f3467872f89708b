"""Text the models write themselves (glmc.data.generated): it is what each model predicts, sampled from the whole
distribution, in equal shares and reproducibly; ``--generated`` lets the data-driven methods run on it with no
training data at all, on Hugging Face GPT-2s that glmc did not make."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import glmc
from glmc.archs import build_model
from glmc.cli import main
from glmc.core.config import preset
from glmc.data.generated import generated_text, shares, writing_seconds
from glmc.errors import ConfigError
from glmc.match.options import LearnConfig, MatchOptions
from tests.conftest import synthetic_text
from tests.interop_models import HF, gpt2, logits, vit

CYCLE = preset("gpt2-tiny").replace(vocab_size=7, context=12)


def _native(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _constant(cfg, token: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A GPT-2 that puts nearly all its mass on ``token`` whatever it reads: the final LayerNorm writes only its
    bias, which the head maps to a large logit for ``token``."""
    torch.manual_seed(seed)
    native = _native(build_model(cfg))
    native["transformer.ln_f.weight"].zero_()
    native["transformer.ln_f.bias"].copy_(torch.eye(cfg.width)[0])
    native["lm_head.weight"].zero_()
    native["lm_head.weight"][token, 0] = 50.0
    return native


def _cycle_model(steps: int = 150) -> dict[str, torch.Tensor]:
    """A tiny GPT-2 trained on windows of the cycle 0, 1, …, 6: its next token is the last one plus 1."""
    torch.manual_seed(0)
    model = build_model(CYCLE).train()
    x, y = synthetic_text(256, CYCLE.context, CYCLE.vocab_size).tensors
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return _native(model.eval())


def _follows_cycle(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((y == (x + 1) % CYCLE.vocab_size).float().mean())


def test_a_trained_model_writes_what_it_learned_and_an_untrained_one_does_not():
    written = generated_text([_cycle_model()], [CYCLE], 64)
    x, y = written.tensors
    assert writing_seconds(written) == written.seconds > 0 and writing_seconds(TensorDataset(x, y)) == 0  # its cost
    assert x.shape == y.shape == (64, CYCLE.context) and torch.equal(x[:, 1:], y[:, :-1])  # windows, shifted
    assert _follows_cycle(x, y) > 0.95
    torch.manual_seed(1)
    assert _follows_cycle(*generated_text([_native(build_model(CYCLE))], [CYCLE], 64).tensors) < 0.5


def test_sampling_reaches_the_whole_vocabulary():
    """Plain sampling: a uniform model writes every one of 120 tokens (transformers' default top-k keeps 50)."""
    cfg = CYCLE.replace(vocab_size=120)
    native = _native(build_model(cfg))
    native["lm_head.weight"].zero_()
    _, y = generated_text([native], [cfg], 200).tensors
    assert set(y.unique().tolist()) == set(range(120))


def test_models_write_equal_shares_in_order_reproducibly_and_leave_the_callers_random_state():
    writers = [_constant(CYCLE, 3), _constant(CYCLE, 5, seed=1)]
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    x, y = generated_text(writers, [CYCLE] * 2, 7, seed=4).tensors
    assert torch.equal(torch.rand(3), before)
    assert (y[:4] == 3).all() and (y[4:] == 5).all() and (x[:, 1:] == y[:, :-1]).all()
    assert torch.equal(generated_text(writers, [CYCLE] * 2, 7, seed=4).tensors[0], x)
    assert not torch.equal(generated_text(writers, [CYCLE] * 2, 7, seed=5).tensors[0][:, 0], x[:, 0])
    assert shares(7, 3) == [3, 2, 2]


def test_what_cannot_write_text_is_refused():
    vit = preset("vit-tiny").replace(img_size=8, patch=4, in_chans=1, num_classes=3)
    with pytest.raises(ConfigError, match="cannot write its own inputs"):
        generated_text([_native(build_model(vit))], [vit], 4)
    with pytest.raises(ConfigError, match="one context and vocabulary"):
        generated_text([_constant(CYCLE, 1)] * 2, [CYCLE, CYCLE.replace(vocab_size=8)], 4)
    with pytest.raises(ConfigError, match="at least one window per model"):
        shares(1, 2)


@pytest.fixture
def hf_pair(tmp_path):
    """Two GPT-2s that transformers built and saved (no glmc dataset, so no training split), and held-out ids."""
    paths = []
    for seed in (0, 1):
        paths.append(tmp_path / f"hf{seed}")
        HF.save(gpt2(tied=False, seed=seed), paths[-1], {})
    test = tmp_path / "test.npy"
    np.save(test, np.random.default_rng(0).integers(0, 19, (16, 10)))
    return paths, test


def test_barrier_learns_on_generated_text_without_any_training_data(hf_pair, tmp_path, capsys, caplog):
    (a, b), test = hf_pair
    report = tmp_path / "r.json"
    common = ["barrier", str(a), str(b), "--method", "learned", "--data-file", str(test), "--points", "3",
              "--steps", "4", "--batch-size", "8", "--json", str(report), "--quiet"]
    assert main(common) == 0 and "fits on --data-file" in caplog.text  # without it: the held-out data
    caplog.clear()
    caplog.set_level(logging.INFO, logger="glmc.data.generated")
    assert main([*common, "--generated", "--batch", "40"]) == 0 and "fits on --data-file" not in caplog.text
    (curve,) = json.loads(report.read_text())["curves"]
    assert curve["align_info"]["stopped"] == "completed 4 steps"
    assert 0 < curve["align_info"]["generate_seconds"] < curve["align_seconds"]  # sampling counts as alignment
    assert "generated 40 windows of 11 tokens" in caplog.text
    assert main([*common, "--generated", "--train-file", str(test)]) == 2
    assert "pass one of them" in capsys.readouterr().err


def test_text_the_models_wrote_is_learned_against_their_mixed_prediction_unless_told(hf_pair, tmp_path):
    """Its next tokens are the models' samples, not labels: --generated scores the path against the endpoints
    (the same run as --targets endpoints, another than --targets labels), any other data against its labels."""
    (a, b), test = hf_pair
    common = ["barrier", str(a), str(b), "--method", "learned", "--data-file", str(test), "--points", "3",
              "--steps", "3", "--batch-size", "8", "--quiet"]
    curves = {}
    for name, extra in {"default": ["--generated"], "endpoints": ["--generated", "--targets", "endpoints"],
                        "labels": ["--generated", "--targets", "labels"], "data": ["--train-file", str(test)]}.items():
        report = tmp_path / f"{name}.json"
        assert main([*common, *extra, "--batch", "40", "--json", str(report)]) == 0
        (curves[name],) = json.loads(report.read_text())["curves"]
    assert {k: c["align_info"]["targets"] for k, c in curves.items()} == {
        "default": "endpoints", "endpoints": "endpoints", "labels": "labels", "data": "labels"}
    assert curves["default"]["losses"] == curves["endpoints"]["losses"] != curves["labels"]["losses"]


def test_merge_learns_on_text_all_its_inputs_write(hf_pair, tmp_path, capsys):
    (a, b), test = hf_pair
    out, report = tmp_path / "m.safetensors", tmp_path / "m.json"
    assert main(["merge", str(a), str(b), str(a), "--method", "learned", "--generated", "--batch", "30",
                 "--steps", "2", "--batch-size", "8", "--data-file", str(test), "--out", str(out),
                 "--json", str(report), "--quiet"]) == 0
    assert out.exists() and json.loads(capsys.readouterr().out.strip().splitlines()[-1])["method"] == "learned"
    assert json.loads(report.read_text())["generate_seconds"] > 0


def test_the_api_aligns_live_gpt2s_on_the_text_they_write():
    """glmc.align(..., data="generated"): a learned alignment that reads no data and keeps B's function."""
    a, b = gpt2(tied=False, seed=0), gpt2(tied=False, seed=1)
    options = MatchOptions(learn=LearnConfig(steps=3, batch_size=16))
    moved = glmc.align(a, b, "learned", data="generated", options=options)
    x = HF.inputs(b)
    assert (logits(moved, x) - logits(b, x)).abs().max() < 1e-4
    with pytest.raises(ConfigError, match="cannot write its own inputs"):
        glmc.align(vit("vit-plain"), vit("vit-plain", seed=1), "learned", data="generated")
