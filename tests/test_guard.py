"""The min-alignment-gain guard made visible: the strategy's start-up summary says what it does, and the run summary
counts the rounds it set aside."""

from __future__ import annotations

import dataclasses
import logging
import random

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.supercore.task_identity import TaskIdentity
from test_strategy import (
    CFG,
    JoiningGrid,
    _permuted,
    as_numpy,
    instruction,
    merge_options,
    metrics,
    mixed_schema,
    mixed_strategy,
    reply,
    state,
    strategy,
)

from federation import protocol
from federation.restriction import received
from glmc.archs import build_model, get_arch
from glmc.core.config import scale_width
from glmc.merging.merge import MergeSetup, merge_models
from glmc.merging.options import MergeOptions
from glmc.merging.universe import Member
from server.guard import guard_note, set_aside_note
from server.records import RoundRecord
from server.strategy import SymmetryAwareFedAvg


def _summary(caplog: pytest.LogCaptureFixture, aggregation: str, **kwargs: object) -> str:
    caplog.clear()
    with caplog.at_level(logging.INFO):
        strategy(aggregation, **kwargs).summary()
    return caplog.text


def test_the_start_up_summary_explains_the_guard(caplog):
    text = _summary(caplog, "weight", options=merge_options(min_gain=0.05))
    assert "Aggregation: weight" in text
    assert "less than 5% closer" in text and "as FedAvg" in text and "init='independent'" in text
    assert "every round keeps its alignment" in _summary(caplog, "weight", options=merge_options(min_gain=0.0))
    assert "not used by aggregation 'fedrolex'" in _summary(caplog, "fedrolex")
    assert "is refined from where the clients were placed" in _summary(caplog, "learned",
                                                                      options=merge_options(min_gain=0.05))


def test_mixed_widths_are_guarded_too():
    assert "where they were placed" in guard_note("activation", 0.05, [1.0, 0.5])
    assert "less than 10% closer" in guard_note("activation", 0.1, [1.0])


def _mixed_round(aggregation: str, min_gain: float) -> tuple[dict[str, np.ndarray], RoundRecord]:
    """One round of two fine-tunes of the global model and a narrow client's fine-tuned principal restriction."""
    s = mixed_strategy(aggregation, options=merge_options(min_gain=min_gain), min_train_nodes=2)
    sent = s.global_arrays.to_torch_state_dict()  # type: ignore[union-attr]
    s.node_tiers[3] = 0.5
    s.restrict_to_widths([instruction(n) for n in (1, 2, 3)], s.global_arrays)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(7)
    narrow = received(sent, CFG, 0.5, aggregation, "principal", 1)
    replies = [reply({k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()},
                     metrics(**{protocol.TIER_KEY: tier}), node=node)
               for node, base, tier in ((1, sent, 1.0), (2, sent, 1.0), (3, narrow, 0.5))]
    s.current = RoundRecord(1)
    arrays, _ = s.aggregate_train(1, replies)
    assert arrays is not None
    return as_numpy(arrays), s.current


def test_a_mixed_width_round_set_aside_is_the_unmatched_merge_where_the_clients_were_placed():
    """Fine-tunes of one global model at two widths: the guard sets their matching aside, and the round is the
    canonical ablation's merge (the clients where the server placed them, unmatched), bit for bit; with the guard
    off the matching is kept and the merge differs."""
    guarded, record = _mixed_round("weight", 0.5)
    canonical, _ = _mixed_round("canonical", 0.0)
    kept, kept_record = _mixed_round("weight", 0.0)
    assert record.unaligned and record.distance_after == record.distance_before
    assert not kept_record.unaligned and kept_record.distance_after != kept_record.distance_before
    for key, value in guarded.items():
        np.testing.assert_array_equal(value, canonical[key])
    assert any(not np.array_equal(value, kept[key]) for key, value in guarded.items())


class EightNodes(JoiningGrid):
    """Eight connected nodes: 1-3 at full width, 4-8 at half."""

    def __init__(self) -> None:
        super().__init__(8)

    def get_node_ids(self) -> list[int]:
        return list(range(1, 9))


