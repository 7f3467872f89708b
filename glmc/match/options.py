"""How a pairwise matcher runs: each method's options as a frozen dataclass (weight matching's, activation
matching's, the learned methods'), and :class:`MatchOptions`, which holds one of each and is what every method of
the registry takes. Every option is declared once here with its help, flag and run-config key
(:func:`glmc.core.options.option`); the CLI's flags, the run config's sections and the docs are read off them.
Torch-free, so that ``glmc --help`` loads no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

from glmc.core.options import check_choices, option
from glmc.errors import check_options

if TYPE_CHECKING:
    from glmc.symmetry.canonical import Form

Start = Literal["relaxed", "identity", "embeddings"]
HeadCost = Literal["norm", "squared"]
MlpCost = Literal["inner", "l1"]
Stop = Literal["converged", "fixed"]
Biases = Literal["skip", "read"]
OvMaps = Literal["orthogonal", "path"]
Within = Literal["fixed", "orthogonal", "invertible"]
WITHIN: tuple[Within, ...] = get_args(Within)
Targets = Literal["labels", "endpoints"]
Views = Literal["merge", "members"]
VIEWS: tuple[Views, ...] = get_args(Views)
TARGETS: tuple[Targets, ...] = get_args(Targets)


@dataclass(frozen=True)
class WeightOptions:
    """Weight matching's start, and the choices where this matcher and the official GLMC code differ; the first four
    costs' defaults measured against the other choice on three disjoint pairs each of vit-bench and gpt2-bench
    (simulations/results/weight-options).

    ``start``: the residual map the first sweep assumes (:func:`glmc.match.weight.weight_match`); the learned methods
    begin from this matching too. ``head_cost``: the head LAP's cost, ‖ΔQK‖ + ‖ΔOV‖ (``norm``, the official's) or
    ‖ΔQK‖² + ‖ΔOV‖² (``squared``, this project's first). ``mlp_cost``: the MLP LAP's, the inner product
    ⟨W_A, P W_B⟩ of the units' fc1 rows, biases and fc2 columns (``inner``), or the L1 distance between those rows
    L2-normalised (``l1``, the official's). From the relaxed start, norm and inner give 17.1% of the vanilla barrier
    on vit-bench and 30.8% on gpt2-bench (identity start, squared, inner: 20.2% and 30.0%); l1 gains gpt2-bench 1.2
    points but is no matrix product: one GPT-2-small layer's L1 cost takes 56 s of this CPU against 1 s for the
    inner product. ``stop``: sweeps end when the objective improves by less than the tolerance (``converged``), or
    run all ``max_sweeps`` and keep the last (``fixed``, the official's 15: no better, and slower). ``biases``: the
    stream's biases (tensors of the residual axis alone: LayerNorm and output biases) are left out of the matching,
    as the official code's Procrustes reads weights only (``skip``), or read, each weighted in the residual
    Procrustes as a whole tensor (``read``, the default until 2026-12-02). On the official GLMC GPT-2 pair skip
    leaves 0.0824 in the standard form (read: 0.1050; simulations/results/official-pair), and it loses nowhere else
    measured: vit-bench 13.2% of vanilla against 13.5%, with dropout 10.8% against 12.3% (simulations/results/biases).
    ``ov_maps``: the within-head v/o maps are orthogonal (``orthogonal``, Procrustes on the factors) or, after the
    matching, invertible maps that bring the standard path's OV circuits onto the circuit path (``path``,
    :mod:`glmc.match.ov_path`; the ``weight`` method only: learned matching starts from the orthogonal ones). The
    official code differs in more (docs/matching.md).
    """

    start: Start = option("relaxed", "where it starts the residual map: 'relaxed': solved first with every unit "
                          "map relaxed to an orthogonal one, which assumes nothing of B's basis; 'identity' (the old "
                          "default, which can end in a local optimum even for a transformed copy of B); or "
                          "'embeddings': Procrustes on the embeddings and the head alone (the official GLMC code's "
                          "first step). The learned methods begin from this matching", key="weight-start")
    head_cost: HeadCost = option("norm", "the head assignment's cost: ‖ΔQK‖ + ‖ΔOV‖ or ‖ΔQK‖² + ‖ΔOV‖²",
                                 key="weight-head-cost")
    mlp_cost: MlpCost = option("inner", "the MLP assignment's: the inner product of the units' weights, or the L1 "
                               "distance between their L2-normalised rows (slow at large widths)",
                               key="weight-mlp-cost")
    stop: Stop = option("converged", "sweeps end when the objective stops improving, or run all 15")
    biases: Biases = option("skip", "the residual Procrustes leaves the stream's biases (LayerNorm and output biases) "
                            "out, as the official code does, or reads them, each weighted as a whole tensor",
                            key="weight-biases")
    ov_maps: OvMaps = option("orthogonal", "the within-head v/o maps: orthogonal, or invertible maps that bring the "
                             "models' own path onto the circuit path (method weight only; data-free)",
                             key="weight-ov-maps")

    def __post_init__(self) -> None:
        check_choices(self, "weight-matching")


@dataclass(frozen=True)
class SymmetryOptions:
    """Which part of each family's declared symmetry group a matcher searches: the whole of it (both models balanced
    along the non-orthogonal classes first, :mod:`glmc.match.balance`: within-head invertible maps, rotary pair
    scales, MLP unit scales), or only its orthogonal part (the matchers before 2026-12-06)."""

    group: Literal["whole", "orthogonal"] = option(
        "whole", "the symmetry group searched: the whole declared group (each model balanced along its invertible "
        "within-head maps, rotary pair scales and MLP unit scales first, which undoes any transform from it), or "
        "its orthogonal part only", key="group")

    def __post_init__(self) -> None:
        check_choices(self, "symmetry")


@dataclass(frozen=True)
class ActivationOptions:
    """Activation matching's sample: the first ``batch`` inputs of the data it is given."""

    batch: int = 512

    def __post_init__(self) -> None:
        check_options("activation matching", [("≥ 1", lambda v: v >= 1, {"batch": self.batch})])


@dataclass(frozen=True)
class LearnConfig:
    """Options of learned matching and its variants (paper App. C: narrow uniform λ, early stopping)."""

    epochs: int = option(2, "passes over the training samples")
    steps: int | None = option(None, "this many optimizer steps (cycling through the data) instead of --epochs "
                               "(default: --epochs decides)",
                               key="server-steps", none=0)
    # AdamW on the latents. The paper's 3e-4 left a vit-bench Fashion-MNIST pair (seeds 0, 4) at barrier 0.106
    # after one epoch, 3e-3 at 0.064 (weight matching: 0.96); 1e-2 was no better on seeds 0, 1.
    lr: float = option(3e-3, "AdamW learning rate on the latents (> 0)")
    cosine: bool = True  # decay the learning rate to zero over the run (glmc.train.cosine_schedule)
    # the projections are scale-invariant, so decay would only raise the step size
    weight_decay: float = option(0.0, "AdamW weight decay on the latents")
    # Dropout on the interpolated model's embeddings, attention and residual writes while learning (validation runs
    # without it). The official GLMC merger learns with its models' dropout 0.1 on.
    dropout: float = option(0.0, "dropout on the interpolated model while learning, in [0, 1) (the official GLMC "
                            "merger keeps its models' 0.1)")
    batch_size: int = option(128, "samples per step")
    lam: tuple[float, float] = option((0.4, 0.6), "on a pair: train at λ ~ U(LO, HI), the weight of A (the paper's; "
                                      "a wide-to-narrow pair peaks nearer the narrow end, so widen it there)")
    # Several models' weights ~ Dirichlet(c·N·w), w the normalised weights: c = 10 samples near the weighted mean,
    # the model a merge keeps (as λ ~ U(0.4, 0.6) does for a pair). Merging 5 vit-bench seeds (20000 samples, one
    # pass; simulations/results/merging): the paper's c = 0.1, mostly near the corners, 80.8%; c = 10, 84.5%.
    concentration: float = option(10.0, "merging N models: the refinement's weights ~ Dirichlet(c·N·w); 0.1 is the "
                                  "paper's, spread over the simplex; 10 stays near the weighted mean that the merge "
                                  "keeps", key="refine-concentration")
    val_fraction: float = 0.1  # of the given training data, held out for early stopping
    val_max: int = option(1000, "hold out at most N training samples for validation (at most a tenth of them); each "
                          "validation reads them all, at the first step and the last")
    # A pair validates at this many λ evenly spaced over ``lam`` (1: its midpoint), so that early stopping watches
    # the whole range it trains on: a wide-to-narrow path peaks near λ = 0.3, away from the midpoint.
    val_points: int = option(1, "on a pair: validate at this many λ evenly spaced over --lam for early stopping "
                             "(1: the midpoint)")
    eval_every: int = 50  # steps between validations
    patience: int = option(5, "stop after N validations without improvement (0 never stops early)")
    noise: float = 0.01  # latents start at the initial transform perturbed by this much (distinct singular values)
    # The within-head maps: kept from weight matching ("fixed"), learned as orthogonal maps, or learned as any
    # invertible maps (the whole group of the head's QK and OV circuits, §3.1). On vit-bench seeds 0, 1 one epoch
    # reached barrier 0.040 with orthogonal maps and 0.051 with fixed ones.
    within: Within = option("orthogonal", "the within-head maps: kept from weight matching, learned as orthogonal "
                            "maps, or learned as any invertible maps", key="refine-within")
    # What the path's loss is measured against: the data's labels, or the endpoints' own predictions mixed by the
    # step's weights, Σ_i w_i softmax(f_i(x)), which reads the inputs only (no labels). None: the endpoints on text
    # the models wrote (glmc.data.generated.GeneratedText, whose "labels" are their samples), the labels otherwise.
    targets: Targets | None = option(None, "score the path against the data's labels or against the endpoints' own "
                                     "predictions mixed like their weights, which reads no labels (default: "
                                     "endpoints on text the models write, else labels)", key="refine-targets",
                                     none="auto")
    # Across widths, what the refinement of N models scores: the merge itself (the model a merge writes), or every
    # input's view of it, the merge restricted to where that input sits, weighted as the inputs are (what a
    # federation of mixed widths serves its clients: each narrow tier gets its slice of the merge, not the merge).
    views: Views = option("merge", "merging N models of different widths: score the refinement on the merged model, "
                          "or on each input's view of it (the merge restricted to where that input sits, weighted as "
                          "the inputs: what a federation of mixed widths serves its clients)", key="refine-views")
    sinkhorn_iters: int = 20  # soft permutations (App. D)
    soft_gain: float = 0.01  # App. D's noise gain: target P + |N(0, (gain/√n)²)| before the logarithm
    seed: int = 0
    dtype: Literal["float32", "float64"] = "float32"  # of the forward passes; latents and projections stay float64
    progress: bool = False  # a tqdm bar with the running interpolated loss

    def __post_init__(self) -> None:
        lo, hi = self.lam
        check_choices(self, "learned-matching")
        check_options("learned matching", [
            ("≥ 1", lambda v: v >= 1, {"epochs": self.epochs, "steps": self.steps, "batch_size": self.batch_size,
                                       "val_max": self.val_max, "val_points": self.val_points,
                                       "eval_every": self.eval_every,
                                       "sinkhorn_iters": self.sinkhorn_iters}),
            ("finite and ≥ 0", lambda v: math.isfinite(v) and v >= 0,
             {"weight_decay": self.weight_decay, "patience": self.patience}),
            ("finite and > 0", lambda v: math.isfinite(v) and v > 0,
             {"lr": self.lr, "noise": self.noise, "soft_gain": self.soft_gain, "concentration": self.concentration}),
            ("in (0, 1)", lambda v: 0 < v < 1, {"val_fraction": self.val_fraction}),
            ("in [0, 1)", lambda v: 0 <= v < 1, {"dropout": self.dropout}),
            ("in [0, 1], lo ≤ hi", lambda v: 0 <= v <= 1 and lo <= hi, {"λ range lo": lo, "λ range hi": hi})])


@dataclass(frozen=True)
class MatchOptions:
    """Everything a pairwise matcher reads: the form the states are in, and each method's own options (a method's
    registry entry names the ones it reads: :attr:`glmc.match.registry.Method.options`)."""

    form: Form = "standard"
    weight: WeightOptions = field(default_factory=WeightOptions)
    activation: ActivationOptions = field(default_factory=ActivationOptions)
    learn: LearnConfig = field(default_factory=LearnConfig)
    symmetry: SymmetryOptions = field(default_factory=SymmetryOptions)

