"""Local training and evaluation, shared by the CLI and (later) the Flower clients.

One loop serves both families: ``Arch.logits`` gives (B, classes) for images and (B, T, vocab)
for text, and the cross-entropy is taken over the last axis against (B,) or (B, T) targets.
AdamW with linear warm-up then cosine decay, gradient clipping at 1.0. Every source of
randomness is seeded, so the same seed, data and thread count give the same weights bit for bit.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from glmc.archs import Arch
from glmc.device import autocast, check_precision, resolve
from glmc.errors import ConfigError, check_options

log = logging.getLogger(__name__)

IGNORE_INDEX = -100  # the targets F.cross_entropy skips (glmc.data.masking.IGNORE)


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one local training run."""

    epochs: int = 1
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup: float = 0.05  # fraction of all steps spent warming the learning rate up linearly
    seed: int = 0
    max_steps: int | None = None  # stop early after this many optimizer steps
    grad_clip: float = 1.0
    threads: int = 0  # torch intra-op threads; 0 = every core this process may use
    device: str = "cpu"  # cpu, cuda, cuda:N or auto (glmc.device.resolve)
    precision: str = "fp32"  # fp32 | bf16 (autocast on the forward pass; the weights stay float32)
    # Early stopping on a validation split (where the run has one): validate every ``eval_every`` steps, stop after
    # ``patience`` validations without a lower loss (0: never validate) and keep the best weights.
    patience: int = 0
    eval_every: int = 100

    def __post_init__(self) -> None:
        check_options("training", [
            ("≥ 1", lambda v: v >= 1,
             {"epochs": self.epochs, "batch_size": self.batch_size, "max_steps": self.max_steps,
              "eval_every": self.eval_every}),
            ("finite and > 0", lambda v: math.isfinite(v) and v > 0, {"lr": self.lr}),
            ("finite and ≥ 0", lambda v: math.isfinite(v) and v >= 0,
             {"weight_decay": self.weight_decay, "threads": self.threads, "patience": self.patience}),
            ("> 0 (inf: no clipping)", lambda v: v > 0, {"grad_clip": self.grad_clip}),  # 0 would zero every step
            ("in [0, 1)", lambda v: 0 <= v < 1, {"warmup": self.warmup})])
        check_precision(self.precision)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def seed_everything(seed: int) -> torch.Generator:
    """Seed python, numpy and torch; return a fresh generator for DataLoader shuffling."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def set_threads(threads: int = 0) -> int:
    """Use ``threads`` torch threads (0 = all cores available to this process); returns the count."""
    count = threads or len(os.sched_getaffinity(0))
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return count


def token_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over the last axis: (B, C) vs (B,) for images, (B, T, V) vs (B, T) for text; or against
    probabilities of the logits' own shape (soft targets)."""
    soft = targets.is_floating_point()
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(0, -2) if soft else targets.flatten(),
                           reduction=reduction)


def target_count(targets: torch.Tensor) -> int:
    """How many targets a batch scores: every label but those cross-entropy ignores (a masked model's unselected
    positions, :data:`glmc.data.masking.IGNORE`), or every row of soft targets."""
    if targets.is_floating_point():
        return targets.shape[:-1].numel()
    return int((targets != IGNORE_INDEX).sum())


def cosine_schedule(optimizer: torch.optim.Optimizer, total: int, warmup: float) -> LambdaLR:
    """Linear warm-up over ``warmup·total`` steps, then cosine decay to zero at ``total``."""
    warm = max(1, round(warmup * total))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))

    return LambdaLR(optimizer, factor)


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only, not on biases or LayerNorm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr)


