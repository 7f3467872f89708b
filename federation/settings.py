"""The run configuration, read once: `[tool.flwr.app.config]` (kebab-case) → one frozen dataclass.

The ServerApp and every ClientApp parse the same keys with this one parser, so the two sides can
never disagree on a default. flwr checks that an override names a known key but not its type,
so each value is coerced here and a wrong one is a one-line ConfigError naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from glmc.device import check_name
from glmc.errors import ConfigError, check_options
from glmc.match.learned import TARGETS, WITHIN, LearnConfig, Targets, Within
from glmc.match.options import MatchOptions
from glmc.match.registry import METHODS
from glmc.match.weight import STARTS, Start, WeightOptions
from glmc.merging.corrections import ALL, Corrections
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
    guarded: bool = False  # min-alignment-gain may set its alignment aside for a round (matching only, no refinement)

    @property
    def reads_data(self) -> bool:
        """Whether it reads the server-held batch (server-data)."""
        return self.control or (self.method is not None and METHODS[self.method].reads_data)

    @property
    def reads_labels(self) -> bool:
        """Whether it reads the server-held labels, not only the inputs (activation, refit and repair read inputs)."""
        return self.control or (self.method is not None and METHODS[self.method].reads_labels)


AGGREGATION_TABLE: dict[str, Aggregation] = {a.name: a for a in (
    Aggregation("fedavg", None),
    Aggregation("weight", "weight", guarded=True),
    Aggregation("activation", "activation", guarded=True),
    Aggregation("learned", "learned"),
    Aggregation("canonical", "none"),  # the ablation: the aligned path's canonical form and merge, no matching
    Aggregation("fedavg-ft", None, control=True),
    Aggregation("server-only", None, control=True),
)}
AGGREGATIONS = tuple(AGGREGATION_TABLE)
DATA_AGGREGATIONS = tuple(a.name for a in AGGREGATION_TABLE.values() if a.reads_data)
CONTROLS = tuple(a.name for a in AGGREGATION_TABLE.values() if a.control)
LABEL_AGGREGATIONS = tuple(a.name for a in AGGREGATION_TABLE.values() if a.reads_labels)
SLICED = tuple(a.name for a in AGGREGATION_TABLE.values() if a.method is None)
GUARDED = tuple(a.name for a in AGGREGATION_TABLE.values() if a.guarded)
INITS = ("shared", "independent")
SERVER_DATA_SOURCES = ("split", "generated")
AUTO = "auto"  # refine-targets: chosen by the server data's source (RunSettings.targets); partitioner: by the dataset
REFINE_TARGETS = (AUTO, *TARGETS)
# Where a narrow client gets the global model: where alignment last put it, or the principal subspace.
NARROW_PLACEMENTS = ("aligned", "principal")
ATTACKS = ("none", "inflate", "scale", "signflip", "replace", "constant")  # client.attacks (a test hook)
LABEL_SPLITS = ("iid", "dirichlet", "pathological", "shard")
NATURAL_SPLITS = ("role", "play")  # Shakespeare's natural clients (LEAF): one per speaking role or play
PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")  # a run's folder name under output-dir, never a path


def default_partitioner(dataset: str) -> str:
    """The split ``partitioner = "auto"`` gives a dataset: a text's natural clients (Shakespeare's speaking roles),
    else Dirichlet label skew of labelled images (federation.preflight says which splits fit which dataset)."""
    return "role" if dataset == "shakespeare" else "dirichlet"


def places_principal(aggregation: str, narrow_placement: str) -> bool:
    """Whether narrow clients get the global model's principal subspace: HeteroFL's slices (SLICED) stay fixed."""
    return narrow_placement == "principal" and aggregation not in SLICED


@dataclass(frozen=True)
class RunSettings:
    """Every knob of a federated run. Field ``x_y`` is run-config key ``x-y``."""

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
    fraction_train: float = 1.0
    fraction_evaluate: float = 0.0  # federated evaluation on each client's held-out 10%
    min_train_nodes: int = 2  # fewer valid replies than this keep the global model for the round
    min_available_nodes: int = 0  # connected nodes a round waits for before it samples (0 = min-train-nodes)
    # seconds to wait for a round's replies; late or missing nodes count as failed. The slowest published round took
    # 625 s under load (oneshot: many local epochs and the logit ensemble); 20 minutes leaves twice that
    round_timeout: float = 1200.0
    # seconds a round waits for min-available-nodes (at least min-train-nodes) to connect before it is skipped, with
    # the global model kept and the reason recorded; flwr's own wait has no deadline
    node_wait_timeout: float = 600.0
    seed: int = 0
    output_dir: str = "outputs"
    run_name: str = ""  # outputs/<run-name>/; empty = "run-<flwr run id>"; a plain name (letters, digits, . - _)
    resume: bool = False  # continue outputs/<run-name>/ from its last checkpoint
    batch_size: int = 0  # 0 = the dataset's measured default
    lr: float = 0.0  # 0 = the dataset's measured default
    # training dropout (embeddings, attention weights, residual writes) of the clients and of the server's own
    # training in fedavg-ft and server-only; -1 = the model's own (the preset's or the init checkpoint's). Seeds
    # trained with it match better (docs/methods.md, dropout and connectivity)
    dropout: float = -1.0
    server_data: int = 0  # training samples held back from every client, for activation/learned alignment
    # where the server-held data comes from: "split" = held back from every client's share (above); "generated" =
    # each round, server-data windows of text the round's client models write themselves (glmc.data.generated; language
    # models only), so that the server holds no data at all and no client gives any up
    server_data_source: str = "split"
    # of the server-data samples held back, how many the server reads: a seeded subset (0 = all of them), so that a
    # grid can vary what the server reads while every client's share stays what server-data left it
    server_reads: int = 0
    # optimizer steps of learned's refinement and of the controls' training on the server data (0 = their epochs,
    # which shrink with it): one budget, whatever the server reads
    server_steps: int = 0
    train_limit: int = 0  # training images the clients share between them, a seeded subset (0 = all); vision only
    eval_limit: int = 0  # central test samples per evaluation (0 = the whole test set)
    align_iters: int = 1  # universe iterations: 1 = align to the previous global model, more iterate U = mean
    align_workers: int = 1  # processes for each iteration's N pairwise alignments
    # learned: the refinement's mixing weights ~ Dirichlet(c·N·w); 10 stays near the weighted mean that becomes the
    # global model, the paper's 0.1 spreads them over the simplex (glmc.match.learned.LearnConfig.concentration)
    refine_concentration: float = 10.0
    # learned: the within-head maps the refinement learns: "orthogonal", "invertible" (every map of the head's QK and
    # OV circuits; 0.015 against 0.018 on vit-bench pairs, simulations/results/learning-budget) or "fixed"
    refine_within: str = "orthogonal"
    # learned: what the refinement scores the mixed model against on the server data: its "labels", or the clients'
    # own predictions mixed like their weights ("endpoints"; reads the inputs only); fedavg-ft and server-only then
    # train against the same mixed predictions (distillation), so that the controls read what learned reads. "auto":
    # endpoints on text the clients write (server-data-source "generated", whose labels are samples), else labels
    refine_targets: str = "auto"
    # refit every merged head to the clients' mean QK and OV circuits (glmc.merging.circuits); aligned only, clients of
    # one width, averaged by fedavg, q|k|v fused (GPT-2, ViT). On the official GLMC pair: B(0.5) 0.0824 → 0.0685
    circuit_heads: bool = False
    # rescale every merged MLP neuron and head to the clients' mean norm (glmc.merging.rescale); aligned only
    restore_norms: bool = False
    # reset every merged channel's mean and std to the clients' on the server-held data (REPAIR, glmc.merging.repair);
    # aligned aggregations only
    repair: bool = False
    # refit every merged linear layer to the clients' coverage-weighted mean output on the server-held data
    # (glmc.merging.refit); aligned aggregations only
    refit: bool = False
    # where a narrow client gets the global model (glmc.merging.widths): "principal" = the heads, MLP units and residual
    # subspace holding most of the global weights; "aligned" = where alignment last put it. Aligned aggregations
    # only (HeteroFL's fedavg keeps its fixed slices). Over HeteroFL on 5 seeds, principal gave weight +1.5 and
    # learned +2.4 points where aligned gave −0.2 and (3 seeds) −1.1 (simulations/results/widths-principal, widths)
    narrow_placement: str = "principal"
    # drop the replies identical to the model their node was sent (free riders, stragglers that trained no step) with
    # that reason; false: they count, as FedAvg counts them, pulling the average toward the global model by their weight
    drop_unchanged: bool = False
    # weight / activation at equal widths (others ignore it): when matching brings the clients less than this
    # fraction closer (mean pairwise distance, 1 − after / before), that round averages them unaligned, which is
    # FedAvg. 0 = always keep the alignment. Clients fine-tuned from one global model are already aligned (matching
    # gained 0.6–2% there), and matching their noise cost FedAvg points under drift (simulations/results/drift-seeds);
    # independently initialised clients gain 13–15% (simulations/results/oneshot)
    min_alignment_gain: float = 0.05
    # weight matching (weight, universe, and the learned methods' first step): its start (relaxed | identity |
    # embeddings), head cost (norm | squared), MLP cost (l1 | inner) and whether its residual Procrustes reads the
    # stream's biases (skip | read); glmc align's --start, --head-cost, --mlp-cost and --biases. Results published
    # before the first three keys ran identity, squared and inner, and before 2026-12-02 read (their configs pin them)
    weight_start: str = "relaxed"
    weight_head_cost: str = "norm"
    weight_mlp_cost: str = "inner"
    weight_biases: str = "skip"
    weight_ov_maps: str = "orthogonal"  # weight only: orthogonal | path (glmc align's --ov-maps)
    # Robust aggregation (glmc.merging.robust), on every aggregation, where the clients are averaged (after alignment).
    # The defaults hold one attacker among three honest clients (simulations/results/single-attacker).
    # a node's num-examples is capped at this multiple of the round's lower median (0 = off); the published splits
    # reach 3.84 (drift, Dirichlet 0.1, seed 0)
    max_examples_ratio: float = 5.0
    # ... at this multiple of the largest other node's (0 = off; the published splits reach 1.54) ...
    peer_examples_ratio: float = 1.6
    # ... and, with four or more replies, at a common level under which no node keeps more than this share of the
    # round (0 = off; none then takes half; the published splits reach 0.46)
    max_examples_share: float = 0.49
    max_examples: int = 0  # a declared per-node budget of num-examples, the cap of every node (0 = none)
    # a client farther from the global model than this multiple of the lower median client's distance is pulled back
    # to it along its update, before and after matching (0 = off)
    clip_ratio: float = 5.0
    # then, at equal widths, a client farther from the round's coordinate-wise median than this multiple of the lower
    # median client's distance is pulled back toward it (0 = off)
    center_clip_ratio: float = 1.0
    # ... times a node's (capped) num-examples over the lower median node's, where larger: trained by whole epochs, a
    # node with k times the examples takes k times the steps and sits farther out (false: one bound for all)
    center_clip_by_examples: bool = True
    # fedavg (the weighted mean) | fedmedian | fedtrimmedavg: Flower's FedMedian and FedTrimmedAvg, unweighted, of the
    # aligned clients; equal widths only
    robust_average: str = "fedavg"
    trim_beta: float = 0.2  # fedtrimmedavg: the fraction cut from each end of every coordinate (Flower's beta)
    ensemble_eval: bool = False  # also evaluate the logit ensemble of each round's client models
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
        _require(min(self.local_steps, self.batch_size, self.server_data, self.train_limit, self.eval_limit,
                     self.min_available_nodes) >= 0,
                 "local-steps, batch-size, server-data, train-limit, eval-limit and min-available-nodes must be >= 0")
        _require(not self.train_limit or self.partitioner in LABEL_SPLITS,
                 f"train-limit subsamples labelled images; the natural {self.partitioner!r} clients keep their "
                 "own text (cap local-steps instead)")
        check_options("run config", [
            ("finite and > 0", lambda v: math.isfinite(v) and v > 0, {"alpha": self.alpha}),
            ("finite and ≥ 0 (0: the dataset's default)", lambda v: math.isfinite(v) and v >= 0, {"lr": self.lr}),
            ("in [0, 1), or -1 (the model's own)", lambda v: v == -1 or 0 <= v < 1, {"dropout": self.dropout}),
            ("≥ 1", lambda v: v >= 1, {"classes-per-client": self.classes_per_client}),
            ("≥ 0", lambda v: v >= 0, {"seed": self.seed})])
        _require(self.round_timeout > 0 and self.node_wait_timeout > 0,
                 f"round-timeout and node-wait-timeout must be positive, got {self.round_timeout} and "
                 f"{self.node_wait_timeout}")
        _require(not self.run_name or (PLAIN_NAME.fullmatch(self.run_name) is not None and ".." not in self.run_name),
                 f"run-name must be a plain name (letters, digits, '.', '-', '_'; not a path), got {self.run_name!r}")
        for key, value in (("client-device", self.client_device), ("server-device", self.server_device)):
            try:
                check_name(value)
            except ConfigError as err:
                raise ConfigError(f"{key}: {err}") from None
        _require(self.refine_concentration > 0,
                 f"refine-concentration must be positive, got {self.refine_concentration}")
        _require(self.refine_within in WITHIN, f"refine-within must be one of {WITHIN}, got {self.refine_within!r}")
        _require(self.refine_targets in REFINE_TARGETS,
                 f"refine-targets must be one of {REFINE_TARGETS}, got {self.refine_targets!r}")
        _require(0 < self.fraction_train <= 1 and 0 <= self.fraction_evaluate <= 1,
                 "fraction-train must be in (0, 1] and fraction-evaluate in [0, 1]")
        _require(min(self.min_train_nodes, self.align_iters, self.align_workers, self.client_threads) >= 1,
                 "min-train-nodes, align-iters, align-workers and client-threads must be >= 1")
        if self.circuit_heads:
            self._check_circuit_heads()
        _require(not (self.restore_norms and self.aggregation in SLICED),
                 f"restore-norms rescales aligned merges; aggregation {self.aggregation!r} does not align")
        _require(not (self.repair and self.aggregation in SLICED),
                 f"repair resets aligned merges; aggregation {self.aggregation!r} does not align")
        _require(not self.repair or self.server_data > 0, "repair measures statistics on server-held data: set "
                 "server-data > 0")
        _require(not (self.refit and self.aggregation in SLICED),
                 f"refit fits aligned merges; aggregation {self.aggregation!r} does not align")
        _require(not self.refit or self.server_data > 0, "refit fits the layers on server-held data: set "
                 "server-data > 0")
        _require(self.narrow_placement in NARROW_PLACEMENTS,
                 f"narrow-placement must be one of {NARROW_PLACEMENTS}, got {self.narrow_placement!r}")
        _require(0 <= self.min_alignment_gain < 1, f"min-alignment-gain must be in [0, 1), got "
                 f"{self.min_alignment_gain}")
        _require(self.attack in ATTACKS, f"attack must be one of {ATTACKS}, got {self.attack!r}")
        _require(self.robust_average == "fedavg" or len(set(self.width_tiers)) == 1,
                 f"robust-average {self.robust_average!r} takes coordinates of equal-width clients; width-tiers "
                 f"{self.width_tiers} mixes widths")
        self.robustness  # noqa: B018  (checks the robust-aggregation keys)
        _require(self.weight_start in STARTS, f"weight-start must be one of {STARTS}, got {self.weight_start!r}")
        try:
            self.weight_options  # noqa: B018  (checks weight-head-cost, weight-mlp-cost, -biases and -ov-maps)
        except ConfigError as err:
            raise ConfigError(f"weight-head-cost / weight-mlp-cost / weight-biases / weight-ov-maps: {err}") from None
        _require(self.server_data_source in SERVER_DATA_SOURCES, f"server-data-source must be one of "
                 f"{SERVER_DATA_SOURCES}, got {self.server_data_source!r}")
        _require(self.aggregation not in DATA_AGGREGATIONS or self.server_data > 0,
                 f"aggregation {self.aggregation!r} uses server-held data: set server-data > 0")
        _require(0 <= self.server_reads <= self.held_back and self.server_steps >= 0,
                 f"server-reads must be in [0, server-data held back = {self.held_back}] and server-steps >= 0, got "
                 f"{self.server_reads} and {self.server_steps}")

    def _check_circuit_heads(self) -> None:
        """circuit-heads refits aligned heads of one width to their weighted mean circuits: it would replace a median's
        heads by a mean. The model's layout is checked where it is known (server.app)."""
        _require(self.aggregation not in SLICED,
                 f"circuit-heads merges aligned heads; aggregation {self.aggregation!r} does not align")
        _require(len(set(self.width_tiers)) == 1, f"circuit-heads needs clients of one width, got width-tiers "
                 f"{self.width_tiers}")
        _require(self.robust_average == "fedavg", f"circuit-heads averages circuits; robust-average "
                 f"{self.robust_average!r} would lose its heads")

    @property
    def robustness(self) -> Robustness:
        """The robust-aggregation settings (:class:`glmc.merging.robust.Robustness`)."""
        return Robustness(max_examples_ratio=self.max_examples_ratio, max_examples=self.max_examples,
                          clip_ratio=self.clip_ratio, peer_examples_ratio=self.peer_examples_ratio,
                          max_examples_share=self.max_examples_share,
                          center_clip_ratio=self.center_clip_ratio,
                          center_clip_by_examples=self.center_clip_by_examples, average=self.robust_average,
                          trim_beta=self.trim_beta)

    @property
    def weight_options(self) -> WeightOptions:
        """Weight matching's costs (:class:`glmc.match.weight.WeightOptions`)."""
        return WeightOptions(head_cost=self.weight_head_cost, mlp_cost=self.weight_mlp_cost,  # type: ignore[arg-type]
                             biases=self.weight_biases, ov_maps=self.weight_ov_maps)  # type: ignore[arg-type]

    @property
    def learn_options(self) -> LearnConfig:
        """The learned refinement's options (:class:`glmc.match.learned.LearnConfig`)."""
        return LearnConfig(concentration=self.refine_concentration, within=cast(Within, self.refine_within),
                           targets=self.targets, steps=self.server_steps or None)

    @property
    def merge_options(self) -> MergeOptions:
        """How the server merges (:class:`glmc.merging.options.MergeOptions`): the aggregation's method, its matching,
        the universe iterations and workers, the corrections on all the server data, robustness and the device."""
        method = AGGREGATION_TABLE[self.aggregation].method or "none"
        match = MatchOptions(learn=self.learn_options, start=cast(Start, self.weight_start),
                             weight=self.weight_options)
        corrections = Corrections(restore_norms=self.restore_norms, refit=ALL if self.refit else 0,
                                  repair=ALL if self.repair else 0, circuit_heads=self.circuit_heads)
        return MergeOptions(method, match, max_iters=self.align_iters, workers=self.align_workers,
                            corrections=corrections, robustness=self.robustness, min_gain=self.min_alignment_gain,
                            device=self.server_device)

    @classmethod
    def from_run_config(cls, config: Mapping[str, Any]) -> RunSettings:
        """Parse a flwr run config; unknown keys and values of the wrong type raise ConfigError."""
        fields = {f.name.replace("_", "-"): f for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - set(fields))
        _require(not unknown, f"unknown run-config keys: {unknown}")
        return cls(**{fields[key].name: _coerce(key, str(fields[key].type), value) for key, value in config.items()})

    def to_run_config(self) -> dict[str, Any]:
        """The kebab-case mapping ``from_run_config`` reads (width-tiers as "1,0.5")."""
        out = {f.name.replace("_", "-"): getattr(self, f.name) for f in dataclasses.fields(self)}
        out["width-tiers"] = ",".join(f"{t:g}" for t in self.width_tiers)
        return out

    def server_data_read(self) -> str:
        """What the aggregation reads of the server-held data: "labels" (and inputs), "inputs" only, "generated"
        (text the clients' models wrote: no data), or "none"."""
        reads = "inputs" if self.aggregation in DATA_AGGREGATIONS or self.refit or self.repair else "none"
        if reads != "none" and self.server_data_source == "generated":
            return "generated"
        labels = self.aggregation in LABEL_AGGREGATIONS and self.targets == "labels"
        return "labels" if labels else reads

    @property
    def targets(self) -> Targets:
        """What learned's refinement (and, for endpoints, the controls' training) scores against: refine-targets,
        "auto" resolved by the server data's source."""
        if self.refine_targets != AUTO:
            return cast(Targets, self.refine_targets)
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

    def tier_of(self, partition_id: int) -> float:
        """The width tier of a partition when its node config does not name one."""
        return self.width_tiers[partition_id % len(self.width_tiers)]

    def run_dir(self, run_id: int) -> Path:
        """Where this run's metrics, checkpoints and plots go."""
        return Path(self.output_dir) / (self.run_name or f"run-{run_id}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def parse_tiers(value: Any) -> tuple[float, ...]:
    """"1,0.5,0.25" (or one number) → (1.0, 0.5, 0.25)."""
    items = str(value).split(",") if isinstance(value, str) else [value]
    try:
        return tuple(float(item) for item in items)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"width-tiers must be comma-separated numbers, got {value!r}") from err


def _coerce(key: str, kind: str, value: Any) -> Any:
    """One run-config value as the field's type (annotations are strings under PEP 563)."""
    if kind == "tuple[float, ...]":
        return parse_tiers(value)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "false"):
            return str(value).lower() == "true"
    elif kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif kind == "float":
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif kind == "str" and isinstance(value, str):
        return value
    raise ConfigError(f"run-config key {key!r} must be {kind}, got {value!r}")
