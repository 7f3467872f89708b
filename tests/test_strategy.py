"""SymmetryAwareFedAvg on real flwr replies (Message / RecordDict / ArrayRecord built in-process).

FedAvg equality against flwr's own strategy, a weighted mean by hand, identity alignment of identical
clients, and every class of bad reply dropped with a reason while the global model stays unchanged.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import synthetic_images
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, Metadata, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity
from torch.utils.data import TensorDataset

from federation import protocol
from federation.protocol import Client
from federation.restriction import principal_placement, restrict
from federation.settings import RunSettings, places_principal
from glmc.archs import build_model, get_arch
from glmc.core.config import ModelConfig, preset, scale_width
from glmc.data.generated import generated_text
from glmc.errors import ConfigError
from glmc.io.checkpoint import CheckpointMeta, load_checkpoint
from glmc.match.options import LearnConfig, SymmetryOptions
from glmc.merging import heterofl
from glmc.merging.corrections import ALL, Corrections
from glmc.merging.evaluation import PredictionMixture
from glmc.merging.options import MergeOptions
from glmc.merging.refit import RIDGE, layer_rows
from glmc.merging.repair import channel_stats
from glmc.merging.robust import Robustness
from glmc.symmetry.canonical import canonicalize, to_model
from glmc.symmetry.transforms import MATCHABLE, apply, random_transform
from glmc.train import TrainConfig, evaluate, train
from server.aggregation import MergeResult, merge
from server.hooks import ClientsWriter, EnsembleEvaluator
from server.records import RoundHooks, RoundRecord
from server.strategy import SymmetryAwareFedAvg
from server.validation import ReplySchema, check_reply, split_replies

CFG = ModelConfig("vit", width=16, depth=1, heads=2, mlp=32, img_size=8, patch=4, num_classes=3)


def state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in build_model(CFG).state_dict().items()}


def metrics(examples: float | None = 10, **changes: object) -> MetricRecord:
    values: dict[str, object] = {key: 0.5 for key in protocol.TRAIN_METRICS} | {protocol.TIER_KEY: 1.0}
    values[protocol.WEIGHT_KEY] = examples
    values.update(changes)
    return MetricRecord({k: v for k, v in values.items() if v is not None})  # type: ignore[arg-type]


def instruction(node: int, arrays: ArrayRecord | None = None) -> Message:
    """The server's train instruction to ``node`` (as FedAvg builds it), with the metadata the SuperLink gives it."""
    meta = Metadata(run_id=1, message_id=f"m{node}", src_node_id=0, dst_node_id=node, reply_to_message_id="",
                    group_id="1", created_at=time.time(), ttl=3600.0, message_type=MessageType.TRAIN)
    content = RecordDict({protocol.CONFIG: ConfigRecord()} | ({protocol.ARRAYS: arrays} if arrays else {}))
    return Message(content, metadata=meta)


def reply(arrays: dict[str, torch.Tensor] | ArrayRecord, record: MetricRecord | None = None,
          node: int = 1) -> Message:
    """A train reply from ``node``, built the way flwr builds one: as a reply to an instruction."""
    arrays = arrays if isinstance(arrays, ArrayRecord) else ArrayRecord(arrays)  # type: ignore[arg-type]
    content = RecordDict({protocol.ARRAYS: arrays, protocol.METRICS: record or metrics()})
    return Message(content, reply_to=instruction(node))


def schema() -> ReplySchema:
    shapes = {k: tuple(v.shape) for k, v in state(0).items()}
    return ReplySchema({1.0: shapes})


def merge_options(learn: LearnConfig | None = None, restore_norms: bool = False, refit: bool = False,
                  repair: bool = False, **changes: Any) -> MergeOptions:
    """The strategy's default merge options (the run config's, on the CPU) with ``changes`` to MergeOptions' fields;
    ``learn`` is the matching's, and each correction asked for reads all the server data, as the run config's do."""
    base = RunSettings(server_device="cpu").merge_options
    corrections = Corrections(restore_norms, refit=ALL if refit else 0, repair=ALL if repair else 0)
    match = dataclasses.replace(base.match, learn=learn) if learn is not None else base.match
    return dataclasses.replace(base, match=match, corrections=corrections, **changes)


def strategy(aggregation: str = "fedavg", **kwargs: object) -> SymmetryAwareFedAvg:
    return SymmetryAwareFedAvg(aggregation, schema(), CFG, **({"min_train_nodes": 2} | kwargs))  # type: ignore[arg-type]


def as_numpy(arrays: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in arrays.items()}


def good_replies() -> list[Message]:
    return [reply(state(i), metrics(examples=n), node=i + 1) for i, n in enumerate((10, 20, 30))]


def test_fedavg_equals_flwr_fedavg() -> None:
    """Bit for bit, given the replies in the strategy's canonical order (float sums depend on the order)."""
    ours_arrays, ours_metrics = strategy().aggregate_train(1, good_replies())
    flwr_arrays, flwr_metrics = FedAvg().aggregate_train(1, split_replies(good_replies(), schema())[0])
    assert ours_arrays is not None and flwr_arrays is not None
    ours, theirs = as_numpy(ours_arrays), as_numpy(flwr_arrays)
    assert ours.keys() == theirs.keys()
    assert all(np.array_equal(ours[k], theirs[k]) for k in ours)
    assert dict(ours_metrics or {}) == dict(flwr_metrics or {})


@pytest.mark.parametrize(("aggregation", "anchored"), [("fedavg", True), ("weight", True), ("weight", False)])
def test_the_global_model_does_not_depend_on_the_order_replies_arrive_in(aggregation: str, anchored: bool) -> None:
    """Every arrival order of the same replies gives the same global model, bit for bit (a rerun of a seed must
    not drift apart by rounding; without an anchor and with equal example counts, the first reply is the universe's
    first U); in arrival order, flwr's FedAvg does not."""
    replies = good_replies() if anchored else [reply(state(i), metrics(examples=10), node=i + 1) for i in range(3)]
    orders = list(itertools.permutations(range(len(replies))))
    results = []
    for order in orders:
        s = strategy(aggregation)
        s.global_arrays = ArrayRecord(state(7)) if anchored else None  # type: ignore[arg-type]
        arrays, _ = s.aggregate_train(1, [replies[i] for i in order])
        assert arrays is not None
        results.append(as_numpy(arrays))
    assert all(np.array_equal(r[k], results[0][k]) for r in results[1:] for k in r)
    plain = [as_numpy(FedAvg().aggregate_train(1, [replies[i] for i in order])[0]) for order in orders]  # type: ignore[arg-type]
    assert not all(np.array_equal(r[k], plain[0][k]) for r in plain[1:] for k in r)


