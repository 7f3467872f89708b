"""The run configuration, read once: `[tool.flwr.app.config]` (kebab-case) → one frozen dataclass.

The ServerApp and every ClientApp parse the same keys with this one parser, so the two sides can
never disagree on a default. flwr checks that an override names a known key but not its type,
so each value is coerced here and a wrong one is a one-line ConfigError naming the key.

:class:`RunSettings` holds the run's own keys, and in sections the library's options that keys set: weight
matching's (``weight-*``), the learned refinement's (``refine-*``, ``server-steps``), robust aggregation's, the
corrections', and :class:`Deployment`'s. Each section declares its keys on its fields
(:func:`glmc.core.options.option`) and validates itself once.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from glmc.core.options import coerce, from_keys, keyed, option, to_keys
from glmc.device import check_name
from glmc.errors import ConfigError, check_options
from glmc.match.options import TARGETS, LearnConfig, MatchOptions, SymmetryOptions, Targets, WeightOptions
from glmc.match.registry import METHODS
from glmc.merging.corrections import Corrections
from glmc.merging.options import MergeOptions
from glmc.merging.robust import Robustness


@dataclass(frozen=True)
class Aggregation:
    """One FL aggregation: the glmc merge method its universe matching runs (glmc.match.registry), or None for the
    aggregations that do not align (HeteroFL's width slices, or the server's own model)."""

    name: str
    method: str | None
    # a control for the server-held data: what its samples are worth with no alignment. fedavg-ft trains FedAvg's
    # model on them, server-only the server's own model, ignoring the clients; both with the same budget
    control: bool = False
    # the width-heterogeneous baselines (HeteroFL's protocol): FedRolex's narrow clients hold a window of every
    # width axis that rolls one unit a round (glmc.merging.heterofl); smallest-width trains every client at the run's
    # smallest tier, the global model being that narrow one; full-width-only averages the full tier's replies only,
    # the narrow clients sampled, sent work and left out as the papers' "largest model on the clients that can hold
    # it" control, so that its rounds sample the same share of the nodes as HeteroFL's and FedRolex's
    rolls: bool = False
    smallest: bool = False
    full_only: bool = False
    # FjORD's clients hold HeteroFL's leading slice and train, at every local step, its leading sub-model at a tier
    # of width-tiers up to their own drawn uniformly (Ordered Dropout, glmc.ordered_dropout); the server averages as
    # HeteroFL does
    ordered: bool = False

    @property
    def averages(self) -> bool:
        """Whether it averages the clients' width slices, untrained and unaligned: FedAvg exactly at equal widths."""
        return self.method is None and not self.control

    def offset(self, server_round: int) -> int:
        """Where round ``server_round``'s narrow windows start (glmc.merging.heterofl): the round for FedRolex, the
        leading slice (0) for the others."""
        return server_round if self.rolls else 0

    @property
    def reads_data(self) -> bool:
        """Whether it reads the server-held batch (server-data)."""
        return self.control or (self.method is not None and METHODS[self.method].reads_data)

    @property
    def reads_labels(self) -> bool:
        """Whether it reads the server-held labels, not only the inputs (activation, refit and repair read inputs)."""
        return self.control or (self.method is not None and METHODS[self.method].reads_labels)

    @property
    def guarded(self) -> bool:
        """Whether min-alignment-gain may set its alignment aside for a round (its method's property)."""
        return self.method is not None and METHODS[self.method].guarded

    @property
    def refines(self) -> bool:
        """Whether its merge ends in the learned refinement (its method's property)."""
        return self.method is not None and METHODS[self.method].refines


