"""What each party of a federated run sees of the data (federation/data.py), and the ClientApp's own pieces."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import fake_hub_copy
from torch.utils.data import TensorDataset

import federation.data
from client.app import Node
from federation.data import client_share, eval_subset, label_counts, pool, server_reads
from federation.settings import RunSettings
from glmc.archs import build_model, get_arch
from glmc.core.config import preset
from glmc.data.fashion_mnist import find_fashion_mnist
from glmc.errors import ConfigError

needs_fashion = pytest.mark.skipif(find_fashion_mnist() is None, reason="Fashion-MNIST is not installed (make data)")


def rows_of(dataset: object) -> set[bytes]:
    """Fingerprints of every image, to compare sets of rows across subsets."""
    return {x.numpy().tobytes() for x in dataset.x}  # type: ignore[attr-defined]


@needs_fashion
def test_server_data_is_held_by_no_client() -> None:
    settings = RunSettings(server_data=500, partitioner="dirichlet", alpha=0.3, seed=1)
    server = pool(settings).server
    assert server is not None and len(server) == 500
    held = set().union(*(rows_of(client_share(settings, p, 4).train) | rows_of(client_share(settings, p, 4).val)
                         for p in range(4)))
    assert not rows_of(server) & held
    assert len(held) + 500 >= 59_000  # every other training image goes to some client (a few duplicates aside)


@needs_fashion
def test_generated_server_data_holds_nothing_back_from_the_clients() -> None:
    split = RunSettings(server_data=500, partitioner="iid", seed=1)
    generated = dataclasses.replace(split, server_data_source="generated")
    assert pool(generated).server is None and pool(split).server is not None
    assert sum(len(client_share(generated, p, 4).train) + len(client_share(generated, p, 4).val) for p in range(4)) \
        == sum(len(client_share(split, p, 4).train) + len(client_share(split, p, 4).val) for p in range(4)) + 500


@needs_fashion
def test_server_reads_a_seeded_part_of_what_was_held_back_and_the_clients_keep_their_shares() -> None:
    held = RunSettings(server_data=500, partitioner="dirichlet", alpha=0.3, seed=1)
    fewer = dataclasses.replace(held, server_reads=50)
    read, all_held = server_reads(fewer), pool(held).server
    assert read is not None and all_held is not None and len(read) == 50 and server_reads(held) is all_held
    assert rows_of(read) < rows_of(all_held) and rows_of(server_reads(fewer)) == rows_of(read)  # seeded
    assert rows_of(client_share(fewer, 2, 4).train) == rows_of(client_share(held, 2, 4).train)
    with pytest.raises(ConfigError, match="server-reads"):
        RunSettings(server_data=500, server_reads=501)
    with pytest.raises(ConfigError, match="server-reads"):
        RunSettings(server_data=500, server_data_source="generated", server_reads=50)


def test_server_steps_fix_the_budget_of_the_refinement_and_the_controls() -> None:
    from glmc.train import train
    from server.app import server_tuning

    settings = RunSettings.from_run_config({"server-data": 64, "server-steps": 7, "aggregation": "fedavg-ft"})
    tune = server_tuning(settings, settings.learn_options)
    data = TensorDataset(torch.rand(5, 1, 28, 28), torch.zeros(5, dtype=torch.long))  # one batch an epoch
    cfg = preset("vit-tiny")
    model = build_model(cfg)
    assert train(model, get_arch("vit"), data, tune, progress=False)["steps"] == 7  # five images, seven times
    assert train(model, get_arch("vit"), data, dataclasses.replace(tune, max_steps=None, epochs=2),
                 progress=False)["steps"] == 2


@needs_fashion
def test_train_limit_caps_the_client_pool_and_keeps_server_data_apart() -> None:
    settings = RunSettings(server_data=300, train_limit=2_000, partitioner="dirichlet", alpha=0.3, seed=2)
    shares = [client_share(settings, p, 4) for p in range(4)]
    held = set().union(*(rows_of(s.train) | rows_of(s.val) for s in shares))
    assert sum(len(s.train) + len(s.val) for s in shares) == 2_000
    assert not rows_of(pool(settings).server) & held
    with pytest.raises(ConfigError, match="train-limit"):
        RunSettings(dataset="shakespeare", partitioner="role", train_limit=100)


@needs_fashion
def test_client_shares_are_seeded_and_label_skewed() -> None:
    settings = RunSettings(partitioner="pathological", classes_per_client=2, seed=3)
    shares = [client_share(settings, p, 5) for p in range(5)]
    again = client_share(settings, 2, 5)
    assert np.array_equal(again.train.y.numpy(), shares[2].train.y.numpy())  # type: ignore[attr-defined]
    for share in shares:
        assert len(np.unique(share.train.y.numpy())) <= 2  # type: ignore[attr-defined]
        assert abs(len(share.val) - 0.1 * (len(share.train) + len(share.val))) <= 1
    counts = np.array(label_counts(settings, 5))
    assert counts.shape == (5, 10) and ((counts > 0).sum(1) <= 2).all()


@needs_fashion
def test_bad_partition_ids_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="outside"):
        client_share(RunSettings(), 5, 3)


@needs_fashion
def test_eval_subset_is_a_seeded_sample() -> None:
    test = pool(RunSettings()).test
    a, b = eval_subset(test, 100, 0), eval_subset(test, 100, 0)
    assert len(a) == 100 and a.indices == b.indices  # type: ignore[attr-defined]
    assert eval_subset(test, 0, 0) is test


@needs_fashion
def test_width_tier_from_node_config_or_the_run_config() -> None:
    class Ctx:
        def __init__(self, node_config: dict[str, object]) -> None:
            self.node_config = node_config

    settings = RunSettings(width_tiers=(1.0, 0.5))
    assert Node.from_context(Ctx({"partition-id": 3, "num-partitions": 4}), settings).tier == 0.5  # type: ignore[arg-type]
    assert Node.from_context(Ctx({"partition-id": 3, "num-partitions": 4, "width-tier": 0.25}),  # type: ignore[arg-type]
                             settings).tier == 0.25
    with pytest.raises(ConfigError, match="partition-id"):
        Node.from_context(Ctx({}), settings)  # type: ignore[arg-type]


@needs_fashion
def test_the_dropout_key_reaches_the_model_clients_train_and_leaves_their_data_alone() -> None:
    own, dropped = RunSettings(), RunSettings(dropout=0.5)
    assert pool(own).task.config == preset(own.model)  # -1: the preset's own dropout (0 for vit-tiny)
    cfg = pool(dropped).task.config
    assert cfg == preset(own.model).replace(dropout=0.5)
    model = build_model(cfg).train()
    x = torch.stack([pool(dropped).test[i][0] for i in range(4)])
    assert not torch.equal(model(x), model(x))  # masks differ from pass to pass: dropout is on
    assert torch.equal(model.eval()(x), model(x))
    assert rows_of(client_share(own, 1, 3).train) == rows_of(client_share(dropped, 1, 3).train)


@pytest.fixture
def fresh_pools() -> Iterator[None]:
    """Empty the per-process pool caches before and after, so no test sees another's data directory."""
    caches = (federation.data._pool, federation.data._label_split_cached)
    for cached in caches:
        cached.cache_clear()
    yield
    for cached in caches:
        cached.cache_clear()