def test_fedavg_is_the_example_weighted_mean() -> None:
    arrays, _ = strategy().aggregate_train(1, good_replies())
    assert arrays is not None
    states = [state(i) for i in range(3)]
    for key, value in as_numpy(arrays).items():
        by_hand = (10 * states[0][key] + 20 * states[1][key] + 30 * states[2][key]) / 60
        np.testing.assert_allclose(value, by_hand.numpy(), rtol=1e-5, atol=1e-6)


def logits(native: dict[str, torch.Tensor], x: torch.Tensor, cfg: ModelConfig = CFG) -> torch.Tensor:
    model = build_model(cfg).double()
    model.load_state_dict({k: v.double() for k, v in native.items()})
    return get_arch(cfg.family).logits(model.eval(), x.double())


def test_identical_clients_merge_to_that_client() -> None:
    client = state(3)
    replies = [reply(client, metrics(examples=n), node=i) for i, n in enumerate((5, 7, 11))]
    s = strategy("weight")
    s.global_arrays = ArrayRecord(state(4))  # type: ignore[arg-type]  (an unrelated previous global model)
    arrays, _ = s.aggregate_train(1, replies)
    assert arrays is not None
    merged = {k: torch.from_numpy(v) for k, v in as_numpy(arrays).items()}
    x = torch.randn(4, 1, 8, 8)
    torch.testing.assert_close(logits(merged, x), logits(client, x), rtol=1e-4, atol=1e-4)
    assert s.current.distance_before == 0.0 and s.current.distance_after == pytest.approx(0.0, abs=1e-6)
    assert s.current.align_seconds > 0


def test_weight_alignment_never_moves_the_function_of_one_client() -> None:
    """Aligning a single client to any anchor is an exact symmetry: the merge computes the client's function."""
    s = strategy("weight", min_train_nodes=1)
    s.global_arrays = ArrayRecord(state(1))  # type: ignore[arg-type]
    arrays, _ = s.aggregate_train(2, [reply(state(2))])
    assert arrays is not None
    x = torch.randn(3, 1, 8, 8)
    merged = {k: torch.from_numpy(v) for k, v in as_numpy(arrays).items()}
    torch.testing.assert_close(logits(merged, x), logits(state(2), x), rtol=1e-4, atol=1e-4)


def test_canonical_is_the_example_weighted_mean_of_the_folded_clients() -> None:
    """The no-alignment ablation: fold every client's LayerNorms, then average the folded weights by examples."""
    states = [state(i) for i in range(3)]
    for s in states:  # LayerNorm gains and biases away from 1 and 0, so folding matters
        for key in (k for k in s if "norm" in k):
            s[key] = s[key] + 0.3 * torch.randn_like(s[key]) + (0.5 if key.endswith("weight") else 0.0)
    counts = (10, 20, 30)
    arrays, _ = strategy("canonical").aggregate_train(1, [reply(s, metrics(examples=n), node=i + 1)
                                                          for i, (s, n) in enumerate(zip(states, counts, strict=True))])
    assert arrays is not None
    arch = get_arch(CFG.family)
    folded = [canonicalize(arch, s, CFG, dtype=torch.float64) for s in states]
    merged = canonicalize(arch, {k: torch.from_numpy(v) for k, v in as_numpy(arrays).items()}, CFG,
                          dtype=torch.float64)
    for key, value in merged.items():
        by_hand = sum(n * f[key] for n, f in zip(counts, folded, strict=True)) / sum(counts)
        torch.testing.assert_close(value, by_hand, rtol=1e-5, atol=1e-6)
    fedavg, _ = strategy().aggregate_train(1, [reply(s, metrics(examples=n), node=i + 1)
                                               for i, (s, n) in enumerate(zip(states, counts, strict=True))])
    assert fedavg is not None and any(not np.allclose(v, as_numpy(fedavg)[k]) for k, v in as_numpy(arrays).items())