AGGREGATION_TABLE: dict[str, Aggregation] = {a.name: a for a in (
    Aggregation("fedavg", None),
    Aggregation("weight", "weight"),
    Aggregation("activation", "activation"),
    Aggregation("learned", "learned"),
    Aggregation("canonical", "none"),  # the ablation: the aligned path's canonical form and merge, no matching
    Aggregation("fedavg-ft", None, control=True),
    Aggregation("server-only", None, control=True),
    Aggregation("fedrolex", None, rolls=True),
    Aggregation("smallest-width", None, smallest=True),
    Aggregation("full-width-only", None, full_only=True),
    Aggregation("fjord", None, ordered=True),
)}
AGGREGATIONS = tuple(AGGREGATION_TABLE)
DATA_AGGREGATIONS = tuple(a.name for a in AGGREGATION_TABLE.values() if a.reads_data)
CONTROLS = tuple(a.name for a in AGGREGATION_TABLE.values() if a.control)
LABEL_AGGREGATIONS = tuple(a.name for a in AGGREGATION_TABLE.values() if a.reads_labels)
SLICED = tuple(a.name for a in AGGREGATION_TABLE.values() if a.method is None)
AVERAGING = tuple(a.name for a in AGGREGATION_TABLE.values() if a.averages)
GUARDED = tuple(a.name for a in AGGREGATION_TABLE.values() if a.guarded)
REFINED = tuple(a.name for a in AGGREGATION_TABLE.values() if a.refines)
INITS = ("shared", "independent")
SERVER_DATA_SOURCES = ("split", "generated")
AUTO = "auto"  # partitioner: chosen by the dataset (default_partitioner)
# refine-targets: "auto" (the key's stand-in for LearnConfig's None: chosen by the server data's source,
# RunSettings.targets), or one of LearnConfig's
REFINE_TARGETS = (keyed(LearnConfig)["refine-targets"].none, *TARGETS)
# Where a narrow client gets the global model: where alignment last put it, or the principal subspace.
NARROW_PLACEMENTS = ("aligned", "principal")
SAMPLINGS = ("seeded", "flwr")
# what label-mask puts in the logits of the labels a client's share lacks: 0 (HeteroFL's masked cross-entropy), or
# they leave the softmax (FedRS's restricted softmax at alpha = 0): each choice and the value that logit takes
LABEL_MASK_FILLS = {"zero": 0.0, "exclude": -math.inf}
# lr-decay's step schedules (HeteroFL's MultiStepLR, by the share of the rounds done at each milestone): "step" is
# its MNIST non-IID one (milestone 200 of 400 rounds), "multistep" its CIFAR non-IID one (300 and 500 of 800)
DECAY_MILESTONES = {"step": (Fraction(1, 2),), "multistep": (Fraction(3, 8), Fraction(5, 8))}
LR_DECAYS = ("none", "cosine", *DECAY_MILESTONES)
STEP_DECAY = 0.1  # the rate is multiplied by this at every milestone passed
ATTACKS = ("none", "inflate", "scale", "signflip", "replace", "constant")  # client.attacks (a test hook)
LABEL_SPLITS = ("iid", "dirichlet", "pathological", "shard")
NATURAL_SPLITS = ("role", "play")  # Shakespeare's natural clients (LEAF): one per speaking role or play
PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")  # a run's folder name under output-dir, never a path


def decayed_lr(lr: float, decay: str, span: int, server_round: int) -> float:
    """Base ``lr`` in round ``server_round`` (1-based) of ``decay`` (an lr-decay) over ``span`` rounds; the rounds
    after ``span`` keep its last round's rate."""
    if decay == "none":
        return lr
    done = min(server_round, span) - 1
    if decay in DECAY_MILESTONES:
        return lr * STEP_DECAY ** sum(done >= share * span for share in DECAY_MILESTONES[decay])
    return lr * 0.5 * (1 + math.cos(math.pi * done / span))


def default_partitioner(dataset: str) -> str:
    """The split ``partitioner = "auto"`` gives a dataset: a text's natural clients (Shakespeare's speaking roles),
    else Dirichlet label skew of labelled images (federation.preflight says which splits fit which dataset)."""
    return "role" if dataset == "shakespeare" else "dirichlet"


def places_principal(aggregation: str, narrow_placement: str) -> bool:
    """Whether narrow clients get the global model's principal subspace: HeteroFL's slices (SLICED) stay fixed."""
    return narrow_placement == "principal" and aggregation not in SLICED