def _federation(aggregation: str, min_gain: float, rounds: int = 5) -> list[tuple[dict[str, np.ndarray], bool]]:
    """``rounds`` rounds of half of EightNodes, sampled from one seed; each node's 'training' is a seeded step from
    the model it was sent (restricting the full model itself when the server has not heard from it yet)."""
    random.seed(0)  # flwr's sampler
    s = SymmetryAwareFedAvg(aggregation, mixed_schema(), CFG, min_train_nodes=2, fraction_train=0.5,
                            options=merge_options(min_gain=min_gain))
    arrays, seen = ArrayRecord(state(0)), []  # type: ignore[arg-type]
    for number in range(1, rounds + 1):
        replies = []
        for msg in s.configure_train(number, arrays, ConfigRecord(), EightNodes()):
            node = msg.metadata.dst_node_id
            tier = 1.0 if node <= 3 else 0.5
            sent = msg.content[protocol.ARRAYS].to_torch_state_dict()
            if any(sent[k].shape != v.shape for k, v in build_model(scale_width(CFG, tier)).state_dict().items()):
                sent = received(sent, CFG, tier, aggregation, "principal", number)  # as client.app does
            g = torch.Generator().manual_seed(100 * number + node)
            trained = {k: v + 0.05 * v.pow(2).mean().sqrt() * torch.randn(v.shape, generator=g)
                       for k, v in sent.items()}
            replies.append(reply(trained, metrics(examples=10 + node, **{protocol.TIER_KEY: tier}), node=node))
        new, _ = s.aggregate_train(number, replies)
        arrays = new if new is not None else arrays
        seen.append((as_numpy(arrays), s.current.unaligned))
    return seen


def test_a_federation_whose_every_round_is_set_aside_is_canonicals_bit_for_bit(monkeypatch):
    """Over several rounds, with nodes the server has and has not heard from: weight, its matching set aside every
    round, sends and merges what canonical does, so the two runs' global models are equal round after round."""
    for key in ("_task_id", "_run_id", "_node_id"):  # what the ServerApp process sets before messages are made
        monkeypatch.setattr(TaskIdentity, key, 1)
    guarded, canonical = _federation("weight", 0.9), _federation("canonical", 0.0)
    assert all(unaligned for _, unaligned in guarded)
    for (ours, _), (theirs, _) in zip(guarded, canonical, strict=True):
        assert all(np.array_equal(ours[k], theirs[k]) for k in ours)
    kept = _federation("weight", 0.0)
    assert any(not np.array_equal(kept[-1][0][k], guarded[-1][0][k]) for k in kept[-1][0])


def test_a_mixed_width_merge_set_aside_keeps_the_matching_in_its_history():
    """The matching a guard sets aside was still done: the merge's history (its cost) holds it, then the unmatched
    merge."""
    half = scale_width(CFG, 0.5)
    base = state(0)
    g = torch.Generator().manual_seed(3)
    noisy = [{k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(2)]
    narrow = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in received(base, CFG, 0.5, "weight",
                                                                                     "aligned", 1).items()}
    members = [Member(s, c, 1.0) for s, c in ((noisy[0], CFG), (noisy[1], CFG), (narrow, half))]
    merged = merge_models(members, MergeSetup(CFG, MergeOptions("weight", max_iters=1, min_gain=0.5)), anchor=base)
    assert merged.set_aside and not merged.averaged_by_caller
    assert [r.method for r in merged.universe.history] == ["weight", "none"]


