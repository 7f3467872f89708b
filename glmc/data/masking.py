"""Masked language modelling (BERT's objective) over text windows: which positions a model must fill in.

Of every window, 15% of the positions are selected (at least one); of those, 80% become the mask token, 10% a random
token of the vocabulary and 10% stay as they are; the targets are the original tokens at the selected positions and
:data:`IGNORE` elsewhere, so the loss is taken on the selected positions only. The mask token is the model
vocabulary's last id, one past the corpus' own (:func:`mask_id`). Training draws fresh masks at every access;
evaluation (``fixed``) draws window i's masks from a generator seeded by (seed, i), so every evaluation of a split
(each point of a barrier, each endpoint) sees the same masks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset

if TYPE_CHECKING:
    from glmc.core.config import ModelConfig

IGNORE = -100  # a target cross-entropy skips (torch's ignore_index)
SELECT, MASKED, RANDOM = 0.15, 0.8, 0.1  # selected share; of it, masked and random shares (the rest unchanged)


def mask_id(vocab_size: int) -> int:
    """The mask token of a masked model of ``vocab_size`` ids: its last (the corpus has the ids before it)."""
    return vocab_size - 1


def mask_tokens(x: torch.Tensor, vocab_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of token ids ``x`` (any shape, last axis the sequence) for a model of ``vocab_size`` ids
    whose last is the mask token: 80/10/10 of a 15% selection, at least one position per sequence."""
    draw = torch.rand(x.shape, generator=generator)
    selected = draw < SELECT
    none = ~selected.any(-1, keepdim=True)  # a sequence with nothing selected gets its lowest draw
    selected |= none & (draw == draw.min(-1, keepdim=True).values)
    kind = torch.rand(x.shape, generator=generator)
    random = torch.randint(0, mask_id(vocab_size), x.shape, generator=generator)
    inputs = torch.where(selected & (kind < MASKED), mask_id(vocab_size), x)
    inputs = torch.where(selected & (kind >= MASKED) & (kind < MASKED + RANDOM), random, inputs)
    return inputs, torch.where(selected, x, IGNORE)


class MaskedWindows(Dataset):
    """The inputs of a dataset of (tokens, next tokens) windows, masked: item i is (masked tokens, targets)."""

    def __init__(self, windows: Dataset, vocab_size: int, seed: int = 0, fixed: bool = False) -> None:
        self.windows, self.vocab_size, self.seed, self.fixed = windows, vocab_size, seed, fixed
        self.generator = torch.Generator().manual_seed(seed)  # training's: advanced at every access

    def __len__(self) -> int:
        return len(self.windows)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.windows[i][0]
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + i) if self.fixed else self.generator
        return mask_tokens(x, self.vocab_size, generator)



def for_objective(data: Dataset, cfg: ModelConfig) -> Dataset:
    """(tokens, next tokens) windows as a model of ``cfg`` learns from them: as they are for a causal model; for a
    masked one, their inputs masked with fixed masks, the mask token the vocabulary's last id (user data, a data
    file: the same masks at every pass)."""
    from glmc.archs import get_arch

    if get_arch(cfg.family).objective == "causal":
        return data
    return MaskedWindows(data, cfg.vocab_size, fixed=True)