@dataclass(frozen=True)
class Deployment:
    """How a round meets its nodes: the share it samples, how many it waits for and needs, and how long it waits."""

    fraction_train: float = option(1.0, "share of the connected nodes sampled to train each round", flag=None,
                                   key="fraction-train")
    # seeded: a round's sample is drawn from the nodes' partition ids by the run's seed and the round
    # (server.sampling), so runs of one seed train the same clients; flwr: FedAvg's own, unseeded, by node id
    sampling: str = option("seeded", "how a round samples the nodes it trains and evaluates: seeded (by seed and "
                           "round, over partition ids: runs of one seed train the same clients) or flwr (unseeded)",
                           flag=None, key="sampling")
    fraction_evaluate: float = option(0.0, "federated evaluation on each client's held-out 10%", flag=None,
                                      key="fraction-evaluate")
    min_train_nodes: int = option(2, "fewer valid replies than this keep the global model for the round", flag=None,
                                  key="min-train-nodes")
    min_available_nodes: int = option(0, "connected nodes a round waits for before it samples (0 = min-train-nodes)",
                                      flag=None, key="min-available-nodes")
    # The slowest published round took 625 s under load (oneshot: many local epochs and the logit ensemble); 20
    # minutes leaves twice that.
    round_timeout: float = option(1200.0, "seconds to wait for a round's replies; late or missing nodes count as "
                                  "failed", flag=None, key="round-timeout")
    # flwr's own wait has no deadline
    node_wait_timeout: float = option(600.0, "seconds a round waits for min-available-nodes (at least "
                                      "min-train-nodes) to connect before it is skipped, the global model kept and "
                                      "the reason recorded", flag=None, key="node-wait-timeout")

    def __post_init__(self) -> None:
        _require(self.sampling in SAMPLINGS, f"sampling must be one of {SAMPLINGS}, got {self.sampling!r}")
        _require(0 < self.fraction_train <= 1 and 0 <= self.fraction_evaluate <= 1,
                 "fraction-train must be in (0, 1] and fraction-evaluate in [0, 1]")
        _require(self.min_train_nodes >= 1 and self.min_available_nodes >= 0,
                 "min-train-nodes must be >= 1 and min-available-nodes >= 0")
        _require(self.round_timeout > 0 and self.node_wait_timeout > 0,
                 f"round-timeout and node-wait-timeout must be positive, got {self.round_timeout} and "
                 f"{self.node_wait_timeout}")


SECTIONS: dict[str, type] = {"symmetry": SymmetryOptions, "weight": WeightOptions, "learn": LearnConfig,
                             "robustness": Robustness,
                             "corrections": Corrections, "deployment": Deployment}


