"""Text the models sample themselves: training data for the data-driven methods that reads no dataset.

Learned matching needs the task loss of the interpolated model on inputs like the ones the models were trained on.
A language model can write such inputs itself: each model samples an equal share of windows (plain sampling at
temperature 1, from a uniformly random first token). Its next tokens are samples of the models, not labels, so
learned matching scores the path on it against the endpoints' own mixed predictions unless told otherwise
(:class:`GeneratedText`). On 6 gpt2-bench pairs (with and without dropout) this left barriers 1.01–1.08× those of
learning on the training split at the same budget, and the sampled next tokens as targets 1.05–1.16×
(simulations/results/learning-budget). A model that cannot generate (a ViT) gets a clear error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import TensorDataset

from glmc.archs import build_model, get_arch
from glmc.core.config import ModelConfig
from glmc.core.state import cast as cast_state
from glmc.errors import ConfigError

log = logging.getLogger(__name__)

GENERATED_SAMPLES = 20000  # windows written when a command is not told how many (learned matching's one pass)
SAMPLE_BATCH = 250  # windows one generate call writes at a time


class GeneratedText(TensorDataset):
    """(inputs, sampled next tokens) that the models wrote: learned matching's targets default to the endpoints'
    mixed predictions on it (glmc.match.options.LearnConfig.targets), which were lower on all 6 measured pairs.
    ``seconds``: the time the writing took, which every front-end counts as part of the method's cost."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, seconds: float = 0.0) -> None:
        super().__init__(inputs, targets)
        self.seconds = seconds


def writing_seconds(data: object) -> float:
    """The seconds the models took to write ``data`` (0 for data they did not write): part of a method's cost."""
    return data.seconds if isinstance(data, GeneratedText) else 0.0


def shares(n: int, models: int) -> list[int]:
    """``n`` windows split over ``models`` writers as evenly as possible, the first ones taking the remainder."""
    if n < models:
        raise ConfigError(f"generated text needs at least one window per model: {n} windows for {models} models")
    return [n // models + (i < n % models) for i in range(models)]


def text_writer(cfg: ModelConfig) -> nn.Module:
    """A new model of ``cfg`` that can sample text; ConfigError if its family cannot (a ViT)."""
    from transformers import GenerationMixin

    if get_arch(cfg.family).objective != "causal":
        raise ConfigError(f"a {cfg.family} model cannot write its own inputs: generated training data needs causal "
                          "language models (gpt2); pass training data instead")
    model = build_model(cfg)
    if not isinstance(model, GenerationMixin):
        raise ConfigError(f"a {cfg.family} model cannot write its own inputs: generated training data needs "
                          "language models (gpt2); pass training data instead")
    return model


def writer(native: Mapping[str, torch.Tensor], cfg: ModelConfig, device: torch.device) -> nn.Module:
    """The model holding ``native``, in float32 on ``device`` and in eval mode, ready to sample."""
    model = text_writer(cfg)
    model.load_state_dict(cast_state(native, torch.float32), strict=True)
    return model.to(device).eval()


@torch.no_grad()
def sample_windows(model: nn.Module, cfg: ModelConfig, count: int, batch: int = SAMPLE_BATCH) -> torch.Tensor:
    """(count, context + 1) token ids the model samples from a uniformly random first token, on the CPU."""
    device = next(model.parameters()).device
    rows = []
    for size in shares(count, -(-count // batch)):
        first = torch.randint(0, cfg.vocab_size, (size, 1), device=device)
        # top_k 0: plain sampling from the whole distribution (transformers' default keeps the 50 most likely);
        # the configs name no end-of-text token, so every window runs to its full length
        out = cast(Any, model).generate(  # a GenerationMixin (writer checked it); transformers types it narrower
            first, attention_mask=torch.ones_like(first), do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
            max_length=cfg.context + 1, pad_token_id=0)
        assert isinstance(out, torch.Tensor)  # token ids: no return_dict_in_generate
        rows.append(out.cpu())
    return torch.cat(rows)


def generated_text(natives: Sequence[Mapping[str, torch.Tensor]], configs: Sequence[ModelConfig],
                   n: int | None = None, *, seed: int = 0, device: str | torch.device | None = None) -> GeneratedText:
    """``n`` windows (default :data:`GENERATED_SAMPLES`) of text written by the models in equal shares, as (inputs
    (N, context), next-token targets); ``seed`` fixes the sampling (the caller's random state is left as it was)."""
    n = GENERATED_SAMPLES if n is None else n
    contexts = {(c.context, c.vocab_size) for c in configs}
    if len(contexts) > 1:
        raise ConfigError(f"generated text needs models of one context and vocabulary, got {sorted(contexts)}")
    first = next(iter(natives[0].values()))
    place = torch.device(device) if device is not None else first.device
    began = time.perf_counter()
    with torch.random.fork_rng(devices=[place] if place.type == "cuda" else []):
        torch.manual_seed(seed)
        windows = torch.cat([sample_windows(writer(s, c, place), c, k) for s, c, k in
                             zip(natives, configs, shares(n, len(natives)), strict=True)])
    seconds = time.perf_counter() - began
    log.info("generated %d windows of %d tokens in %.0f s", len(windows), windows.shape[1], seconds)
    return GeneratedText(windows[:, :-1], windows[:, 1:], seconds)