def test_a_fetched_cifar10_copy_splits_by_label_across_clients(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_pools: None
) -> None:
    monkeypatch.setenv("GLMC_DATA", str(tmp_path))
    fake_hub_copy("cifar10", tmp_path / "cifar10", train=300, test=30)
    settings = RunSettings(dataset="cifar10", model="vit-tiny", partitioner="dirichlet", alpha=0.5, seed=4,
                           server_data=20)
    data = pool(settings)
    config = data.task.config
    assert (config.img_size, config.in_chans, config.num_classes, config.patch) == (32, 3, 10, 4)
    assert len(data.test) == 30 and data.server is not None and len(data.server) == 20
    shares = [client_share(settings, p, 3) for p in range(3)]
    for share in shares:
        assert share.train.x.shape[1:] == (3, 32, 32) and len(share.val) > 0  # type: ignore[attr-defined]
    held = set().union(*(rows_of(s.train) | rows_of(s.val) for s in shares))
    assert sum(len(s.train) + len(s.val) for s in shares) == 280 and not rows_of(data.server) & held
    counts = np.array(label_counts(settings, 3))
    assert counts.shape == (3, 10) and counts.sum() == 280
    by_share = [np.bincount(np.concatenate([s.train.labels, s.val.labels]), minlength=10)  # type: ignore[attr-defined]
                for s in shares]
    assert counts.tolist() == [c.tolist() for c in by_share]
    assert federation.data._pool.cache_info().misses == 1  # the label split reads the pool the process already loaded