def _batches(loader: DataLoader, epochs: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for _ in range(epochs):
        yield from loader


@dataclass
class _EarlyStop:
    """Validation every ``cfg.eval_every`` steps: the best loss, its step and weights (a copy), and whether
    ``cfg.patience`` validations have passed without a lower one."""

    arch: Arch
    data: Dataset
    cfg: TrainConfig
    best: float = math.inf
    best_step: int = 0
    since: int = 0
    weights: dict[str, torch.Tensor] | None = None

    def stop(self, model: nn.Module, step: int, last: bool) -> bool:
        """Validate at this step if it is due (or the last); True once patience has run out."""
        if step % self.cfg.eval_every and not last:
            return False
        loss = evaluate(model, self.arch, self.data, precision=self.cfg.precision)["loss"]
        model.train()
        if loss < self.best:
            self.best, self.best_step, self.since = loss, step, 0
            self.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            self.since += 1
        log.info("step %d: validation loss %.4f (best %.4f at step %d)", step, loss, self.best, self.best_step)
        return self.since >= self.cfg.patience

    def restore(self, model: nn.Module) -> dict[str, float]:
        """Load the best weights back; the figures of the watch."""
        assert self.weights is not None
        model.load_state_dict(self.weights)
        return {"val_loss": self.best, "best_step": self.best_step}


def train(model: nn.Module, arch: Arch, dataset: Dataset, cfg: TrainConfig, progress: bool = True,
          validation: Dataset | None = None, teacher: nn.Module | None = None,
          step_logits: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
    """Train ``model`` in place with AdamW and a warm-up + cosine schedule; with ``validation`` and
    ``cfg.patience`` > 0, stop early on it and keep the best weights (the schedule is the whole run's).
    With ``teacher`` (inputs → probabilities, e.g. :class:`glmc.merging.evaluation.PredictionMixture`) each batch is
    scored against its predictions, not the dataset's labels: distillation on the dataset's inputs.
    With ``step_logits`` (called as ``arch.logits`` is, once a step) the steps' forward passes are its, not the
    family's: FjORD's Ordered Dropout (:class:`glmc.ordered_dropout.OrderedDropout`) draws a sub-model each step.

    Returns ``train_loss`` (mean over the last 10% of steps, where the schedule has settled), ``steps``
    and ``seconds`` (and ``val_loss`` and ``best_step`` when stopping early).
    """
    generator = seed_everything(cfg.seed)
    set_threads(cfg.threads)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, shuffle=True, generator=generator)
    if len(loader) == 0:
        raise ConfigError("cannot train on an empty dataset")
    total = min(cfg.epochs * len(loader), cfg.max_steps or cfg.epochs * len(loader))
    device = resolve(cfg.device)
    model.to(device).train()  # before the optimizer is built: AdamW's state then lives beside the weights
    if teacher is not None:
        teacher.to(device).eval()
    optimizer = make_optimizer(model, cfg)
    scheduler = cosine_schedule(optimizer, total, cfg.warmup)
    step_arch = arch if step_logits is None else dataclasses.replace(arch, logits=step_logits)
    losses: list[torch.Tensor] = []  # kept on the device: a GPU step never waits for its loss to be read
    watch = _EarlyStop(arch, validation, cfg) if validation is not None and cfg.patience > 0 else None
    start = time.perf_counter()
    with tqdm(total=total, desc="train", unit="step", disable=not progress, dynamic_ncols=True) as bar:
        for step, (x, y) in enumerate(itertools.islice(_batches(loader, cfg.epochs), total), start=1):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if teacher is not None:
                y = teacher(x)
            losses.append(train_step(model, step_arch, x, y, optimizer, cfg.grad_clip, cfg.precision))
            scheduler.step()
            bar.update()
            if progress and step % 50 == 0:
                bar.set_postfix(loss=f"{float(torch.stack(losses[-50:]).mean()):.4f}", refresh=False)
            if watch is not None and watch.stop(model, step, last=step == total):
                break
    values = torch.stack(losses).double().cpu().numpy()
    seconds = time.perf_counter() - start
    train_loss = float(np.mean(values[-max(1, len(values) // 10) :]))
    log.info("trained %d steps in %.1f s; train loss %.4f", len(losses), seconds, train_loss)
    stopped = watch.restore(model) if watch is not None else {}
    return {"train_loss": train_loss, "steps": len(losses), "seconds": seconds, **stopped}


def train_step(
    model: nn.Module,
    arch: Arch,
    x: torch.Tensor,
    y: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    clip: float,
    precision: str = "fp32",
) -> torch.Tensor:
    """One optimizer step on a batch (forward under ``precision``'s autocast, backward outside it); returns its
    mean loss, detached, on the batch's device."""
    with autocast(x.device, precision):
        logits = arch.logits(model, x)
    loss = token_loss(logits.float(), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return loss.detach()


@torch.no_grad()
def evaluate(model: nn.Module, arch: Arch, dataset: Dataset, batch_size: int = 256,
             precision: str = "fp32") -> dict[str, float]:
    """Mean cross-entropy in nats per target and accuracy (next-char accuracy for text), on the model's device;
    ``precision='bf16'`` autocasts the forward passes (the loss is summed in float32)."""
    param = next(model.parameters())
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=param.device)  # summed on the device: one sync at the end
    correct, count = torch.zeros((), dtype=torch.long, device=param.device), 0
    for x, y in DataLoader(dataset, batch_size=batch_size, shuffle=False):
        # images in the model's own precision (a float32 evaluation of float64 data, or the reverse); tokens as they are
        x, y = x.to(param.device, param.dtype) if x.is_floating_point() else x.to(param.device), y.to(param.device)
        with autocast(param.device, precision):
            logits = arch.logits(model, x)
        loss_sum += token_loss(logits.float() if precision != "fp32" else logits, y, reduction="sum").double()
        correct += (logits.argmax(-1) == y).sum()  # an ignored target (-100) never equals a prediction
        count += target_count(y)
    if count == 0:
        raise ConfigError("cannot evaluate on an empty dataset")
    return {"loss": float(loss_sum) / count, "accuracy": int(correct) / count}
