"""Learned matching (paper §4.2, Algorithm 1): the transform that moves B is learned from the
task loss of the interpolated model, starting at the weight-matching solution.

Latent matrices — the residual (d, d) and, per layer, the heads (H, H) and the MLP (f, f) — are projected at
every forward pass (Eq. 5): the residual to the orthogonal group of the form (fixing 1 in standard form) by a
differentiable polar factor, the permutations by the Hungarian algorithm with a straight-through estimator.
Beyond the paper, the within-head orthogonal maps of weight matching are learned too (by default; measured to
help). θ(λ) = λ θ_A + (1−λ) T(θ_B) with λ ~ U(0.4, 0.6) is evaluated by
``torch.func.functional_call`` on one model built once, and only the latents train. The result is an exact
transform, so the aligned B computes exactly B's function. The loop here (:func:`learn`) also serves the soft,
dual and multi-model variants (``soft.py``, ``dual.py``): each endpoint of a path may carry its own latents.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.func import functional_call
from torch.optim.lr_scheduler import LambdaLR, LRScheduler
from torch.utils.data import DataLoader, Dataset, Subset
from tqdm import tqdm

from glmc.archs import Arch, get_arch
from glmc.core.config import ModelConfig
from glmc.core.state import State, cast, mix
from glmc.device import device_of
from glmc.errors import ConfigError
from glmc.match.common import MatchResult, require_data
from glmc.match.options import LearnConfig, MatchOptions, Targets, Within
from glmc.match.weight import learned_start
from glmc.symmetry import groups
from glmc.symmetry.canonical import CIRCUITS, Form, residual_group, to_circuit, to_model
from glmc.symmetry.transforms import Transform, apply, require_folded
from glmc.train import cosine_schedule, target_count, token_loss

log = logging.getLogger(__name__)

Weights = Sequence[float]  # one mixing weight per endpoint of the path, summing to 1


# Projections (Eq. 5) and latent initialisations.

def straight_through(zs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Hungarian(Z) as a permutation matrix in the forward pass for each latent; the gradient reaches Z unchanged
    (STE). The latents go to the host in one copy and their permutations come back in one: on a GPU each copy is a
    device sync, and a step has one latent per layer and unit group."""
    host = torch.cat([z.detach().reshape(-1) for z in zs]).cpu().split([z.numel() for z in zs])
    perms = torch.cat([groups.assignment(x.view(z.shape)) for x, z in zip(host, zs, strict=True)])
    moved = perms.to(zs[0].device).split([z.shape[0] for z in zs])
    return [torch.eye(z.shape[0], dtype=z.dtype, device=z.device)[p] + z - z.detach()
            for z, p in zip(zs, moved, strict=True)]


def sinkhorn(z: torch.Tensor, iters: int) -> torch.Tensor:
    """Sinkhorn-Knopp on exp(Z) in the log domain: a doubly stochastic matrix, differentiable (App. D.3)."""
    for _ in range(iters):
        z = z - z.logsumexp(1, keepdim=True)
        z = z - z.logsumexp(0, keepdim=True)
    return z.exp()


def dense(perm: torch.Tensor | None, n: int) -> torch.Tensor:
    """A reordering as an (n, n) float64 matrix with new = P @ old (the identity for None)."""
    eye = torch.eye(n, dtype=torch.float64)
    if perm is None:
        return eye
    # On the CPU, wherever the transform was found: latents are built there and moved with their path.
    return eye[perm.cpu()] if perm.dim() == 1 else perm.double().cpu()


def orthogonal_latent(q: torch.Tensor | None, d: int, noise: float, g: torch.Generator) -> torch.Tensor:
    """Q·S with S = I + ε·sym(G) positive definite: its polar factor is exactly Q, its singular values distinct."""
    x = torch.randn(d, d, generator=g, dtype=torch.float64)
    s = torch.eye(d, dtype=torch.float64) + noise * (x + x.T) / 2
    return dense(q, d) @ s


