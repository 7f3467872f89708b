"""Shakespeare as byte-level BPE tokens, the official GLMC code's GPT-2 benchmark: a tokenizer trained here,
offline and deterministically, and a contiguous 90/5/5 train/validation/test split cut into fixed blocks.

The plays (``glmc.data.shakespeare.read_plays``, sorted by name) are joined by blank lines into one text, which is
cut by characters into its first 90%, next 5% and last 5%. The tokenizer learns its merges from the training text
alone (so the held-out text never shapes it) with the ``tokenizers`` library, byte-level as GPT-2's is, to a
vocabulary of about 12k. Training takes about 15 CPU seconds and gives the same tokenizer byte for byte every time;
it is cached beside the plays under a digest of the text and the settings. Every part is then encoded on its own
and cut into non-overlapping blocks of ``context`` tokens, each with its next-token targets. The tokenizer travels
in every checkpoint's metadata (:meth:`BpeVocab.to_json`), so a model's tokens can always be read back.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from glmc.data.paths import data_root
from glmc.data.shakespeare import TextWindows, read_plays
from glmc.errors import ConfigError

log = logging.getLogger(__name__)

VOCAB_SIZE = 12_000  # the official code's vocabulary, about 12k
MIN_FREQUENCY = 2  # a merge must occur at least twice in the training text
SPLIT = (0.90, 0.05, 0.05)  # train, validation, test: contiguous, in this order


class BpeVocab:
    """A byte-level BPE tokenizer (``tokenizers.Tokenizer``) with the encode/decode/JSON surface of CharVocab."""

    def __init__(self, tokenizer_json: str) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.json = self.tokenizer.to_str()  # the library's own serialisation, so equal tokenizers compare equal

    @classmethod
    def train(cls, texts: list[str], vocab_size: int = VOCAB_SIZE) -> BpeVocab:
        """Learn the merges of ``texts``: deterministic (the same texts give the same tokenizer, byte for byte)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=MIN_FREQUENCY, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
        tokenizer.train_from_iterator(texts, trainer=trainer)
        return cls(tokenizer.to_str())

    @property
    def size(self) -> int:
        """Number of tokens, i.e. the model's ``vocab_size``."""
        return int(self.tokenizer.get_vocab_size())

    def encode(self, text: str) -> np.ndarray:
        """``text`` → int64 token ids; every byte has a token, so nothing is unknown."""
        return np.asarray(self.tokenizer.encode(text).ids, dtype=np.int64)

    def decode(self, ids: np.ndarray | torch.Tensor | list[int]) -> str:
        """Token ids → text."""
        return str(self.tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)]))

    def to_json(self) -> str:
        """A JSON string to store in checkpoint metadata: the whole tokenizer."""
        return json.dumps({"kind": "bpe", "tokenizer": json.loads(self.json)})

    @classmethod
    def from_json(cls, text: str) -> BpeVocab:
        """Inverse of ``to_json``."""
        data = json.loads(text)
        if data.get("kind") != "bpe" or not isinstance(data.get("tokenizer"), dict):
            raise ConfigError("not a BpeVocab JSON (expected kind 'bpe' and a 'tokenizer' object)")
        return cls(json.dumps(data["tokenizer"]))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BpeVocab) and other.json == self.json

    def __repr__(self) -> str:
        return f"BpeVocab(size={self.size})"


@dataclass(frozen=True)
class BpeCorpus:
    """The tokenizer and the three splits' blocks."""

    vocab: BpeVocab
    train: TextWindows
    val: TextWindows
    test: TextWindows
    context: int


def split_text(text: str, fractions: tuple[float, float, float] = SPLIT) -> tuple[str, str, str]:
    """``text`` cut by characters into contiguous parts of the given fractions, in order."""
    first = round(len(text) * fractions[0])
    second = first + round(len(text) * fractions[1])
    return text[:first], text[first:second], text[second:]


def cached_vocab(train: str, vocab_size: int, directory: Path) -> BpeVocab:
    """The tokenizer of ``train`` from ``directory``'s cache, trained and stored there first if absent."""
    import tokenizers

    key = hashlib.sha256(f"{tokenizers.__version__}|{vocab_size}|{MIN_FREQUENCY}|{train}".encode()).hexdigest()
    path = directory / f".bpe-{vocab_size}-{key[:16]}.json"
    if path.is_file():
        return BpeVocab(path.read_text())
    vocab = BpeVocab.train([train], vocab_size)
    partial = path.with_suffix(".partial")
    partial.write_text(vocab.json)
    partial.replace(path)  # never a half-written cache
    return vocab


def load_shakespeare_bpe(path: str | Path | None = None, context: int = 256,
                         vocab_size: int = VOCAB_SIZE) -> BpeCorpus:
    """The plays as BPE blocks of ``context`` tokens, split 90/5/5 (module docstring); fixed, whatever the seed.
    A corpus with fewer merges than ``vocab_size`` allows (a test's) gets a smaller vocabulary: merges stop at
    pairs seen only once."""
    directory = Path(path) if path is not None else data_root() / "shakespeare"
    texts = read_plays(directory)
    train, val, test = split_text("\n\n".join(texts[name] for name in sorted(texts)))
    vocab = cached_vocab(train, vocab_size, directory)
    blocks = [TextWindows([vocab.encode(part)], context) for part in (train, val, test)]
    if not all(len(b) for b in blocks):
        raise ConfigError(f"the corpus is too short for blocks of {context} tokens in each of its three splits")
    log.info("Shakespeare BPE: vocab %d; %d train / %d validation / %d test blocks of %d tokens", vocab.size,
             *map(len, blocks), context)
    train_blocks, val_blocks, test_blocks = blocks
    return BpeCorpus(vocab, train_blocks, val_blocks, test_blocks, context)
