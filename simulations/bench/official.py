"""The official GLMC GPT-2 pair, the repository's benchmark fixture: where it is, and the official figures its README
states (the barriers the official code measured, and each model's test loss), read from that README so that they
are written down once."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PAIR = Path(__file__).resolve().parent.parent / "fixtures" / "official-gpt2-pair01"
ROW = re.compile(r"^\| (?P<method>[^|]+?) \| (?P<barrier>\d+\.\d+) \| (?P<share>[\d.]+)% \|$", re.M)
TEST_LOSS = re.compile(r"Test loss per token: seed 0 (?P<a>\d+\.\d+), seed 1 (?P<b>\d+\.\d+)\.")


@dataclass(frozen=True)
class OfficialFigures:
    """The official code's barriers on the pair (nats per token, test split, 11 λ) by its row's first words, and
    each model's test loss."""

    barriers: dict[str, float]
    test_losses: tuple[float, float]

    def barrier(self, starts: str) -> float:
        """The barrier of the row whose method begins with ``starts`` (``vanilla``, ``official weight``, ...)."""
        (value,) = [v for k, v in self.barriers.items() if k.startswith(starts)]
        return value


def official_figures(readme: Path = PAIR / "README.md") -> OfficialFigures:
    """The figures of the fixture's README."""
    text = readme.read_text()
    losses = TEST_LOSS.search(text)
    if losses is None:
        raise ValueError(f"{readme} states no test losses")
    return OfficialFigures({m["method"]: float(m["barrier"]) for m in ROW.finditer(text)},
                           (float(losses["a"]), float(losses["b"])))