def head_latents(maps: torch.Tensor | None, heads: int, head_dim: int, noise: float, g: torch.Generator,
                 ) -> torch.Tensor:
    """(H, d_h, d_h) latents, one per head, around the given orthogonal within-head maps (identity for None)."""
    return torch.stack([orthogonal_latent(None if maps is None else maps[h], head_dim, noise, g)
                        for h in range(heads)])


def permutation_latent(perm: torch.Tensor | None, n: int, noise: float, g: torch.Generator) -> torch.Tensor:
    """P + ε·G: the Hungarian algorithm gives back P exactly while ε is small."""
    return dense(perm, n) + noise * torch.randn(n, n, generator=g, dtype=torch.float64)


def soft_latent(perm: torch.Tensor | None, n: int, gain: float, g: torch.Generator) -> torch.Tensor:
    """log(P + |N(0, σ²)|), σ = gain·√(2/(n+n)) (App. D.2: Xavier-scaled noise around the initial permutation)."""
    noise = torch.randn(n, n, generator=g, dtype=torch.float64).abs() * gain / math.sqrt(n)
    return torch.log(dense(perm, n) + noise + 1e-12)


class Latents(nn.Module):
    """One model's learnable transform: residual, per-layer head and MLP latents, and the within-head maps of
    ``options.within`` (orthogonal ones by a batched polar projection, invertible ones as they are)."""

    def __init__(self, init: Transform, cfg: ModelConfig, options: LearnConfig, *,
                 fix_ones: bool | groups.ResidualGroup, residual_perm: bool = False, soft: bool = False,
                 seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(options.seed + seed)
        self.init, self.fix_ones, self.soft = init, fix_ones, soft
        # A permutation residual (the ablation's, or a post-LayerNorm family's group) is learned as the units are:
        # straight through its assignment. Only the ablation (``residual_perm``) keeps the within-head maps fixed.
        self.residual_perm = residual_perm or groups.residual_group(fix_ones) == "permutation"
        self.iters = options.sinkhorn_iters
        units = (lambda p, n: soft_latent(p, n, options.soft_gain, g)) if soft else (
            lambda p, n: permutation_latent(p, n, options.noise, g))
        make_residual = permutation_latent if self.residual_perm else orthogonal_latent
        self.residual = nn.Parameter(make_residual(init.residual, cfg.width, options.noise, g))
        self.heads = nn.ParameterList([units(p, cfg.kv_heads) for p in init.heads])  # queries keep their groups
        self.mlp = nn.ParameterList([units(p, cfg.mlp) for p in init.mlp])
        self.within: Within = "fixed" if residual_perm else options.within
        self.rotary = cfg.rotary_dim  # q/k maps commuting with rotary positions: rotations per frequency pair
        if self.rotary and self.within == "invertible":
            raise ConfigError("learned invertible within-head maps would break rotary positions; learn orthogonal "
                              "ones (within='orthogonal') or keep them fixed")
        maps = (None if self.within == "fixed" else
                lambda m: head_latents(m, cfg.kv_heads, cfg.head_dim, options.noise, g))
        self.qk = nn.ParameterList([maps(m) for m in init.qk] if maps else [])
        self.ov = nn.ParameterList([maps(m) for m in init.ov] if maps else [])

    def _maps(self, projected: list[torch.Tensor] | None = None,
              ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """The within-head maps: the initial ones (fixed), copies of the latents (invertible; harden() keeps
        them), or the latents' polar factors (orthogonal): ``projected`` when given (:func:`project`)."""
        if self.within == "fixed":
            return self.init.qk, self.init.ov
        if self.within == "invertible":
            return [torch.clone(z) for z in self.qk], [torch.clone(z) for z in self.ov]
        maps: list[torch.Tensor | None] = list(projected if projected is not None else project([self])[0])
        if self.rotary:  # the nearest maps that commute with rotary positions, differentiable as the polar factor is
            maps[:len(self.qk)] = [groups.rotary_polar(z, self.rotary) for z in self.qk]
        return maps[:len(self.qk)], maps[len(self.qk):]

    def _residual(self) -> torch.Tensor:
        z = self.residual
        return straight_through([z])[0] if self.residual_perm else groups.procrustes(z, self.fix_ones)

    def _units(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The head and MLP reorderings, differentiable: Sinkhorn's (soft) or the straight-through permutations."""
        zs = [*self.heads, *self.mlp]
        out = [sinkhorn(z, self.iters) for z in zs] if self.soft else straight_through(zs)
        return out[:len(self.heads)], out[len(self.heads):]

    def forward(self, projected: list[torch.Tensor] | None = None) -> Transform:
        """The current transform, differentiable in the latents (dense reorderings, projected residual);
        ``projected``: its orthogonal within-head maps, when :func:`project` made them with other models'."""
        qk, ov = self._maps(projected)
        heads, mlp = self._units()
        return Transform(self.init.depth, residual=self._residual(), heads=list(heads), qk=qk, ov=ov,
                         mlp=list(mlp), group=self.init.group)

    @torch.no_grad()
    def harden(self) -> Transform:
        """The exact transform at the current latents: Hungarian index permutations and the projected residual.

        Soft latents give their doubly stochastic matrices instead (approximately function-preserving).
        """
        units: Callable[[torch.Tensor], torch.Tensor] = (
            (lambda z: sinkhorn(z, self.iters)) if self.soft else groups.assignment)
        qk, ov = self._maps()
        return Transform(self.init.depth, residual=self._residual().detach(), heads=[units(z) for z in self.heads],
                         qk=qk, ov=ov, mlp=[units(z) for z in self.mlp], group=self.init.group)


def project(latents: Sequence[Latents]) -> list[list[torch.Tensor]]:
    """The polar factors of the orthogonal within-head latents of every model, per model its qk then its ov maps:
    one batched SVD per latent shape instead of two per layer and model (on a GPU each call is a launch and a
    device sync). The same bits as one SVD per latent: a batched SVD factors each matrix on its own."""
    latent = [[*lat.qk, *lat.ov] if lat.within == "orthogonal" else [] for lat in latents]
    by_shape: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for z in (z for zs in latent for z in zs):
        by_shape.setdefault(tuple(z.shape[1:]), []).append(z)
    factors = {shape: iter(groups.polar(torch.cat(zs)).split([z.shape[0] for z in zs]))
               for shape, zs in by_shape.items()}
    return [[next(factors[tuple(z.shape[1:])]) for z in zs] for zs in latent]


# The path: endpoints, their mixture, and its task loss through one model.

@dataclass
class Endpoint:
    """One model on the path: its canonical state and, unless it stays put, the latents that move it."""

    state: State
    latents: Latents | None = None


class _Logits(nn.Module):
    """``arch.logits`` as a module, so that ``functional_call`` can swap in the path's parameters."""

    def __init__(self, arch: Arch, model: nn.Module) -> None:
        super().__init__()
        self.arch, self.model = arch, model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.arch.logits(self.model, x)


Merge = Callable[[Sequence[State], Weights], State]  # the endpoints as moved, and their weights → the path's point


@dataclass(frozen=True)
class View:
    """A model the path's point is scored as: the point ``restrict``-ed (None: itself) to a model of ``cfg`` (None:
    the path's), its loss weighted by ``weight``: a refinement across widths scores each input's slice of the merge."""

    cfg: ModelConfig | None = None
    weight: float = 1.0
    restrict: Callable[[State], State] | None = None


@dataclass(frozen=True)
class Scoring:
    """What a path scores at weights w: ``merge`` of the moved endpoints (Σ_i w_i T_i(θ_i) by default), seen as each
    of ``views`` (the merge itself by default). A merge across widths is not that sum (glmc.merging.universe)."""

    merge: Merge = mix
    views: tuple[View, ...] = (View(),)


PLAIN = Scoring()  # a path's own: Σ_i w_i T_i(θ_i), scored as itself


class Path:
    """Mixtures Σ_i w_i T_i(θ_i) of the endpoints (or their merge, as ``scoring`` says) and their logits, through one
    model built once (and one per narrower view).

    In the circuit form the endpoints stay standard states (the transforms act there) and each moved endpoint is
    multiplied out into its circuits before mixing, so the path interpolates circuits (paper §3.2.2).
    """

    def __init__(self, endpoints: Sequence[Endpoint], cfg: ModelConfig, form: Form, dtype: torch.dtype,
                 dropout: float = 0.0, targets: Targets = "labels", scoring: Scoring = PLAIN) -> None:
        self.arch, self.cfg, self.dtype, self.circuit = get_arch(cfg.family), cfg, dtype, form in CIRCUITS
        if self.circuit and scoring != PLAIN:
            raise ConfigError(f"a path in the {form!r} form mixes its circuits; a merge across widths and its views "
                              "take standard states only")
        self.merge, self.views = scoring.merge, scoring.views
        self.states = [cast(e.state, dtype) for e in endpoints]
        self.device = device_of(self.states[0])  # the path runs where its endpoints live
        self.still = [self._form(s)[0] for s in self.states]  # each endpoint as it stands, in the path's form
        self.folded = [e.latents is not None for e in endpoints]  # moved ones: gains checked here, not every step
        for state, moved in zip(self.states, self.folded, strict=True):
            if moved:
                require_folded(state, self.arch.spec, cfg.depth)
        self.dropout, self.targets = dropout, targets
        state, run = self._form(self.states[0])
        self.module = _Logits(self.arch, to_model(state, run.replace(dropout=dropout), form))
        self.modules = {cfg: self.module} | {  # a narrower view's model, built once from the first endpoint's slice
            v.cfg: _Logits(self.arch, to_model(v.restrict(self.states[0]), v.cfg.replace(dropout=dropout)))
            for v in self.views if v.cfg is not None and v.cfg != cfg and v.restrict is not None}

    def _form(self, state: State) -> tuple[State, ModelConfig]:
        """A standard state in the path's form, with the config of the model that runs it."""
        return to_circuit(state, self.cfg) if self.circuit else (state, self.cfg)

    def point(self, transforms: Sequence[Transform | None], weights: Weights) -> State:
        """Σ_i w_i T_i(θ_i) (or the path's merge of the T_i(θ_i)) in the path's form; an endpoint without a transform
        stays as it is."""
        moved = [still if t is None else self._form(apply(s, self.arch.spec, t, self.cfg.heads, folded=folded))[0]
                 for s, still, t, folded in zip(self.states, self.still, transforms, self.folded, strict=True)]
        return self.merge(moved, weights)

    def logits(self, state: State, x: torch.Tensor, cfg: ModelConfig | None = None) -> torch.Tensor:
        """Logits of the model of ``cfg`` (default: the path's) holding the canonical ``state`` (no new module:
        ``functional_call``)."""
        cfg = cfg or self.cfg
        native = self.arch.to_native(state, cfg)
        x = x.to(self.device, self.dtype) if x.is_floating_point() else x.to(self.device)
        # a tied parameter is given once, by its source: functional_call ties the module's aliases to it
        return functional_call(self.modules[cfg], {f"model.{k}": v for k, v in native.items()
                                                   if k not in self.arch.tied}, (x,))

    def loss(self, state: State, x: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """The task loss of the point ``state`` over the path's views, weighted (one view: the point itself)."""
        losses = [v.weight * token_loss(self.logits(state if v.restrict is None else v.restrict(state), x, v.cfg),
                                        target, reduction=reduction) for v in self.views]
        return sum(losses[1:], losses[0])

    def train(self, mode: bool) -> None:
        """Every view's model in training (dropout) or evaluation mode."""
        for module in self.modules.values():
            module.train(mode)

    def check(self, x: torch.Tensor) -> None:
        """ConfigError (one line) unless the batch fits the model."""
        self.arch.check_inputs(self.cfg, x)

    def predictions(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each endpoint's predicted probabilities on ``x`` (none for targets "labels"), without dropout or
        gradients: computed once per batch, whatever the weights they are mixed by."""
        if self.targets == "labels":
            return []
        training = self.module.training
        self.module.eval()
        with torch.no_grad():
            probs = [self.logits(s, x).softmax(-1) for s in self.still]
        self.module.train(training)
        return probs

    def target(self, y: torch.Tensor, weights: Weights, predictions: Sequence[torch.Tensor]) -> torch.Tensor:
        """What the path at ``weights`` is scored against: the labels ``y``, or (targets "endpoints") the endpoints'
        ``predictions`` mixed by the same weights."""
        if self.targets == "labels":
            return y.to(self.device)
        return torch.stack([w * p for w, p in zip(weights, predictions, strict=True)]).sum(0)


# Sampling the mixing weights (paper App. C.1.1; Dirichlet for several models, §4.3).

class Sampler:
    """Mixing weights for each step: λ ~ U(lo, hi) for a pair, or Dirichlet(α) for several models."""

    def __init__(self, seed: int, lam: tuple[float, float] | None = None, alpha: Sequence[float] | None = None):
        self.rng, self.lam, self.alpha = np.random.default_rng(seed), lam, alpha

    def __call__(self) -> list[float]:
        if self.alpha is not None:
            return [float(w) for w in self.rng.dirichlet(self.alpha)]
        assert self.lam is not None
        lam = float(self.rng.uniform(*self.lam))
        return [lam, 1.0 - lam]


# The learning loop (Algorithm 1).

def pair_points(options: LearnConfig) -> list[Weights]:
    """The (λ, 1 − λ) at which a pair's path is validated: ``val_points`` λ evenly spaced over ``options.lam``."""
    lo, hi = options.lam
    lams = [(lo + hi) / 2] if options.val_points == 1 else np.linspace(lo, hi, options.val_points).tolist()
    return [(lam, 1.0 - lam) for lam in lams]


@dataclass
class Learned:
    """The best transforms found (None for endpoints that stay put), the validation history and why it stopped."""

    transforms: list[Transform | None]
    history: list[float]
    validation: Dataset
    info: dict[str, object] = field(default_factory=dict)


def split(data: Dataset, options: LearnConfig, validation: Dataset | None) -> tuple[Dataset, Dataset]:
    """(train, validation): the given validation set, or a seeded random share of ``data`` held out."""
    n = len(data)  # type: ignore[arg-type]
    if validation is not None:
        return data, validation
    if n < 2:
        raise ConfigError(f"learned matching needs at least 2 training samples (one held out), got {n}")
    held = min(options.val_max, n - 1, max(1, round(options.val_fraction * n)))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(options.seed)).tolist()
    return Subset(data, order[held:]), Subset(data, order[:held])


@torch.no_grad()
def validate(path: Path, transforms: Sequence[Transform | None], points: Sequence[Weights], loader: DataLoader,
             ) -> float:
    """Mean task loss of the path at each of ``points`` over the validation batches."""
    states = [path.point(transforms, w) for w in points]
    path.train(False)
    total, count = 0.0, 0
    for x, y in loader:
        path.check(x)
        predicted = path.predictions(x)
        total += sum(float(path.loss(s, x, path.target(y, w, predicted), reduction="sum"))
                     for s, w in zip(states, points, strict=True))
        count += target_count(y)
    return total / (count * len(states))


def _step(path: Path, latents: Sequence[Latents | None], weights: Weights, x: torch.Tensor, y: torch.Tensor,
          optimizer: torch.optim.Optimizer) -> float:
    """One optimizer step on the latents; NaN (and no step) when the loss or a gradient is not finite."""
    path.check(x)
    target = path.target(y, weights, path.predictions(x))
    path.train(path.dropout > 0)  # dropout while learning, if asked for; nothing else differs in train mode
    projected = iter(project([lat for lat in latents if lat is not None]))
    loss = path.loss(path.point([lat(next(projected)) if lat else None for lat in latents], weights), x, target)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    finite = torch.stack([torch.isfinite(loss), *(torch.isfinite(gr).all() for gr in grads)]).all()
    if not bool(finite):  # one device sync for the loss and every gradient
        return math.nan
    optimizer.step()
    return loss.item()


_ROUNDING = 1e-9  # relative validation improvements below this are rounding, not learning


@dataclass
class _Progress:
    """Early-stopping state: the best validation loss, where it was reached, and the transforms there."""

    loss: float
    transforms: list[Transform | None]
    step: int = 0
    stale: int = 0
    history: list[float] = field(default_factory=list)

    def update(self, step: int, loss: float, transforms: list[Transform | None]) -> None:
        self.history.append(loss)
        if loss < self.loss - _ROUNDING * abs(self.loss):
            self.loss, self.step, self.stale, self.transforms = loss, step, 0, transforms
        else:
            self.stale += 1


def targets_for(options: LearnConfig, data: Dataset) -> Targets:
    """The targets a run learns against: ``options.targets``, else the endpoints on text the models wrote and the
    labels on any other data."""
    from glmc.data.generated import GeneratedText

    if options.targets is not None:
        return options.targets
    return "endpoints" if isinstance(data, GeneratedText) else "labels"


def learn(endpoints: Sequence[Endpoint], cfg: ModelConfig, data: Dataset, sampler: Sampler,
          points: Sequence[Weights], options: LearnConfig, *, form: Form = "standard",
          validation: Dataset | None = None, scoring: Scoring = PLAIN) -> Learned:
    """Algorithm 1 over any number of endpoints: minimise the task loss of Σ_i w_i T_i(θ_i) (or of the merge the
    caller will make of them, seen as ``scoring`` says), w ~ ``sampler``.

    The first candidate is every endpoint's initial transform; it is replaced only by transforms with a lower
    validation loss at ``points``. A non-finite loss stops learning and keeps the best transforms so far.
    """
    start = time.perf_counter()
    train, val = split(data, options, validation)
    targets = targets_for(options, data)
    path = Path(endpoints, cfg, form, getattr(torch, options.dtype), options.dropout, targets, scoring)
    latents = [e.latents.to(path.device) if e.latents else None for e in endpoints]
    params = [p for lat in latents if lat is not None for p in lat.parameters()]
    val_loader = DataLoader(val, batch_size=256)
    best = _Progress(validate(path, [lat.init if lat else None for lat in latents], points, val_loader),
                     [lat.init if lat else None for lat in latents])
    best.history.append(best.loss)
    loader = DataLoader(train, batch_size=options.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(options.seed))
    total = options.steps or options.epochs * len(loader)
    optimizer = torch.optim.AdamW(params, lr=options.lr, weight_decay=options.weight_decay)
    schedule = cosine_schedule(optimizer, total, 0.0) if options.cosine else LambdaLR(optimizer, lambda _: 1.0)
    with torch.random.fork_rng(devices=[path.device] if path.device.type == "cuda" else []):
        torch.manual_seed(options.seed)  # dropout's masks: the same run twice, the caller's generator untouched
        stopped = _loop(path, latents, loader, total, sampler, points, val_loader, schedule, best, options)
    info = {"val_loss_init": best.history[0], "val_loss": best.loss, "best_step": best.step, "stopped": stopped,
            "val_points": [list(w) for w in points], "targets": targets,
            "learn_seconds": round(time.perf_counter() - start, 3)}
    log.info("learned matching: validation loss %.5f → %.5f (step %d); %s", best.history[0], best.loss,
             best.step, stopped)
    return Learned(best.transforms, best.history, val, info)


def _loop(path: Path, latents: list[Latents | None], loader: DataLoader, total: int, sampler: Sampler,
          points: Sequence[Weights], val_loader: DataLoader, schedule: LRScheduler, best: _Progress,
          options: LearnConfig) -> str:
    """Run up to ``total`` steps, validating every ``eval_every``; returns why it stopped."""
    running, step = math.nan, 0
    with tqdm(total=total, desc="learned matching", unit="step", disable=not options.progress,
              dynamic_ncols=True) as bar:
        for step, (x, y) in enumerate(_epochs(loader, total), start=1):
            loss = _step(path, latents, sampler(), x, y, schedule.optimizer)
            if not math.isfinite(loss):
                log.warning("learned matching: non-finite loss or gradient at step %d; stopped and kept the best "
                            "transform so far (validation loss %.5f from step %d)", step, best.loss, best.step)
                return f"non-finite loss or gradient at step {step}"
            schedule.step()
            running = loss if math.isnan(running) else 0.95 * running + 0.05 * loss
            bar.update()
            bar.set_postfix(loss=f"{running:.4f}", best=f"{best.loss:.4f}", refresh=False)
            if step % options.eval_every == 0 or step == total:
                current = [lat.harden() if lat else None for lat in latents]
                best.update(step, validate(path, current, points, val_loader), current)
                if options.patience and best.stale >= options.patience:
                    return f"early stop at step {step}"
    return f"completed {step} steps"


def _epochs(loader: DataLoader, total: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches from as many passes over ``loader`` as ``total`` steps need."""
    step = 0
    while step < total:
        for batch in loader:
            if step == total:
                return
            step += 1
            yield batch


def learned_match(a: State, b: State, cfg: ModelConfig, data: Dataset, options: MatchOptions | None = None, *,
                  permutations_only: bool = False, validation: Dataset | None = None) -> MatchResult:
    """Algorithm 1: T(θ_B) ≡ θ_B as a function with λ θ_A + (1−λ) T(θ_B) of low task loss.

    ``a``, ``b``: canonical states of ``cfg`` in ``options.form``; ``data``: (input, target) pairs of the training
    split, a validation share of it held out unless ``validation`` is given. It starts from weight matching with
    ``options.weight`` (:func:`glmc.match.weight.learned_start`) and learns with ``options.learn``.
    ``permutations_only`` makes the residual a permutation too and starts from permutation-only weight matching
    (the paper's "permutations" row).
    """
    options = options or MatchOptions()
    learn_options, began = options.learn, time.perf_counter()
    fix_ones = residual_group(options.form, get_arch(cfg.family))
    start = learned_start(a, b, cfg, options, permutations_only=permutations_only)
    latents = Latents(start.match.transform, cfg, learn_options, fix_ones=fix_ones, residual_perm=permutations_only)
    learned = learn([Endpoint(a), Endpoint(start.b, latents)], cfg, data,
                    Sampler(learn_options.seed, lam=learn_options.lam), pair_points(learn_options), learn_options,
                    form=options.form, validation=validation)
    transform = learned.transforms[1]
    assert transform is not None
    return MatchResult(start.carried(transform), learned.history, time.perf_counter() - began,
                       learned.info | {"weight_objective": start.match.objective[-1]})


# The registry's entry points (glmc.match.registry): canonical states a, b of cfg, the training data, MatchOptions.
def pairwise(a: State, b: State, cfg: ModelConfig, data: Dataset | None, options: MatchOptions) -> MatchResult:
    """Learned matching (Algorithm 1) from weight matching."""
    return learned_match(a, b, cfg, require_data(data), options)


def pairwise_permutations(a: State, b: State, cfg: ModelConfig, data: Dataset | None,
                          options: MatchOptions) -> MatchResult:
    """Learned matching of permutations only."""
    return learned_match(a, b, cfg, require_data(data), options, permutations_only=True)