def test_lr_decay_cosine_starts_each_round_lower_and_none_keeps_the_base() -> None:
    """Round 1 trains at the base rate, later rounds follow the cosine down (never to 0 within the run, and a resumed
    run's later rounds keep the last rate); step keeps the base for the first half, then a tenth of it; multistep a
    tenth after 3/8 of the rounds and a hundredth after 5/8 (HeteroFL's 300 and 500 of 800); without lr-decay every
    round gets the base, and the client uses it."""
    from client.app import train_config

    cosine = RunSettings(num_server_rounds=4, lr_decay="cosine")
    rates = [cosine.round_lr(0.01, r) for r in range(1, 7)]
    assert rates[0] == 0.01
    assert all(a > b > 0 for a, b in itertools.pairwise(rates[:4]))
    assert rates[3] == pytest.approx(0.01 * 0.5 * (1 + np.cos(np.pi * 3 / 4)))
    assert rates[4] == rates[5] == rates[3]
    assert RunSettings(num_server_rounds=4).round_lr(0.01, 3) == 0.01
    config = train_config(cosine, {"lr": 0.01, "batch_size": 32}, 0, torch.device("cpu"), 3)
    assert config.lr == pytest.approx(rates[2]) and config.batch_size == 32
    step = RunSettings(num_server_rounds=4, lr_decay="step")
    assert [step.round_lr(0.01, r) for r in range(1, 6)] == [0.01, 0.01, pytest.approx(0.001), pytest.approx(0.001),
                                                              pytest.approx(0.001)]
    multistep = RunSettings(num_server_rounds=800, lr_decay="multistep")
    assert [multistep.round_lr(0.1, r) for r in (1, 300, 301, 500, 501, 800)] == [
        0.1, 0.1, pytest.approx(0.01), pytest.approx(0.01), pytest.approx(0.001), pytest.approx(0.001)]
    with pytest.raises(ConfigError, match="lr-decay"):
        RunSettings(lr_decay="linear")


def test_lr_decay_rounds_spans_the_schedule_and_the_rounds_after_keep_its_last_rate() -> None:
    """lr-decay-rounds R': the schedule of an R'-round run, then its last rate held to num-server-rounds; 0 spans
    every round. HeteroFL's multistep over 80 rounds (30 and 50) held at a hundredth to round 120."""
    held = RunSettings(num_server_rounds=120, lr_decay="multistep", lr_decay_rounds=80)
    plain = RunSettings(num_server_rounds=80, lr_decay="multistep")
    assert [held.round_lr(1.0, r) for r in range(1, 81)] == [plain.round_lr(1.0, r) for r in range(1, 81)]
    assert [held.round_lr(1.0, r) for r in (30, 31, 50, 51, 120)] == [
        1.0, pytest.approx(0.1), pytest.approx(0.1), pytest.approx(0.01), pytest.approx(0.01)]
    assert RunSettings(num_server_rounds=120, lr_decay="multistep").round_lr(1.0, 31) == 1.0  # 3/8 of 120 is 45
    with pytest.raises(ConfigError, match="lr-decay-rounds"):
        RunSettings(lr_decay_rounds=-1)


