"""The official GLMC benchmark's pieces: a deterministic byte-level BPE tokenizer, the contiguous 90/5/5
``shakespeare-bpe`` split into blocks, the tokenizer saved with every checkpoint, and the paper recipe's early
stopping and dropout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from glmc.archs import build_model, get_arch
from glmc.cli import main as glmc
from glmc.core.config import preset
from glmc.data import bpe
from glmc.data.bpe import BpeVocab, load_shakespeare_bpe, split_text
from glmc.data.shakespeare import read_plays
from glmc.data.tasks import PAPER_RECIPE, load_task
from glmc.io.checkpoint import load_checkpoint
from glmc.train import TrainConfig, evaluate, train
from tests.conftest import synthetic_text

WORDS = ["thou", "art", "the", "king", "of", "rome", "and", "i", "am", "thy", "loving", "servant", "my", "lord",
         "what", "say", "you", "to", "this", "fair", "lady"]


@pytest.fixture(scope="module")
def plays(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three plays of random lines from a small word list, with speaker tags: about 40k characters."""
    rng = np.random.default_rng(0)
    directory = tmp_path_factory.mktemp("shakespeare")
    for title in ("alpha", "beta", "gamma"):
        lines = [f"{rng.choice(['KING.', 'Ham.', 'NURSE.'])}\n" + " ".join(rng.choice(WORDS, 12)) + ".\n"
                 for _ in range(180)]
        (directory / f"{title}_gut.txt").write_text(title.upper() + "\n\n" + "\n".join(lines))
    return directory


def test_the_tokenizer_is_deterministic_and_round_trips_any_text(plays: Path) -> None:
    text = (plays / "alpha_gut.txt").read_text()
    first, second = BpeVocab.train([text], vocab_size=400), BpeVocab.train([text], vocab_size=400)
    assert first.json == second.json  # trained twice, the same tokenizer byte for byte
    assert 256 < first.size <= 400  # every byte, then merges up to the target
    for sample in (text[:500], "Ünïcödé — never seen ✓", ""):
        assert first.decode(first.encode(sample)) == sample  # byte-level: nothing is unknown
    assert len(first.encode(text)) < len(text) / 2  # merges compress the words it learned
    assert BpeVocab.from_json(first.to_json()) == first
    with pytest.raises(Exception, match="not a BpeVocab JSON"):
        BpeVocab.from_json(json.dumps({"kind": "char", "chars": "ab"}))


def test_the_split_is_contiguous_90_5_5_in_blocks(plays: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = load_shakespeare_bpe(plays, context=16, vocab_size=400)
    texts = read_plays(plays)
    text = "\n\n".join(texts[name] for name in sorted(texts))
    parts = split_text(text)
    assert "".join(parts) == text and [round(len(p) / len(text), 2) for p in parts] == [0.9, 0.05, 0.05]
    for part, blocks in zip(parts, (corpus.train, corpus.val, corpus.test), strict=True):
        x, y = blocks[0]
        assert x.shape == y.shape == (16,) and torch.equal(x[1:], y[:-1])  # next-token targets
        tokens = torch.cat([blocks[i][0] for i in range(len(blocks))])  # the blocks tile the part, in order
        assert part.startswith(corpus.vocab.decode(tokens)) and len(part) - len(corpus.vocab.decode(tokens)) < 200
    # the tokenizer saw the training text only, and the second load reads it from the cache
    assert corpus.vocab == BpeVocab.train([parts[0]], vocab_size=400)
    monkeypatch.setattr(BpeVocab, "train", classmethod(lambda *_: pytest.fail("trained again")))
    assert load_shakespeare_bpe(plays, context=16, vocab_size=400).vocab == corpus.vocab


def test_glmc_train_on_shakespeare_bpe_stops_early_and_saves_the_tokenizer(plays: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.safetensors"
    assert glmc(["train", "--model", "gpt2-tiny", "--dataset", "shakespeare-bpe", "--data", str(plays),
                 "--max-steps", "6", "--eval-every", "2", "--patience", "1", "--threads", "1", "--quiet",
                 "--out", str(out)]) == 0
    _, meta = load_checkpoint(out)
    vocab = BpeVocab.from_json(meta.vocab)
    assert vocab == load_task("shakespeare-bpe", preset("gpt2-tiny"), plays).vocab
    assert meta.config.vocab_size == vocab.size < bpe.VOCAB_SIZE and meta.dataset == "shakespeare-bpe"
    assert meta.train["lr"] == PAPER_RECIPE["lr"] and meta.train["weight_decay"] == PAPER_RECIPE["weight_decay"]
    assert {"val_loss", "best_step"} <= set(meta.metrics) and meta.metrics["best_step"] <= meta.metrics["steps"]


def test_patience_without_a_validation_split_is_refused_before_anything_is_written(tmp_path: Path, capsys) -> None:
    out = tmp_path / "m.safetensors"
    assert glmc(["train", "--model", "vit-tiny", "--dataset", "fashion-mnist", "--patience", "2",
                 "--out", str(out)]) == 2
    assert "--patience needs a validation split" in capsys.readouterr().err and not out.exists()


def test_early_stopping_keeps_the_best_validated_weights(tiny_gpt2) -> None:
    """A learning rate far too high makes validation worse after the first steps: training stops once patience
    runs out, and the model holds the weights of its best validation, not its last step's."""
    arch, data = get_arch("gpt2"), synthetic_text(64)
    validation = synthetic_text(16, seed=1)
    torch.manual_seed(0)
    model = build_model(tiny_gpt2)
    fit = train(model, arch, data, TrainConfig(epochs=50, batch_size=8, lr=3.0, warmup=0.0, patience=2,
                                              eval_every=1, threads=1), progress=False, validation=validation)
    assert fit["steps"] == fit["best_step"] + 2 < 50 * 8  # stopped two validations after its best
    assert evaluate(model, arch, validation)["loss"] == pytest.approx(fit["val_loss"], abs=1e-6)


def test_the_paper_preset_trains_with_dropout(tiny_gpt2) -> None:
    """gpt2-paper carries the official dropout of 0.1: training steps are random, evaluation is not."""
    assert preset("gpt2-paper").dropout == 0.1
    cfg = preset("gpt2-paper").replace(width=32, depth=1, heads=2, mlp=64, vocab_size=7, context=12)
    torch.manual_seed(0)
    model, arch = build_model(cfg), get_arch("gpt2")
    x = synthetic_text(4)[:][0]
    with torch.no_grad():
        model.train()
        assert not torch.equal(arch.logits(model, x), arch.logits(model, x))
        model.eval()
        assert torch.equal(arch.logits(model, x), arch.logits(model, x))
    assert preset("gpt2-bench").dropout == 0.0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fit = train(model, arch, synthetic_text(32), TrainConfig(**PAPER_RECIPE | {"max_steps": 3, "batch_size": 8,
                                                                               "threads": 1}), progress=False)
    assert np.isfinite(fit["train_loss"]) and fit["steps"] == 3
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