def _permuted(native: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The same function with its heads, MLP units and residual stream moved by a random symmetry."""
    arch, g = get_arch(CFG.family), torch.Generator().manual_seed(seed)
    t = random_transform(CFG, MATCHABLE, g)
    moved = apply(canonicalize(arch, native, CFG, dtype=torch.float64), arch.spec, t, CFG.heads)
    return {k: v.float() for k, v in arch.to_native(moved, CFG).items()}


@pytest.mark.parametrize("group", ["whole", "orthogonal"])
def test_min_alignment_gain_averages_already_aligned_clients_as_fedavg_does(group: str) -> None:
    """Fine-tunes of one global model: matching brings them hardly closer, so the round is flwr's FedAvg, bit for
    bit, and says so; permuted copies of one model: matching halves their distance, so it is kept. On this tiny
    model the fine-tunes' noise is fitted to a 3.6% gain over the group's orthogonal part and 5.1% over the whole
    group (whose invertible maps and unit scales fit more of it), so the guard here asks for 8%."""
    base, counts = state(3), (10, 20, 30)
    tuned = [{k: v + 0.01 * torch.randn_like(v) for k, v in base.items()} for _ in counts]
    replies = [reply(t, metrics(examples=n), node=i + 1) for i, (t, n) in enumerate(zip(tuned, counts, strict=True))]
    options = merge_options(min_gain=0.08)
    options = dataclasses.replace(options, match=dataclasses.replace(options.match, symmetry=SymmetryOptions(group)))
    guarded = strategy("weight", options=options)
    guarded.global_arrays = ArrayRecord(base)  # type: ignore[arg-type]
    arrays, _ = guarded.aggregate_train(1, replies)
    plain = strategy()
    plain.global_arrays = ArrayRecord(base)  # type: ignore[arg-type]  # the same global model: the same defences
    fedavg, _ = plain.aggregate_train(1, replies)
    assert arrays is not None and fedavg is not None and guarded.current.unaligned
    assert guarded.current.distance_after == guarded.current.distance_before
    for key, value in as_numpy(arrays).items():
        np.testing.assert_array_equal(value, as_numpy(fedavg)[key])
    kept = strategy("weight", options=options)
    arrays, _ = kept.aggregate_train(1, [reply(base, node=1), reply(_permuted(base, 1), node=2)])
    assert arrays is not None and not kept.current.unaligned
    assert kept.current.distance_after < 0.5 * kept.current.distance_before  # type: ignore[operator]
    x = torch.randn(4, 1, 8, 8)
    merged = {k: torch.from_numpy(v) for k, v in as_numpy(arrays).items()}
    torch.testing.assert_close(logits(merged, x), logits(base, x), rtol=1e-4, atol=1e-4)


def test_min_alignment_gain_is_checked_and_guards_only_aggregations_that_match() -> None:
    """It is on by default; canonical, which never brings the clients closer, would always be set aside, so the
    guard leaves it alone (learned's matching it judges before the refinement: tests/test_guard.py)."""
    with pytest.raises(ConfigError, match="in \\[0, 1\\)"):
        RunSettings.from_run_config({"aggregation": "weight", "min-alignment-gain": 1.0})
    assert RunSettings.from_run_config({}).min_alignment_gain > 0
    replies = [reply(state(i), metrics(examples=n), node=i + 1) for i, n in enumerate((10, 20))]
    canonical = strategy("canonical", options=merge_options(min_gain=0.5))
    arrays, _ = canonical.aggregate_train(1, replies)
    assert arrays is not None and not canonical.current.unaligned
    assert canonical.current.distance_after == pytest.approx(canonical.current.distance_before)


def test_restore_norms_gives_the_merged_neurons_the_clients_mean_norm() -> None:
    """Alignment only permutes neurons and rotates the stream, so each client's total of fc1 row norms [w|b] is kept;
    after the restoration the merge's total is the example-weighted mean of those totals."""
    states, counts = [state(i) for i in range(3)], (10, 20, 30)
    replies = [reply(s, metrics(examples=n), node=i + 1) for i, (s, n) in enumerate(zip(states, counts, strict=True))]
    restored, _ = strategy("weight", options=merge_options(restore_norms=True)).aggregate_train(1, replies)
    plain, _ = strategy("weight").aggregate_train(1, replies)
    assert restored is not None and plain is not None
    arch = get_arch(CFG.family)

    def total(native: dict[str, torch.Tensor]) -> float:
        folded = canonicalize(arch, native, CFG, dtype=torch.float64)
        rows = torch.cat([folded["blocks.0.mlp.fc1.w"], folded["blocks.0.mlp.fc1.b"][:, None]], 1)
        return float(rows.norm(dim=1).sum())

    merged = [total({k: torch.from_numpy(v) for k, v in as_numpy(a).items()}) for a in (restored, plain)]
    by_hand = sum(n * total(s) for n, s in zip(counts, states, strict=True)) / sum(counts)
    assert merged[0] == pytest.approx(by_hand, rel=1e-5) and merged[1] < 0.95 * by_hand


def test_circuit_heads_rewrites_only_the_merged_heads() -> None:
    """The run config's circuit-heads reaches the merge: the heads (fused qkv and proj weights) are refitted, every
    other tensor is the weight-matched merge's, and the merge stays finite."""
    replies = [reply(state(i), metrics(examples=10 * (i + 1)), node=i + 1) for i in range(3)]
    keys = {"server-device": "cpu", "aggregation": "weight", "circuit-heads": True}
    options = RunSettings.from_run_config(keys).merge_options
    refitted, _ = strategy("weight", options=options).aggregate_train(1, replies)
    plain, _ = strategy("weight").aggregate_train(1, replies)
    assert refitted is not None and plain is not None
    new, old = as_numpy(refitted), as_numpy(plain)
    heads = {k for k in old if k.endswith(("attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight"))}
    assert heads and all(not np.allclose(new[k], old[k], atol=1e-4) for k in heads if k.endswith("weight"))
    assert all(np.allclose(new[k], old[k], atol=1e-6) for k in old if k not in heads)
    assert all(np.isfinite(v).all() for v in new.values())


@pytest.mark.parametrize(("changes", "expect"), [
    ({"aggregation": "fedavg"}, "does not align"), ({"aggregation": "weight", "width-tiers": "1,0.5"}, "one width"),
    ({"aggregation": "weight", "robust-average": "fedmedian"}, "would lose its heads")])
def test_circuit_heads_refuses_what_it_cannot_merge_in_one_line(changes: dict[str, Any], expect: str) -> None:
    with pytest.raises(ConfigError, match=f"circuit-heads.*{expect}"):
        RunSettings.from_run_config({"circuit-heads": True, **changes})


@pytest.mark.parametrize("share", [1.0, 0.1])
def test_fedavg_ft_is_fedavg_then_the_mean_trained_on_the_server_data(share: float) -> None:
    """The server-data control: the example-weighted mean, then trained by glmc.train on the server-held samples, at
    the round's share of the base rate (lr-decay's, as the clients train)."""
    data = synthetic_images(40)
    tune = TrainConfig(epochs=2, batch_size=16, lr=1e-2, seed=5, threads=1)
    s = strategy("fedavg-ft", server_data=data, tune=tune, rate=lambda server_round: share)
    s.current = RoundRecord(3)  # as configure_train opens round 3
    arrays, _ = s.aggregate_train(3, good_replies())
    assert arrays is not None
    states = [state(i) for i in range(3)]
    mean = heterofl.merge(states, [CFG] * 3, [10.0, 20.0, 30.0], CFG, states[0])
    for key, value in mean.items():  # the equal-width HeteroFL average is the weighted mean
        torch.testing.assert_close(value, (10 * states[0][key] + 20 * states[1][key] + 30 * states[2][key]) / 60)
    model = build_model(CFG)
    model.load_state_dict(mean)
    fit = train(model, get_arch(CFG.family), data, dataclasses.replace(tune, seed=tune.seed + 3, lr=tune.lr * share),
                progress=False)
    assert fit["steps"] == 6  # 2 epochs of ⌈40 / 16⌉ batches: the round moves the seed, not the budget
    ours = as_numpy(arrays)
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(ours[key], value.numpy())
    assert any(not np.allclose(ours[k], v.numpy(), atol=1e-3) for k, v in mean.items())
    assert s.current.align_seconds > 0


def test_learned_refines_at_the_rounds_share_of_its_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under lr-decay the learned refinement, the server's own training, runs at the round's share of its rate, as
    the clients' training does; the rest of the merge options are the run's."""
    seen: list[MergeOptions] = []

    def merged(clients: object, full: object, aggregation: object, options: MergeOptions, **_: object) -> MergeResult:
        seen.append(options)
        return MergeResult(None, 0.0, 0.0, 0.0, [])

    monkeypatch.setattr("server.strategy.merge", merged)
    s = strategy("learned", server_data=synthetic_images(8), rate=lambda server_round: 0.1 ** (server_round - 1))
    for server_round in (1, 3):
        s._merge(server_round, [])
    base = s.options.match.learn.lr
    assert [o.match.learn.lr for o in seen] == [base, pytest.approx(base / 100)]
    assert dataclasses.replace(seen[1], match=s.options.match) == s.options


@pytest.mark.parametrize("aggregation", ["fedavg-ft", "server-only"])
def test_with_endpoint_targets_the_controls_are_distilled_to_the_clients_mixed_prediction(aggregation: str) -> None:
    """refine-targets = endpoints: fedavg-ft (server-only) trains the weighted mean (the previous global model)
    against Σ w_i softmax(f_i(x)) of the clients, weighted by examples, and never reads the server data's labels."""
    data = synthetic_images(40)
    tune = TrainConfig(epochs=1, batch_size=16, lr=1e-2, seed=5, threads=1)
    learn = LearnConfig(targets="endpoints")
    shuffled = TensorDataset(data.tensors[0], data.tensors[1].roll(1))  # the same inputs, other labels

    def round_3(server_data: TensorDataset) -> dict[str, np.ndarray]:
        s = strategy(aggregation, server_data=server_data, tune=tune,
                     options=merge_options(learn=learn, robustness=Robustness.off()))
        s.current, s.global_arrays = RoundRecord(3), ArrayRecord(state(7))  # type: ignore[arg-type]
        arrays, _ = s.aggregate_train(3, good_replies())
        assert arrays is not None
        return as_numpy(arrays)

    ours = round_3(data)
    states = [state(i) for i in range(3)]
    start = state(7) if aggregation == "server-only" else heterofl.merge(states, [CFG] * 3, [10.0, 20.0, 30.0],
                                                                          CFG, state(7))
    model, clients = build_model(CFG), [build_model(CFG) for _ in states]
    model.load_state_dict(start)
    ordered = split_replies(good_replies(), schema())[0]  # the strategy's canonical order: float sums depend on it
    for client, r in zip(clients, ordered, strict=True):
        client.load_state_dict(r.content[protocol.ARRAYS].to_torch_state_dict())
    weights = [float(r.content[protocol.METRICS][protocol.WEIGHT_KEY]) for r in ordered]
    assert sorted(weights) == [10.0, 20.0, 30.0]
    teacher = PredictionMixture(clients, get_arch(CFG.family), weights)
    train(model, get_arch(CFG.family), data, dataclasses.replace(tune, seed=tune.seed + 3), progress=False,
          teacher=teacher)
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(ours[key], value.numpy())
    labelled = round_3(data)  # the same run again, and with the labels changed: the same model, bit for bit
    assert all(np.array_equal(ours[k], v) for k, v in labelled.items())
    assert all(np.array_equal(ours[k], v) for k, v in round_3(shuffled).items())
    plain = strategy(aggregation, server_data=shuffled, tune=tune,  # labels: they count
                     options=merge_options(robustness=Robustness.off()))
    plain.current, plain.global_arrays = RoundRecord(3), ArrayRecord(state(7))  # type: ignore[arg-type]
    trained_on_labels, _ = plain.aggregate_train(3, good_replies())
    assert trained_on_labels is not None
    assert any(not np.allclose(ours[k], v, atol=1e-4) for k, v in as_numpy(trained_on_labels).items())


def test_fedavg_ft_on_generated_text_trains_the_mean_on_what_the_clients_models_write() -> None:
    """server-data-source = generated: the round's server data is text the clients' GPT-2s sample (seeded by the
    round), and no client gives any data up; refine-targets "labels" trains on the sampled tokens."""
    cfg = preset("gpt2-tiny").replace(vocab_size=7, context=12)
    states = []
    for seed in range(3):
        torch.manual_seed(seed)
        states.append({k: v.detach().clone() for k, v in build_model(cfg).state_dict().items()})
    tune = TrainConfig(epochs=1, batch_size=8, lr=1e-2, seed=5, threads=1)
    s = SymmetryAwareFedAvg("fedavg-ft", ReplySchema({1.0: {k: tuple(v.shape) for k, v in states[0].items()}}), cfg,
                            generate=24, tune=tune, min_train_nodes=2,
                            options=merge_options(learn=LearnConfig(targets="labels")))
    s.current = RoundRecord(3)
    replies = [reply(st, metrics(examples=10), node=i + 1) for i, st in enumerate(states)]
    arrays, _ = s.aggregate_train(3, replies)
    assert arrays is not None
    ordered = [r.content[protocol.ARRAYS].to_torch_state_dict() for r in split_replies(replies, s.schema)[0]]
    model = build_model(cfg)
    model.load_state_dict(heterofl.merge(ordered, [cfg] * 3, [10.0] * 3, cfg, ordered[0]))
    written = generated_text(ordered, [cfg] * 3, 24, seed=3)  # each client's share, in the replies' canonical order
    fit = train(model, get_arch(cfg.family), written, dataclasses.replace(tune, seed=tune.seed + 3), progress=False)
    assert fit["steps"] == 3
    ours = as_numpy(arrays)
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(ours[key], value.numpy())
    assert RunSettings(server_data=24, server_data_source="generated").held_back == 0
    with pytest.raises(ConfigError, match="server-data-source"):
        RunSettings(server_data_source="hub")


@pytest.mark.parametrize("independent", [False, True])
def test_server_only_trains_the_global_model_on_the_server_data_and_ignores_the_clients(independent: bool) -> None:
    """The second control: the previous global model (round 1: the initial one, so from scratch, independent inits
    included) trained by glmc.train on the server-held samples with fedavg-ft's budget; the replies change nothing."""
    data = synthetic_images(40)
    tune = TrainConfig(epochs=2, batch_size=16, lr=1e-2, seed=5, threads=1)
    results = []
    for replies in (good_replies(), [reply(state(i + 7), metrics(examples=5), node=i + 1) for i in range(2)]):
        s = strategy("server-only", server_data=data, tune=tune, independent_init=independent)
        s.global_arrays = ArrayRecord(state(11))  # type: ignore[arg-type]
        s.current = RoundRecord(1)
        arrays, _ = s.aggregate_train(1, replies)
        assert arrays is not None and s.current.align_seconds > 0
        results.append(as_numpy(arrays))
    model = build_model(CFG)
    model.load_state_dict(state(11))
    fit = train(model, get_arch(CFG.family), data, dataclasses.replace(tune, seed=tune.seed + 1), progress=False)
    assert fit["steps"] == 6
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(results[0][key], value.numpy())
        np.testing.assert_array_equal(results[1][key], value.numpy())
    assert any(not np.allclose(results[0][k], v.numpy(), atol=1e-3) for k, v in state(11).items())


@pytest.mark.parametrize(("changes", "reads"), [
    ({"aggregation": "fedavg"}, "none"), ({"aggregation": "weight", "restore-norms": True}, "none"),
    ({"aggregation": "weight", "refit": True}, "inputs"), ({"aggregation": "canonical", "repair": True}, "inputs"),
    ({"aggregation": "activation"}, "inputs"), ({"aggregation": "learned"}, "labels"),
    ({"aggregation": "fedavg-ft"}, "labels"), ({"aggregation": "server-only"}, "labels"),
    ({"aggregation": "learned", "server-data-source": "generated"}, "generated"),
    ({"aggregation": "fedavg-ft", "server-data-source": "generated"}, "generated"),
    ({"aggregation": "fedavg", "server-data-source": "generated"}, "none"),
    ({"aggregation": "weight", "server-data-source": "generated"}, "none"),
    ({"aggregation": "learned", "refine-targets": "endpoints"}, "inputs"),
    ({"aggregation": "fedavg-ft", "refine-targets": "endpoints"}, "inputs"),
    ({"aggregation": "server-only", "refine-targets": "endpoints"}, "inputs")])
def test_each_aggregation_says_what_it_reads_of_the_server_data(changes: dict[str, object], reads: str) -> None:
    settings = RunSettings.from_run_config({"server-data": 8, **changes})
    assert settings.server_data_read() == reads
    assert settings.generated == (8 if reads == "generated" else 0)  # text is sampled only for a reader of it


@pytest.mark.parametrize(("source", "refine", "targets"), [
    ("split", "auto", "labels"), ("generated", "auto", "endpoints"), ("generated", "labels", "labels"),
    ("split", "endpoints", "endpoints")])
def test_refine_targets_auto_learns_against_the_clients_on_the_text_they_write(source: str, refine: str,
                                                                             targets: str) -> None:
    """The default "auto": the clients' mixed prediction on generated text (its tokens are their samples), the
    labels on held-back data; a named choice is kept."""
    settings = RunSettings.from_run_config({"aggregation": "fedavg-ft", "server-data": 8,
                                            "server-data-source": source, "refine-targets": refine})
    assert RunSettings().to_run_config()["refine-targets"] == "auto" and settings.targets == targets
    with pytest.raises(ConfigError, match="run-config key 'refine-targets' must be one of labels, endpoints"):
        RunSettings.from_run_config({"refine-targets": "mixed"})


def test_server_only_refuses_alignment_options_in_one_line() -> None:
    for key in ("restore-norms", "repair", "refit"):
        with pytest.raises(ConfigError, match="server-only"):
            RunSettings.from_run_config({"aggregation": "server-only", "server-data": 8, key: True})
    with pytest.raises(ConfigError, match="server-data"):
        RunSettings(aggregation="server-only")


def test_fedavg_ft_needs_server_data() -> None:
    with pytest.raises(ConfigError, match="server-data"):
        RunSettings(aggregation="fedavg-ft")
    s = strategy("fedavg-ft")
    assert s.aggregate_train(1, good_replies()) == (None, None) and "server-data" in (s.current.failure or "")


def _bad_arrays(kind: str) -> ArrayRecord:
    good = state(9)
    arrays = ArrayRecord(good)  # type: ignore[arg-type]
    key = "blocks.0.attn.qkv.weight"
    if kind == "missing":
        del arrays[key]
    elif kind == "extra":
        arrays["evil"] = Array(np.zeros(3, dtype=np.float32))
    elif kind == "shape":
        arrays[key] = Array(np.zeros((2, 2), dtype=np.float32))
    elif kind in ("nan", "inf", "huge"):
        value = {"nan": math.nan, "inf": math.inf, "huge": 1e20}[kind]
        bad = good[key].clone()
        bad[0, 0] = value
        arrays[key] = Array(bad.numpy())
    elif kind == "dtype":
        arrays[key] = Array(good[key].double().numpy())
    elif kind == "forged-header":
        real = Array(good[key].numpy())
        arrays[key] = Array(dtype=real.dtype, shape=real.shape, stype=real.stype, data=b"garbage")
    return arrays


BAD_REPLIES = {
    "missing array key": (lambda: reply(_bad_arrays("missing")), "missing array keys"),
    "extra array key": (lambda: reply(_bad_arrays("extra")), "extra array keys"),
    "wrong shape": (lambda: reply(_bad_arrays("shape")), "expected float32"),
    "NaN": (lambda: reply(_bad_arrays("nan")), "NaN or Inf"),
    "Inf": (lambda: reply(_bad_arrays("inf")), "NaN or Inf"),
    "huge value": (lambda: reply(_bad_arrays("huge")), "beyond"),
    "wrong dtype": (lambda: reply(_bad_arrays("dtype")), "float64"),
    "undecodable array": (lambda: reply(_bad_arrays("forged-header")), "unreadable reply"),
    "unknown width tier": (lambda: reply(state(9), metrics(**{protocol.TIER_KEY: 0.5})), "unknown width tier"),
    "no num-examples": (lambda: reply(state(9), metrics(examples=None)), "missing metric keys"),
    "zero num-examples": (lambda: reply(state(9), metrics(examples=0)), "positive whole number"),
    "negative num-examples": (lambda: reply(state(9), metrics(examples=-5)), "positive whole number"),
    "extra metric key": (lambda: reply(state(9), metrics(surprise=1.0)), "extra metric keys"),
    "NaN metric": (lambda: reply(state(9), metrics(**{"train-loss": math.nan})), "not a finite number"),
    "client error": (lambda: Message(Error(code=0, reason="boom"), reply_to=instruction(5)), "client error: boom"),
    "two ArrayRecords": (lambda: _with_extra_record(), "expected one ArrayRecord"),
}


def _with_extra_record() -> Message:
    msg = reply(state(9))
    msg.content["more"] = ArrayRecord(state(9))  # type: ignore[arg-type]
    return msg


# Every class through the FedAvg path; the weight path shares the validation, so three classes suffice there.
DROP_CASES = [("fedavg", case) for case in sorted(BAD_REPLIES)] + [
    ("weight", case) for case in ("NaN", "wrong shape", "unknown width tier")]


@pytest.mark.parametrize(("aggregation", "case"), DROP_CASES)
def test_bad_reply_is_dropped_with_a_reason(aggregation: str, case: str, caplog: pytest.LogCaptureFixture) -> None:
    make, reason = BAD_REPLIES[case]
    good = good_replies()[:2]
    with caplog.at_level(logging.WARNING):
        arrays, _ = strategy(aggregation).aggregate_train(1, [*good, make()])
        expected, _ = strategy(aggregation).aggregate_train(1, good)
    assert arrays is not None and expected is not None
    ours, clean = as_numpy(arrays), as_numpy(expected)
    assert all(np.array_equal(ours[k], clean[k]) for k in clean)
    dropped = [r.getMessage() for r in caplog.records if "dropped reply" in r.getMessage()]
    assert len(dropped) == 1 and reason in dropped[0] and "\n" not in dropped[0]


def test_every_bad_reply_has_a_one_line_reason() -> None:
    for case, (make, expected) in BAD_REPLIES.items():
        reason = check_reply(make(), schema())
        assert reason is not None and expected in reason and "\n" not in reason, case


def test_an_error_reply_made_by_the_superlink_names_the_node_it_was_for() -> None:
    """When a node goes away, the SuperLink answers its instruction itself, from its own node id."""
    s = strategy(min_train_nodes=1)
    s.instructions = [instruction(7)]
    lost = Message(Error(code=0, reason="Node Unavailable"), reply_to=instruction(7))
    lost.metadata.__dict__["_src_node_id"] = 1  # the SuperLink's id, as a deployed SuperLink sets it
    s.aggregate_train(1, [good_replies()[0], lost])
    assert s.current.dropped == ["node 7: client error: Node Unavailable"]


def test_too_few_valid_replies_keep_the_global_model(caplog: pytest.LogCaptureFixture) -> None:
    s = strategy()
    with caplog.at_level(logging.WARNING):
        arrays, metrics_ = s.aggregate_train(1, [good_replies()[0], BAD_REPLIES["NaN"][0]()])
    assert arrays is None and metrics_ is None  # flwr's loop then keeps the previous global arrays
    assert not s.current.aggregated and s.current.valid == 1 and len(s.current.dropped) == 1
    assert any("keeping the global model" in r.getMessage() for r in caplog.records)


def test_a_merge_that_fails_keeps_the_global_model(caplog: pytest.LogCaptureFixture) -> None:
    s = strategy("learned")  # valid replies, but no server-held data for the refinement
    with caplog.at_level(logging.ERROR):
        arrays, metrics_ = s.aggregate_train(1, good_replies())
    assert arrays is None and metrics_ is None and s.global_arrays is None
    assert not s.current.aggregated and "needs data" in (s.current.failure or "")
    assert any("aggregation failed, keeping the global model" in r.getMessage() for r in caplog.records)


def test_round_hooks_see_every_round() -> None:
    seen: list[tuple[int, bool]] = []

    class Recorder(RoundHooks):
        def on_round_end(self, record: RoundRecord, arrays: ArrayRecord) -> None:
            seen.append((record.round, record.aggregated))

    s = strategy(hooks=[Recorder()], round_offset=2)
    s.configure_train = lambda *a, **k: []  # type: ignore[method-assign]
    s.current = RoundRecord(3)
    arrays, _ = s.aggregate_train(1, good_replies())
    assert arrays is not None
    record = s.end_round(3, arrays, MetricRecord({"central-loss": 1.5, "central-accuracy": 0.25}))
    assert seen == [(3, True)] and record.central_accuracy == 0.25 and record.mean_client_accuracy == 0.5


class JoiningGrid(Grid):
    """A grid whose nodes connect one per ``get_node_ids`` call (as a restarted SuperNode rejoins mid-wait)."""

    def __init__(self, nodes: int) -> None:
        self.nodes, self.connected = nodes, 1

    def get_node_ids(self) -> list[int]:
        seen = list(range(1, self.connected + 1))
        self.connected = min(self.connected + 1, self.nodes)
        return seen

    def create_message(self, *args: object, **kwargs: object) -> Message:
        raise NotImplementedError

    def set_run(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError

    @property
    def run(self) -> None:  # type: ignore[override]
        raise NotImplementedError

    def push_messages(self, *args: object, **kwargs: object) -> list[str]:
        raise NotImplementedError

    def pull_messages(self, *args: object, **kwargs: object) -> list[Message]:
        raise NotImplementedError

    def send_and_receive(self, *args: object, **kwargs: object) -> list[Message]:
        raise NotImplementedError


def test_a_round_that_waits_for_nodes_samples_every_node_that_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    """min-available-nodes=3 with fraction 1: all three nodes get the round, not just the one connected at first."""
    for key in ("_task_id", "_run_id", "_node_id"):  # what the ServerApp process sets before messages are made
        monkeypatch.setattr(TaskIdentity, key, 1)
    monkeypatch.setattr("server.strategy.NODE_POLL_SECONDS", 0.0)
    s = strategy(min_train_nodes=1, min_available_nodes=3, fraction_evaluate=1.0, min_evaluate_nodes=1)
    arrays = ArrayRecord(state(0))  # type: ignore[arg-type]
    train = s.configure_train(1, arrays, ConfigRecord(), JoiningGrid(3))
    evaluate_ = s.configure_evaluate(1, arrays, ConfigRecord(), JoiningGrid(3))
    for messages in (train, evaluate_):
        assert sorted(m.metadata.dst_node_id for m in messages) == [1, 2, 3]


def test_unknown_aggregation_or_placement_fails_at_start() -> None:
    with pytest.raises(ConfigError, match="not available"):
        strategy("telepathy")
    with pytest.raises(ConfigError, match="narrow placement 'anywhere'"):
        strategy("weight", narrow_placement="anywhere")


def test_pyproject_config_matches_the_settings_defaults() -> None:
    config = tomllib.loads(Path(__file__).parents[1].joinpath("pyproject.toml").read_text())
    app_config = config["tool"]["flwr"]["app"]["config"]
    assert set(app_config) == set(RunSettings().to_run_config())
    assert RunSettings.from_run_config(app_config) == RunSettings()
    assert "federations" not in config["tool"]["flwr"]


@pytest.mark.parametrize(("key", "value"), [("alpha", "x"), ("local-epochs", 1.5), ("resume", 3),
                                            ("aggregation", "mean"), ("width-tiers", "1,a"), ("nope", 1),
                                            ("min-available-nodes", -1), ("refine-concentration", 0),
                                            ("refine-within", "affine"),
                                            ("alpha", -1.0), ("alpha", float("nan")), ("lr", float("nan")),
                                            ("lr", -0.1), ("classes-per-client", 0), ("seed", -1),
                                            ("dropout", 1.0), ("dropout", -0.5), ("sampling", "random")])
def test_bad_run_config_is_a_config_error(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):  # the message names the key (the last six once went through)
        RunSettings.from_run_config({key: value})


def test_restore_norms_needs_an_aligned_aggregation() -> None:
    with pytest.raises(ConfigError, match="restore-norms"):
        RunSettings.from_run_config({"aggregation": "fedavg", "restore-norms": True})


def test_repair_needs_an_aligned_aggregation_and_server_data() -> None:
    with pytest.raises(ConfigError, match="repair changes aligned merges"):
        RunSettings.from_run_config({"aggregation": "fedavg", "repair": True, "server-data": 100})
    with pytest.raises(ConfigError, match="set server-data > 0"):
        RunSettings.from_run_config({"aggregation": "weight", "repair": True})


def test_repair_gives_the_merged_channels_the_clients_statistics_on_the_server_data() -> None:
    """Alignment moves a client's channels but keeps each one's statistics, so after REPAIR the global model's fc1
    channels have, in total, the example-weighted mean of the clients' means and stds on the server data."""
    states, counts, data = [state(i) for i in range(3)], (10, 20, 30), synthetic_images(24)
    replies = [reply(s, metrics(examples=n), node=i + 1) for i, (s, n) in enumerate(zip(states, counts, strict=True))]
    repaired, _ = strategy("weight", options=merge_options(repair=True), server_data=data).aggregate_train(1, replies)
    plain, _ = strategy("weight", server_data=data).aggregate_train(1, replies)
    assert repaired is not None and plain is not None
    arch, site = get_arch(CFG.family), [("blocks.{l}.mlp.fc1", 0)]

    def totals(native: dict[str, torch.Tensor]) -> torch.Tensor:
        folded = canonicalize(arch, {k: v.double() for k, v in native.items()}, CFG, dtype=torch.float64)
        mean, std = channel_stats(to_model(folded, CFG), CFG, data.tensors[0], site, 8)[site[0]]
        return torch.stack([mean.sum(), std.sum()])

    merged = [totals({k: torch.from_numpy(v) for k, v in as_numpy(a).items()}) for a in (repaired, plain)]
    by_hand = sum(n * totals(s) for n, s in zip(counts, states, strict=True)) / sum(counts)
    torch.testing.assert_close(merged[0], by_hand, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(merged[1], by_hand, rtol=1e-2)


def test_refit_needs_an_aligned_aggregation_and_server_data() -> None:
    with pytest.raises(ConfigError, match="refit changes aligned merges"):
        RunSettings.from_run_config({"aggregation": "fedavg", "refit": True, "server-data": 100})
    with pytest.raises(ConfigError, match="set server-data > 0"):
        RunSettings.from_run_config({"aggregation": "weight", "refit": True})


def test_refit_fits_the_global_head_to_the_clients_mean_logits_on_the_server_data() -> None:
    """Alignment keeps each client's function, so the refitted global head (canonical) is the ridged least-squares fit,
    on its own inputs there, of the clients' example-weighted mean logits on the server data, shrunk towards the plain
    merge's head: the normal equations hold for it and not for the plain merge."""
    states, counts, data = [state(i) for i in range(3)], (10, 20, 30), synthetic_images(64)
    replies = [reply(s, metrics(examples=n), node=i + 1) for i, (s, n) in enumerate(zip(states, counts, strict=True))]
    arch, x = get_arch(CFG.family), data.tensors[0].double()

    def head_fit(native: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        folded = canonicalize(arch, {k: v.double() for k, v in native.items()}, CFG, dtype=torch.float64)
        model, seen = to_model(folded, CFG), []
        arch.module(model, "head").register_forward_hook(lambda m, args, out: seen.append(args[0]))
        with torch.no_grad():
            logits = arch.logits(model, x)
        return torch.cat([seen[0], torch.ones(len(x), 1, dtype=torch.float64)], 1), logits, layer_rows(folded, "head")

    want = sum(n * head_fit(s)[1] for n, s in zip(counts, states, strict=True)) / sum(counts)
    merges = {refit: strategy("weight", options=merge_options(refit=refit),
                              server_data=data).aggregate_train(1, replies)[0] for refit in (True, False)}
    heads = {k: head_fit({name: torch.from_numpy(v) for name, v in as_numpy(a).items()})  # type: ignore[arg-type]
             for k, a in merges.items()}
    start = heads[False][2]
    for refit, (features, logits, rows) in heads.items():
        energy = RIDGE * features.square().sum(0)
        gradient = features.T @ (logits - want) + energy[:, None] * (rows - start).T
        assert (gradient.abs().max() <= 1e-4 * (features.T @ want).abs().max()) == refit


def test_run_config_values_are_coerced() -> None:
    s = RunSettings.from_run_config({"alpha": 1, "width-tiers": "1,0.5", "resume": "true", "seed": 2.0})
    assert (s.alpha, s.width_tiers, s.resume, s.seed) == (1.0, (1.0, 0.5), True, 2)
    assert [s.tier_of(p) for p in range(3)] == [1.0, 0.5, 1.0]


# Mixed widths: HeteroFL for fedavg, exact embedding + universe matching for weight, own-width downlink.

HALF = scale_width(CFG, 0.5)


def half_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in build_model(HALF).state_dict().items()}


def mixed_schema() -> ReplySchema:
    return ReplySchema({t: {k: tuple(v.shape) for k, v in build_model(scale_width(CFG, t)).state_dict().items()}
                        for t in (1.0, 0.5)})


def mixed_strategy(aggregation: str, **kwargs: object) -> SymmetryAwareFedAvg:
    s = SymmetryAwareFedAvg(aggregation, mixed_schema(), CFG, **({"min_train_nodes": 1} | kwargs))  # type: ignore[arg-type]
    s.global_arrays = ArrayRecord(state(0))  # type: ignore[arg-type]
    return s


@pytest.mark.parametrize("aggregation", ["fedavg", "fjord"])  # FjORD's clients train differently, merge alike
def test_heterofl_averages_each_entry_over_the_clients_that_hold_it(aggregation: str) -> None:
    full, half = state(1), half_state(2)
    replies = [reply(full, metrics(examples=30), node=1),
               reply(half, metrics(examples=10, **{protocol.TIER_KEY: 0.5}), node=2)]
    arrays, _ = mixed_strategy(aggregation).aggregate_train(1, replies)
    assert arrays is not None
    merged = {k: torch.from_numpy(v) for k, v in as_numpy(arrays).items()}
    fc1, qkv = "blocks.0.mlp.fc1.weight", "blocks.0.attn.qkv.weight"
    f, d = HALF.mlp, HALF.width
    torch.testing.assert_close(merged[fc1][:f, :d], (30 * full[fc1][:f, :d] + 10 * half[fc1]) / 40)
    torch.testing.assert_close(merged[fc1][f:], full[fc1][f:])  # only the full client holds these units
    # q, k and v each keep their first head: rows [0, d_h) of every (H·d_h)-row block.
    dh, rows = CFG.head_dim, CFG.heads * CFG.head_dim
    for block in range(3):
        lo = block * rows
        expected = (30 * full[qkv][lo:lo + dh, :d] + 10 * half[qkv][block * dh:(block + 1) * dh]) / 40
        torch.testing.assert_close(merged[qkv][lo:lo + dh, :d], expected)
    assert heterofl.restrict(merged, CFG, HALF)[fc1].shape == half[fc1].shape


def test_heterofl_keeps_entries_nobody_holds() -> None:
    s = mixed_strategy("fedavg")
    arrays, _ = s.aggregate_train(1, [reply(half_state(2), metrics(**{protocol.TIER_KEY: 0.5}), node=2)])
    assert arrays is not None
    merged = as_numpy(arrays)
    key = "blocks.0.mlp.fc1.weight"
    np.testing.assert_array_equal(merged[key][HALF.mlp:], state(0)[key][HALF.mlp:].numpy())
    np.testing.assert_array_equal(merged[key][:HALF.mlp, :HALF.width], half_state(2)[key].numpy())


@pytest.mark.parametrize("aggregation", ["weight", "learned"])
def test_a_narrow_client_merged_alone_keeps_its_function_both_ways(aggregation: str) -> None:
    """Exact embedding into the universe, then projection back onto where alignment put the client (the downlink
    of narrow-placement aligned; principal's echoes are the test below) gives its function back; what it does not
    cover keeps the previous global model (lstsq_merge's anchor, as HeteroFL keeps an entry nobody held), so the
    full model is not the narrow one padded with zeros."""
    learn = LearnConfig(steps=4, eval_every=2, batch_size=16, lr=0.05)
    s = mixed_strategy(aggregation, server_data=synthetic_images(48), options=merge_options(learn=learn),
                       narrow_placement="aligned")
    half = half_state(5)
    arrays, _ = s.aggregate_train(2, [reply(half, metrics(**{protocol.TIER_KEY: 0.5}), node=9)])
    assert arrays is not None
    x = torch.randn(4, 1, 8, 8)
    merged = {k: torch.from_numpy(v) for k, v in as_numpy(arrays).items()}
    assert not torch.allclose(logits(merged, x), logits(half, x, HALF), rtol=1e-3, atol=1e-3)
    [message] = s.restrict_to_widths([instruction(9)], arrays)
    back = message.content[protocol.ARRAYS].to_torch_state_dict()
    assert back.keys() == half.keys() and all(back[k].shape == half[k].shape for k in half)
    torch.testing.assert_close(logits(back, x, HALF), logits(half, x, HALF), rtol=1e-3, atol=1e-3)


def test_each_node_gets_the_global_model_at_its_own_width() -> None:
    s = mixed_strategy("fedavg")
    arrays, _ = s.aggregate_train(1, [reply(state(1), node=1),
                                      reply(half_state(2), metrics(**{protocol.TIER_KEY: 0.5}), node=2)])
    assert arrays is not None
    messages = s.restrict_to_widths([instruction(n, arrays) for n in (1, 2, 3)], arrays)
    shapes = [{k: tuple(v.shape) for k, v in m.content[protocol.ARRAYS].items()} for m in messages]
    assert shapes[0] == shapes[2] == mixed_schema().shapes[1.0]  # node 3 is new: full model, it restricts itself
    assert shapes[1] == mixed_schema().shapes[0.5]
    assert protocol.CONFIG in messages[1].content


def test_ensemble_of_identical_clients_is_that_client() -> None:
    data = synthetic_images(32)
    record = RoundRecord(1)
    client = Client(state(3), 10.0, 1.0)
    EnsembleEvaluator(CFG, data).on_aggregate(record, [client, client])
    model = build_model(CFG)
    model.load_state_dict(client.state)
    single = evaluate(model, get_arch(CFG.family), data)
    assert record.ensemble_accuracy == single["accuracy"]
    assert record.ensemble_loss == pytest.approx(single["loss"], rel=1e-5)


@pytest.mark.parametrize("placement", ["aligned", "principal"])
def test_clients_that_send_back_what_they_got_leave_the_global_model_as_it_was(placement: str) -> None:
    """The server embeds each narrow reply where it placed that node's model, and a node it has not heard from
    restricts the full model the same way itself (client.app), so echoes merge back to the global model. With
    canonical aggregation no matching can hide a reply embedded in the wrong place."""
    s = mixed_strategy("canonical", narrow_placement=placement)
    assert s.global_arrays is not None
    s.restrict_to_widths([instruction(1), instruction(2)], s.global_arrays)  # round 1: both new, both get it all
    first, _ = s.aggregate_train(1, [reply(state(1), metrics(examples=30), node=1),
                                     reply(half_state(2), metrics(examples=10, **{protocol.TIER_KEY: 0.5}), node=2)])
    assert first is not None
    known = s.restrict_to_widths([instruction(n, first) for n in (1, 2, 3)], first)
    sent = [m.content[protocol.ARRAYS].to_torch_state_dict() for m in known]
    # node 3 is new: it got the full model and restricts it itself, as client.app does
    own = principal_placement(sent[2], CFG, 0.5) if placement == "principal" else None
    sent[2] = restrict(sent[2], CFG, 0.5, "canonical", own)
    tiers = {protocol.TIER_KEY: 0.5}
    echoes = [reply(sent[0], metrics(examples=30), node=1), reply(sent[1], metrics(examples=10, **tiers), node=2),
              reply(sent[2], metrics(examples=20, **tiers), node=3)]
    merged, _ = s.aggregate_train(2, echoes)
    assert merged is not None
    x = torch.randn(4, 1, 8, 8)
    torch.testing.assert_close(logits(merged.to_torch_state_dict(), x), logits(first.to_torch_state_dict(), x),
                               rtol=0, atol=1e-5)


def test_principal_placement_is_the_default_for_aligned_aggregations_only() -> None:
    """HeteroFL's fedavg keeps its fixed slices whatever narrow-placement says; a bad value is a ConfigError."""
    assert places_principal("weight", RunSettings.from_run_config({}).narrow_placement)
    assert not places_principal("fedavg", "principal") and not places_principal("weight", "aligned")
    with pytest.raises(ConfigError, match="narrow-placement must be one of"):
        RunSettings.from_run_config({"aggregation": "weight", "narrow-placement": "best"})


def test_clients_writer_saves_each_client_model_at_its_width(tmp_path: Path) -> None:
    """save-clients: every valid client of the round as a glmc checkpoint (its width and example count in the
    metadata), loadable by glmc.io.checkpoint; a rerun of the round replaces the earlier files."""
    clients = [Client(state(3), 10.0, 1.0), Client(state(5), 30.0, 1.0)]
    writer = ClientsWriter(tmp_path, CheckpointMeta(preset="test", config=CFG, seed=0))
    stale = tmp_path / "clients" / "round-002" / "client-7.safetensors"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old")
    writer.on_aggregate(RoundRecord(2), clients)
    files = sorted((tmp_path / "clients" / "round-002").iterdir())
    assert [f.name for f in files] == ["client-0.safetensors", "client-1.safetensors"]
    for path, client in zip(files, clients, strict=True):
        loaded, meta = load_checkpoint(path)
        assert meta.config == CFG and meta.metrics == {"round": 2.0, "examples": client.weight}
        assert all(torch.equal(loaded[k], v) for k, v in client.state.items())


@pytest.mark.parametrize("aggregation", ["fedavg", "fedavg-ft"])
def test_slices_merged_with_no_global_model_take_full_width_shapes_whoever_replied_first(aggregation: str) -> None:
    """Round 1 of independent inits has no anchor: the HeteroFL merge used the first client's state as its base,
    so a narrow first client gave the global model narrow shapes. Every coordinate some client holds is their
    coverage-weighted mean, whatever the order; one no client holds is zero (the exact embedding's fill)."""
    narrow_cfg = scale_width(CFG, 0.5)
    narrow = heterofl.restrict(state(1), CFG, narrow_cfg)
    clients = [Client(narrow, 10.0, 0.5), Client(state(2), 30.0, 1.0)]
    tune = TrainConfig(epochs=1, batch_size=8, lr=1e-2, seed=5, threads=1)
    data = synthetic_images(16)
    results = [merge(order, CFG, aggregation, merge_options(), anchor=None, data=data, tune=tune)
               for order in (clients, clients[::-1])]
    shapes = {k: v.shape for k, v in state(0).items()}
    for result in results:
        assert result.state is not None and {k: v.shape for k, v in result.state.items()} == shapes
    if aggregation == "fedavg":  # the full-width client covers every coordinate: the order cannot matter
        assert all(torch.equal(results[0].state[k], results[1].state[k]) for k in shapes)  # type: ignore[index]