def test_label_mask_zeroes_the_logits_of_the_classes_a_share_lacks_and_their_head_rows_learn_nothing() -> None:
    """HeteroFL's masked cross-entropy against a hand computation on a tiny ViT: the training logits are the
    model's with the absent classes' entries 0, so the loss sends no gradient to those classes' head rows."""
    from client.app import label_masked

    torch.manual_seed(0)
    cfg = preset("vit-tiny")
    model, arch = build_model(cfg), get_arch(cfg.family)
    x = torch.randn(6, cfg.in_chans, cfg.img_size, cfg.img_size)
    y = torch.tensor([1, 3, 1, 3, 3, 7])
    present = [1, 3, 7]
    logits = label_masked(arch.logits, y, cfg.num_classes)(model, x)
    hand = arch.logits(model, x).detach().clone()
    hand[:, [c for c in range(cfg.num_classes) if c not in present]] = 0.0
    assert torch.equal(logits.detach(), hand)
    torch.nn.functional.cross_entropy(logits, y).backward()
    grad = model.head.weight.grad
    assert grad is not None
    absent = [c for c in range(cfg.num_classes) if c not in present]
    assert grad[absent].abs().max() == 0 and grad[present].abs().amin(dim=1).max() > 0


def test_label_mask_exclude_is_the_softmax_over_the_present_classes_blind_to_a_shift_of_their_logits() -> None:
    """label-mask-fill "exclude" against a hand computation: the loss is cross-entropy over the present classes'
    logits alone, the absent head rows get no gradient, and a constant added to every present class's head bias
    (what HeteroFL's zeros reward: the client's own classes raised over the unseen ones) leaves the loss as it was."""
    from client.app import label_masked

    torch.manual_seed(0)
    cfg = preset("vit-tiny")
    model, arch = build_model(cfg).double(), get_arch(cfg.family)
    x = torch.randn(6, cfg.in_chans, cfg.img_size, cfg.img_size, dtype=torch.float64)
    y = torch.tensor([1, 3, 1, 3, 3, 7])
    present = torch.tensor([1, 3, 7])

    def masked_loss(fill: str) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(label_masked(arch.logits, y, cfg.num_classes, fill)(model, x), y)

    loss = masked_loss("exclude")
    own = arch.logits(model, x)[:, present]
    hand = torch.nn.functional.cross_entropy(own, torch.searchsorted(present, y))
    assert torch.allclose(loss, hand, rtol=0, atol=1e-12)
    loss.backward()
    grad = model.head.weight.grad
    assert grad is not None
    absent = [c for c in range(cfg.num_classes) if c not in present.tolist()]
    assert torch.isfinite(grad).all() and grad[absent].abs().max() == 0 and grad[present].abs().amin(dim=1).max() > 0
    with torch.no_grad():
        losses = {fill: masked_loss(fill) for fill in ("zero", "exclude")}
        model.head.bias[present] += 5.0
        shifted = {fill: masked_loss(fill) for fill in ("zero", "exclude")}
    assert torch.allclose(shifted["exclude"], losses["exclude"], rtol=0, atol=1e-12)
    assert shifted["zero"] < losses["zero"] - 0.5  # HeteroFL's zeros reward the shift


def test_label_mask_fill_names_its_choices_and_needs_label_mask() -> None:
    """A fill outside its choices, or one set without label-mask, is refused in one line naming the key."""
    assert RunSettings(label_mask=True, label_mask_fill="exclude", partitioner="shard").label_mask_fill == "exclude"
    with pytest.raises(ConfigError, match="label-mask-fill must be one of"):
        RunSettings(label_mask=True, label_mask_fill="minus", partitioner="shard")
    with pytest.raises(ConfigError, match="set label-mask = true"):
        RunSettings(label_mask_fill="exclude", partitioner="shard")


def test_label_mask_runs_on_label_splits_only() -> None:
    """A natural split's clients hold text, not labels: label-mask there is refused in one line naming the key."""
    assert RunSettings(label_mask=True, partitioner="shard").label_mask
    with pytest.raises(ConfigError, match="label-mask"):
        RunSettings(label_mask=True, model="gpt2-tiny", dataset="shakespeare", partitioner="role")