@pytest.mark.parametrize("narrow", [False, True], ids=["equal-widths", "mixed-widths"])
def test_learned_set_aside_refines_the_unmatched_merge_and_kept_refines_the_matched_one(narrow):
    """The guard judges learned's matching alone: set aside, the refinement starts from the clients where they were
    placed, unmatched (its result is the refinement of the unmatched universe, bit for bit) and nothing is left to the
    caller's FedAvg; kept, it starts from the matched ones."""
    from glmc.match.options import LearnConfig, MatchOptions
    from glmc.merging.universe import refine_merge, universe_match
    from glmc.symmetry.canonical import canonicalize
    from tests.symmetry_models import dataset

    half, base = scale_width(CFG, 0.5), state(0)
    g = torch.Generator().manual_seed(5)
    tuned = [{k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(2)]
    third = received(base, CFG, 0.5, "learned", "aligned", 1) if narrow else base
    members = [Member(s, c, w) for s, c, w in ((tuned[0], CFG, 1.0), (tuned[1], CFG, 2.0),
                                               (third, half if narrow else CFG, 1.0))]
    learn = LearnConfig(steps=3, eval_every=1, batch_size=4, val_max=4, dtype="float64")
    options = MergeOptions("learned", MatchOptions(learn=learn), max_iters=1, min_gain=0.5)
    data = dataset(CFG, n=12)
    merged = merge_models(members, MergeSetup(CFG, options, data), reference=0)
    assert merged.set_aside and not merged.averaged_by_caller
    assert [r.method for r in merged.universe.history] == ["weight", "none", "refine"]
    arch = get_arch(CFG.family)
    canonical = [Member(canonicalize(arch, m.state, m.config, dtype=torch.float64), m.config, m.weight)
                 for m in members]
    unmatched = universe_match(canonical, CFG, dataclasses.replace(options, method="none"))
    refine_merge(unmatched, options, data, [1.0, 2.0, 1.0], reference=0)
    for key, value in unmatched.merged.items():
        torch.testing.assert_close(merged.universe.merged[key], value, rtol=0, atol=1e-12)
    kept = merge_models(members, MergeSetup(CFG, dataclasses.replace(options, min_gain=0.0), data), reference=0)
    assert not kept.set_aside and [r.method for r in kept.universe.history] == ["weight", "refine"]


def test_the_run_summary_counts_the_rounds_set_aside():
    """Round 1: fine-tunes of one model (matching gains nothing: set aside); round 2: permuted copies (kept)."""
    base = state(3)
    guarded = strategy("weight", options=merge_options(min_gain=0.05))
    guarded.global_arrays = ArrayRecord(base)  # type: ignore[arg-type]
    tuned = [{k: v + 0.01 * torch.randn_like(v) for k, v in base.items()} for _ in range(2)]
    rounds = [tuned, [base, _permuted(base, 1)]]
    for number, states in enumerate(rounds, start=1):
        guarded.current = RoundRecord(number)
        arrays, _ = guarded.aggregate_train(number, [reply(s, metrics(), node=i + 1) for i, s in enumerate(states)])
        assert arrays is not None
        guarded.end_round(number, arrays, None)
    assert [r.unaligned for r in guarded.records] == [True, False]
    note = set_aside_note([RoundRecord(0), *guarded.records])  # round 0, the initial model, is not counted
    assert "set aside 1 of 2 aggregated rounds" in note and "every one" not in note
    assert "every one" in set_aside_note(guarded.records[:1])
    assert set_aside_note(guarded.records[1:]).endswith("set aside 0 of 1 aggregated rounds")


def test_the_comparison_summary_explains_its_set_aside_column(tmp_path):
    """A grid with a guarded run: summary.md's table counts the rounds set aside and says what they were."""
    from simulations import compare

    config = compare.PROJECT / "simulations" / "configs" / "drift-smoke.toml"
    exp = compare.Experiment.load(config)
    rows = [{"cell": f"{agg}_s{seed}", "split": "dirichlet0.1", "widths": "equal", "aggregation": agg, "seed": seed,
             "status": "finished:completed", "seconds": 1.0,
             "records": [{"round": k, "central_accuracy": 0.5, "mean_client_accuracy": None, "align_seconds": 0.0,
                          "round_seconds": 1.0, "unaligned": agg != "fedavg" and k > 0} for k in range(3)]}
            for agg in exp.aggregations for seed in exp.seeds]
    table, _ = compare.write_outputs(exp, rows, tmp_path, config)
    assert compare.SET_ASIDE in table and "| 100 ± 0 |" in table
    assert compare.SET_ASIDE_NOTE in (tmp_path / "summary.md").read_text()