@dataclass(frozen=True)
class RunSettings:
    """Every knob of a federated run: the run's own keys (field ``x_y`` is run-config key ``x-y``), then the
    sections, each the library's options dataclass with the keys its fields declare."""

    model: str = "vit-tiny"  # a glmc preset
    dataset: str = "fashion-mnist"
    partitioner: str = "auto"  # auto (default_partitioner) | iid | dirichlet | pathological | shard | role | play
    alpha: float = 0.5  # Dirichlet concentration
    classes_per_client: int = 2  # k of the pathological and shard splits
    num_server_rounds: int = 3
    local_epochs: int = 1
    local_steps: int = 0  # cap on optimizer steps per round (0 = whole epochs); keeps smoke runs short
    aggregation: str = "fedavg"
    width_tiers: tuple[float, ...] = (1.0,)  # width multipliers, tier of partition p = tiers[p mod len]
    # independent: round 1 starts every client from its own seed; a path: from that checkpoint (glmc, Hugging Face or
    # timm; its config replaces the model preset's), or from checkpoint p mod n of a folder of n for partition p
    init: str = "shared"
    seed: int = 0
    output_dir: str = "outputs"
    run_name: str = ""  # outputs/<run-name>/; empty = "run-<flwr run id>"; a plain name (letters, digits, . - _)
    resume: bool = False  # continue outputs/<run-name>/ from its last checkpoint
    batch_size: int = 0  # 0 = the dataset's measured default
    lr: float = 0.0  # 0 = the dataset's measured default
    # the clients' learning rate across rounds: none (every round starts at lr) | cosine (round r of R starts at
    # lr·½(1 + cos(π(r−1)/R))) | step (lr for the first half of the rounds, lr/10 after: HeteroFL's MNIST non-IID
    # schedule) | multistep (lr/10 after 3/8 of the rounds, lr/100 after 5/8: its CIFAR non-IID one); a step
    # schedule's last rounds settle at the lower rate, so a run's plateau can be read off its last 20%
    lr_decay: str = "none"
    # the rounds lr-decay spans (0 = num-server-rounds); the rounds after keep its last rate, so a run can go on at
    # the final rate until it settles, and a finished run can be extended (resume) without changing a round it ran
    lr_decay_rounds: int = 0
    # HeteroFL's masked cross-entropy (its label-skewed runs, and FedRolex's after it): in a client's training loss
    # the logits of the labels its share lacks are 0, so its local steps do not push down the classes it never sees;
    # label splits only (a text client's targets are characters, not labels)
    label_mask: bool = False
    # what label-mask puts in those logits: "zero" (HeteroFL's) or "exclude", which takes them out of the softmax
    # (FedRS's restricted softmax at alpha = 0): a client's loss is then the same whatever constant its own labels'
    # logits share, so its local steps cannot raise the classes it holds over the ones it never sees, the drift by
    # which the sampled classes tilt a round's global model on a class-shards split
    label_mask_fill: str = "zero"
    # training dropout (embeddings, attention weights, residual writes) of the clients and of the server's own
    # training in fedavg-ft and server-only; -1 = the model's own (the preset's or the init checkpoint's). Seeds
    # trained with it match better (docs/methods.md, dropout and connectivity)
    dropout: float = -1.0
    # server momentum (FedAvgM; server.momentum): the global model steps by server-learning-rate times the way to the
    # round's merge plus server-momentum times the step it took the round before; 1 and 0 keep the merge itself
    server_learning_rate: float = 1.0
    server_momentum: float = 0.0
    server_data: int = 0  # training samples held back from every client, for activation/learned alignment
    # where the server-held data comes from: "split" = held back from every client's share (above); "generated" =
    # each round, server-data windows of text the round's client models write themselves (glmc.data.generated; language
    # models only), so that the server holds no data at all and no client gives any up
    server_data_source: str = "split"
    # of the server-data samples held back, how many the server reads: a seeded subset (0 = all of them), so that a
    # grid can vary what the server reads while every client's share stays what server-data left it
    server_reads: int = 0
    train_limit: int = 0  # training images the clients share between them, a seeded subset (0 = all); vision only
    eval_limit: int = 0  # central test samples per evaluation (0 = the whole test set)
    align_iters: int = 1  # universe iterations: 1 = align to the previous global model, more iterate U = mean
    align_workers: int = 1  # processes for each iteration's N pairwise alignments
    # where a narrow client gets the global model (glmc.merging.widths): "principal" = the heads, MLP units and residual
    # subspace holding most of the global weights; "aligned" = where alignment last put it. Aligned aggregations
    # only (HeteroFL's fedavg keeps its fixed slices). Over HeteroFL on 5 seeds, principal gave weight +1.5 and
    # learned +2.4 points where aligned gave −0.2 and (3 seeds) −1.1 (simulations/results/widths-principal, widths)
    narrow_placement: str = "principal"
    # drop the replies identical to the model their node was sent (free riders, stragglers that trained no step) with
    # that reason; false: they count, as FedAvg counts them, pulling the average toward the global model by their weight
    drop_unchanged: bool = False
    # weight / activation (others ignore it): when matching brings the clients less than this fraction closer (mean
    # pairwise distance, 1 − after / before), that round merges them unmatched: FedAvg at equal widths, the clients
    # where the server placed them across widths (the canonical ablation's merge). 0 = always keep the alignment.
    # Clients fine-tuned from one global model are already aligned (matching gained 0.6–2% there), and matching their
    # noise cost FedAvg points under drift (simulations/results/drift-seeds); independently initialised clients gain
    # 13–15% (simulations/results/oneshot)
    min_alignment_gain: float = 0.05
    ensemble_eval: bool = False  # also evaluate the logit ensemble of each round's client models
    # each client scores its freshly trained model on the central test subset (eval-limit samples): the summary's
    # clients % column, at about half of a vit-fl client's training time (2,000 images against 34 steps); false
    # leaves it out of the reply and the round
    client_test: bool = True
    # the central accuracy whose first round each width tier's model reaches (the summary's rounds-to-target)
    target_accuracy: float = 0.7
    # write each round's valid client models to <run>/clients/round-NNN/client-K.safetensors (offline merging)
    save_clients: bool = False
    client_threads: int = 1  # torch threads per ClientApp (the simulation gives each client one CPU)
    # where clients train and evaluate: auto (the GPU the node sees, if any), cpu, cuda, cuda:N; a node's own
    # node-config key `device` overrides it. In simulation a client sees a GPU only with client-resources-num-gpus > 0
    client_device: str = "auto"
    server_device: str = "auto"  # where the server aligns, merges and evaluates (same names)
    fault_partition: int = -1  # TEST HOOK: this partition replies NaN weights (-1 = off)
    attack: str = "none"  # TEST HOOK: the attack-partition's well-formed hostile reply (client.attacks.ATTACKS)
    attack_partition: int = -1  # TEST HOOK: the partition that attacks (-1 = none)
    symmetry: SymmetryOptions = field(default_factory=SymmetryOptions)  # group: the part of the group searched
    weight: WeightOptions = field(default_factory=WeightOptions)  # weight-*: weight matching, everywhere it runs
    learn: LearnConfig = field(default_factory=LearnConfig)  # refine-*, server-steps: the learned refinement
    robustness: Robustness = field(default_factory=Robustness)  # the defences (glmc.merging.robust)
    corrections: Corrections = field(default_factory=Corrections)  # restore-norms, repair, refit, circuit-heads
    deployment: Deployment = field(default_factory=Deployment)  # how rounds sample, wait for and need nodes

    def __post_init__(self) -> None:
        if self.partitioner == AUTO:
            object.__setattr__(self, "partitioner", default_partitioner(self.dataset))
        _require(self.aggregation in AGGREGATIONS,
                 f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        _require(self.init in INITS or Path(self.init).exists(),
                 f"init must be one of {INITS} or a checkpoint path, got {self.init!r} (no such file or folder)")
        splits = LABEL_SPLITS + NATURAL_SPLITS
        _require(self.partitioner in splits, f"partitioner must be one of {splits}, got {self.partitioner!r}")
        _require(bool(self.width_tiers) and all(0 < t <= 1 for t in self.width_tiers),
                 f"width-tiers must be multipliers in (0, 1], got {self.width_tiers}")
        _require(self.num_server_rounds >= 1 and self.local_epochs >= 1,
                 "num-server-rounds and local-epochs must be >= 1")
        _require(min(self.local_steps, self.batch_size, self.server_data, self.train_limit, self.eval_limit) >= 0,
                 "local-steps, batch-size, server-data, train-limit and eval-limit must be >= 0")
        _require(not self.train_limit or self.partitioner in LABEL_SPLITS,
                 f"train-limit subsamples labelled images; the natural {self.partitioner!r} clients keep their "
                 "own text (cap local-steps instead)")
        _require(not self.label_mask or self.partitioner in LABEL_SPLITS,
                 f"label-mask masks the labels a client's share lacks: label splits only, not the natural "
                 f"{self.partitioner!r} clients")
        _require(self.server_learning_rate > 0 and 0 <= self.server_momentum < 1,
                 f"server-learning-rate must be > 0 and server-momentum in [0, 1), got {self.server_learning_rate} "
                 f"and {self.server_momentum}")
        _require(self.label_mask_fill in LABEL_MASK_FILLS,
                 f"label-mask-fill must be one of {tuple(LABEL_MASK_FILLS)}, got {self.label_mask_fill!r}")
        _require(self.label_mask or self.label_mask_fill == "zero",
                 f"label-mask-fill {self.label_mask_fill!r} says what label-mask puts in the absent labels' logits: "
                 "set label-mask = true")
        check_options("run config", [
            ("finite and > 0", lambda v: math.isfinite(v) and v > 0, {"alpha": self.alpha}),
            ("finite and ≥ 0 (0: the dataset's default)", lambda v: math.isfinite(v) and v >= 0, {"lr": self.lr}),
            ("in [0, 1), or -1 (the model's own)", lambda v: v == -1 or 0 <= v < 1, {"dropout": self.dropout}),
            ("≥ 1", lambda v: v >= 1, {"classes-per-client": self.classes_per_client}),
            ("≥ 0", lambda v: v >= 0, {"seed": self.seed})])
        _require(not self.run_name or (PLAIN_NAME.fullmatch(self.run_name) is not None and ".." not in self.run_name),
                 f"run-name must be a plain name (letters, digits, '.', '-', '_'; not a path), got {self.run_name!r}")
        for key, value in (("client-device", self.client_device), ("server-device", self.server_device)):
            try:
                check_name(value)
            except ConfigError as err:
                raise ConfigError(f"{key}: {err}") from None
        _require(min(self.align_iters, self.align_workers, self.client_threads) >= 1,
                 "align-iters, align-workers and client-threads must be >= 1")
        _require(self.lr_decay in LR_DECAYS, f"lr-decay must be one of {LR_DECAYS}, got {self.lr_decay!r}")
        _require(self.lr_decay_rounds >= 0, f"lr-decay-rounds must be >= 0, got {self.lr_decay_rounds}")
        _require(self.narrow_placement in NARROW_PLACEMENTS,
                 f"narrow-placement must be one of {NARROW_PLACEMENTS}, got {self.narrow_placement!r}")
        _require(0 <= self.min_alignment_gain < 1, f"min-alignment-gain must be in [0, 1), got "
                 f"{self.min_alignment_gain}")
        _require(self.attack in ATTACKS, f"attack must be one of {ATTACKS}, got {self.attack!r}")
        _require(self.robustness.weighted_mean or len(set(self.width_tiers)) == 1,
                 f"robust-average {self.robustness.average!r} takes coordinates of equal-width clients; width-tiers "
                 f"{self.width_tiers} mixes widths")
        _require(self.server_data_source in SERVER_DATA_SOURCES, f"server-data-source must be one of "
                 f"{SERVER_DATA_SOURCES}, got {self.server_data_source!r}")
        _require(self.aggregation not in DATA_AGGREGATIONS or self.server_data > 0,
                 f"aggregation {self.aggregation!r} uses server-held data: set server-data > 0")
        _require(not (AGGREGATION_TABLE[self.aggregation].smallest and self.init not in INITS),
                 f"smallest-width trains the smallest tier's model from a seed; init {self.init!r} is full width")
        _require(0 < self.target_accuracy <= 1, f"target-accuracy must be in (0, 1], got {self.target_accuracy}")
        _require(0 <= self.server_reads <= self.held_back, f"server-reads must be in [0, server-data held back = "
                 f"{self.held_back}], got {self.server_reads}")
        self._check_corrections()

    def _check_corrections(self) -> None:
        """The corrections change aligned merges, and refit and REPAIR read server-held data. circuit-heads refits
        aligned heads of one width to their weighted mean circuits: it would replace a median's heads by a mean. The
        model's layout is checked where it is known (server.app)."""
        fixes = self.corrections
        for key, on in (("circuit-heads", fixes.circuit_heads), ("restore-norms", fixes.restore_norms),
                        ("repair", fixes.repair != 0), ("refit", fixes.refit != 0)):
            _require(not (on and self.aggregation in SLICED),
                     f"{key} changes aligned merges; aggregation {self.aggregation!r} does not align")
        for key, on in (("repair", fixes.repair != 0), ("refit", fixes.refit != 0)):
            _require(not on or self.server_data > 0, f"{key} reads server-held data: set server-data > 0")
        if fixes.circuit_heads:
            _require(len(set(self.width_tiers)) == 1, f"circuit-heads needs clients of one width, got width-tiers "
                     f"{self.width_tiers}")
            _require(self.robustness.weighted_mean, f"circuit-heads averages circuits; robust-average "
                     f"{self.robustness.average!r} would lose its heads")

    def round_lr(self, lr: float, server_round: int) -> float:
        """The clients' learning rate in global round ``server_round`` (1-based) under lr-decay, from base ``lr``."""
        return decayed_lr(lr, self.lr_decay, self.lr_decay_rounds or self.num_server_rounds, server_round)

    @property
    def learn_options(self) -> LearnConfig:
        """The learned refinement's options, its targets resolved (:attr:`targets`)."""
        return dataclasses.replace(self.learn, targets=self.targets)

    @property
    def merge_options(self) -> MergeOptions:
        """How the server merges (:class:`glmc.merging.options.MergeOptions`): the aggregation's method, its matching,
        the universe iterations and workers, the corrections on all the server data, robustness, the guard and the
        device; a merge without matching folds the clients' norms (the canonical ablation)."""
        method = AGGREGATION_TABLE[self.aggregation].method or "none"
        match = MatchOptions(weight=self.weight, learn=self.learn_options, symmetry=self.symmetry)
        return MergeOptions(method, match, max_iters=self.align_iters, workers=self.align_workers,
                            corrections=self.corrections, robustness=self.robustness, min_gain=self.min_alignment_gain,
                            fold_norms=True, device=self.server_device)

    @classmethod
    def key_kinds(cls) -> dict[str, Any]:
        """Every run-config key and its type: the run's own fields', then each section's declared keys'."""
        hints = typing.get_type_hints(cls)
        own = {f.name.replace("_", "-"): hints[f.name] for f in dataclasses.fields(cls) if f.name not in SECTIONS}
        return own | {key: d.key_kind for section in SECTIONS.values() for key, d in keyed(section).items()}

    @classmethod
    def from_run_config(cls, config: Mapping[str, Any]) -> RunSettings:
        """Parse a flwr run config; unknown keys and values of the wrong type raise ConfigError."""
        kinds = cls.key_kinds()
        unknown = sorted(set(config) - set(kinds))
        _require(not unknown, f"unknown run-config keys: {unknown}")
        own = {key.replace("-", "_"): coerce(key, kinds[key], value) for key, value in config.items()
               if key.replace("-", "_") not in SECTIONS and not any(key in keyed(c) for c in SECTIONS.values())}
        return cls(**own, **{name: from_keys(section, config) for name, section in SECTIONS.items()})

    def to_run_config(self) -> dict[str, Any]:
        """The kebab-case mapping ``from_run_config`` reads (width-tiers as "1,0.5")."""
        out = {f.name.replace("_", "-"): getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in SECTIONS}
        out["width-tiers"] = ",".join(f"{t:g}" for t in self.width_tiers)
        return out | {key: value for name in SECTIONS for key, value in to_keys(getattr(self, name)).items()}

    def server_data_read(self) -> str:
        """What the aggregation reads of the server-held data: "labels" (and inputs), "inputs" only, "generated"
        (text the clients' models wrote: no data), or "none"."""
        fixes = self.corrections
        reads = "inputs" if self.aggregation in DATA_AGGREGATIONS or fixes.refit != 0 or fixes.repair != 0 else "none"
        if reads != "none" and self.server_data_source == "generated":
            return "generated"
        labels = self.aggregation in LABEL_AGGREGATIONS and self.targets == "labels"
        return "labels" if labels else reads

    @property
    def targets(self) -> Targets:
        """What learned's refinement (and, for endpoints, the controls' training) scores against: refine-targets,
        "auto" resolved by the server data's source."""
        if self.learn.targets is not None:
            return self.learn.targets
        return "endpoints" if self.server_data_source == "generated" else "labels"

    @property
    def held_back(self) -> int:
        """Training samples held back from the clients for the server: none when it generates its data."""
        return self.server_data if self.server_data_source == "split" else 0

    @property
    def generated(self) -> int:
        """Windows of text the server has its clients' models write each round: none when it holds data back or
        the aggregation reads none (weight matching alone would sample text for nothing)."""
        return self.server_data if self.server_data_read() == "generated" else 0

    @property
    def init_checkpoints(self) -> list[Path]:
        """The checkpoints ``init`` names: none for shared and independent starts, one, or a folder's."""
        from glmc.io.formats import checkpoint_paths

        return [] if self.init in INITS else checkpoint_paths(self.init)

    @property
    def independent_start(self) -> bool:
        """Whether round 1's clients start from unrelated models: their own seeds, or a folder of checkpoints."""
        return self.init == "independent" or len(self.init_checkpoints) > 1

    def tier_of(self, partition_id: int, declared: float | None = None) -> float:
        """The width tier a partition trains at, relative to the global model: ``declared`` (its node config's), else
        width-tiers mapped over partitions; 1 for every one under smallest-width, whose global model is the smallest
        tier's (:attr:`global_width`)."""
        if AGGREGATION_TABLE[self.aggregation].smallest:
            return 1.0
        return declared if declared is not None else self.width_tiers[partition_id % len(self.width_tiers)]

    def ordered_tiers(self, tier: float) -> tuple[float, ...]:
        """The tiers a client of ``tier`` trains at, relative to the global model: its own, and under fjord every tier
        of width-tiers below it too, one drawn uniformly per local step (FjORD's Ordered Dropout)."""
        below = sorted({t for t in self.width_tiers if t < tier}, reverse=True)
        return (tier, *below) if AGGREGATION_TABLE[self.aggregation].ordered else (tier,)

    @property
    def global_width(self) -> float:
        """The global model's width multiplier of the model preset: the smallest tier for smallest-width, else 1."""
        return min(self.width_tiers) if AGGREGATION_TABLE[self.aggregation].smallest else 1.0

    @property
    def trained_tiers(self) -> tuple[float, ...]:
        """The tiers clients train at, relative to the global model (the replies' shapes)."""
        return (1.0,) if AGGREGATION_TABLE[self.aggregation].smallest else self.width_tiers

    def run_dir(self, run_id: int) -> Path:
        """Where this run's metrics, checkpoints and plots go."""
        return Path(self.output_dir) / (self.run_name or f"run-{run_id}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
