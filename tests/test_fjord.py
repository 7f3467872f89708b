"""FjORD (Horváth et al., NeurIPS 2021) against hand computations on tiny models: an Ordered Dropout step at width p
is a plain step of the leading-p model HeteroFL's restrict builds, one allowed width is plain training, the widths
drawn are the run's tiers up to the client's own, the server averages as HeteroFL does, and a real run completes."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import synthetic_images, synthetic_text
from test_flower_sim import needs_data, run_in_process, server_identity  # noqa: F401  (a fixture, used by name)
from test_strategy import CFG, HALF, as_numpy, metrics, mixed_strategy, reply, state
from test_strategy import half_state as narrow_state
from torch.utils.data import TensorDataset

from federation import protocol
from federation.restriction import restrict
from federation.settings import AVERAGING, SLICED, RunSettings
from glmc.archs import build_model, get_arch
from glmc.core.config import ModelConfig, preset, scale_width
from glmc.errors import ConfigError
from glmc.io.checkpoint import load_checkpoint
from glmc.merging import heterofl
from glmc.ordered_dropout import OrderedDropout, slice_positions
from glmc.train import TrainConfig, make_optimizer, seed_everything, train, train_step

FAMILIES = ("vit-tiny", "llama-tiny", "gpt2-tiny", "neox-tiny", "bert-tiny")  # llama-tiny: two query heads per KV


def tiny(name: str, **changes: object) -> ModelConfig:
    """The preset on conftest's synthetic data: 8×8 images of 3 classes, or a 7-symbol vocabulary, context 12."""
    cfg = preset(name)
    image = get_arch(cfg.family).modality == "image"
    return cfg.replace(**({"img_size": 8, "patch": 4, "num_classes": 3} if image else {"vocab_size": 7, "context": 12}),
                       **changes)


def data(cfg: ModelConfig) -> TensorDataset:
    return synthetic_images() if get_arch(cfg.family).modality == "image" else synthetic_text()


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", FAMILIES)
def test_a_step_at_width_p_is_a_plain_step_of_the_leading_p_model(name: str) -> None:
    """Gradient for gradient, the client's step at p is the plain step of heterofl.restrict's model; outside the
    slice every gradient is exactly 0, and AdamW's first step moves those entries by its weight decay alone."""
    own = tiny(name)
    narrow, arch = scale_width(own, 0.5), get_arch(own.family)
    torch.manual_seed(0)
    model, sub = build_model(own), build_model(narrow)
    sub.load_state_dict(heterofl.restrict(model.state_dict(), own, narrow))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = data(own)[:8]
    cfg = TrainConfig(lr=1e-2)
    at_p = dataclasses.replace(arch, logits=partial(OrderedDropout(model, arch, (own, narrow), 0).logits_at, narrow))
    train_step(model, at_p, x, y, make_optimizer(model, cfg), cfg.grad_clip)
    train_step(sub, arch, x, y, make_optimizer(sub, cfg), cfg.grad_clip)
    full = grads(model)
    assert full.keys() == before.keys()
    restricted = heterofl.restrict(full, own, narrow)
    for k, g in grads(sub).items():
        assert torch.equal(restricted[k], g), k
        assert torch.count_nonzero(full[k]) == torch.count_nonzero(g), k  # none outside the slice
    stepped = heterofl.restrict(model.state_dict(), own, narrow)
    for k, v in sub.state_dict().items():
        torch.testing.assert_close(stepped[k], v)
    for k, where in slice_positions(model, own, narrow).items():
        outside = torch.ones(before[k].numel(), dtype=torch.bool)
        outside[where.reshape(-1)] = False
        decay = 1 - cfg.lr * cfg.weight_decay if before[k].ndim >= 2 else 1.0  # make_optimizer's groups
        assert not full[k].reshape(-1)[outside].any(), k
        after = dict(model.named_parameters())[k].detach().reshape(-1)[outside]
        torch.testing.assert_close(after, before[k].reshape(-1)[outside] * decay, rtol=0, atol=1e-7)


def trained(cfg: ModelConfig, widths: tuple[ModelConfig, ...]) -> dict[str, torch.Tensor]:
    """The state after 6 steps of training from one seeded start, drawing from ``widths`` (none: plain training)."""
    seed_everything(3)
    model, arch = build_model(cfg), get_arch(cfg.family)
    ordered = OrderedDropout(model, arch, widths, seed=5) if widths else None
    train(model, arch, data(cfg), TrainConfig(batch_size=16, max_steps=6, seed=5, threads=1), progress=False,
          step_logits=ordered)
    return model.state_dict()


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["vit-tiny", "llama-tiny"])
def test_with_one_allowed_width_fjord_training_is_plain_training_bit_for_bit(name: str) -> None:
    """Ordered Dropout over one width (a client at the run's smallest tier) trains exactly as plain training, with
    dropout drawing from the same RNG; over two widths it reproduces from its seed and is not plain training."""
    cfg = tiny(name, dropout=0.1)
    plain = trained(cfg, ())
    assert same(trained(cfg, (cfg,)), plain) and same(trained(cfg, (cfg, cfg)), plain)
    ordered = trained(cfg, (cfg, scale_width(cfg, 0.5)))
    assert same(trained(cfg, (cfg, scale_width(cfg, 0.5))), ordered) and not same(ordered, plain)


def test_the_widths_drawn_are_the_runs_tiers_up_to_the_clients_uniformly_and_seeded() -> None:
    settings = RunSettings(aggregation="fjord", width_tiers=(0.5, 1.0, 0.25, 0.5), model="vit-fl")
    assert [settings.ordered_tiers(t) for t in (1.0, 0.5, 0.25)] == [(1.0, 0.5, 0.25), (0.5, 0.25), (0.25,)]
    assert RunSettings(aggregation="fedavg", width_tiers=(1.0, 0.5)).ordered_tiers(1.0) == (1.0,)
    full = preset("vit-fl")
    for tier in (1.0, 0.5):
        own = scale_width(full, tier)
        widths = tuple(scale_width(full, t) for t in settings.ordered_tiers(tier))
        model = build_model(own)

        def draws(seed: int, widths: tuple[ModelConfig, ...] = widths, model: torch.nn.Module = model) -> list:
            sampler = OrderedDropout(model, get_arch("vit"), widths, seed)
            return [sampler.draw() for _ in range(600)]

        counts = Counter(draws(7))
        assert counts.keys() == set(widths) and all(cfg.width <= own.width for cfg in counts)
        assert all(abs(n - 600 / len(widths)) < 60 for n in counts.values()), counts  # over 5 s.d. of a uniform
        assert draws(7) == draws(7) and draws(7) != draws(8)


def test_widths_that_are_no_leading_slices_of_the_model_are_refused_in_one_line() -> None:
    own = tiny("llama-tiny")
    model, arch = build_model(own), get_arch("llama")
    for widths in [(own, own.replace(head_dim=4)), (own, scale_width(own, 0.5).replace(depth=1)),
                   (scale_width(own, 0.5),)]:  # other heads, other depth, a model wider than the widest width
        with pytest.raises(ConfigError, match="ordered dropout"):
            OrderedDropout(model, arch, widths, seed=0)


def test_fjord_merges_as_heterofl_in_every_round_and_sends_the_leading_slice() -> None:
    """Its average is HeteroFL's (by hand in test_strategy, which runs it for fjord too) in a late round as well:
    the slices never roll; the narrow downlink is the leading slice of the merge."""
    assert "fjord" in SLICED and "fjord" in AVERAGING

    def merged(aggregation: str) -> dict[str, torch.Tensor]:
        replies = [reply(state(1), metrics(examples=30), node=1),
                   reply(narrow_state(2), metrics(examples=10, **{protocol.TIER_KEY: 0.5}), node=2)]
        arrays, _ = mixed_strategy(aggregation).aggregate_train(6, replies)
        assert arrays is not None
        return {k: torch.from_numpy(v) for k, v in as_numpy(arrays).items()}

    fjord = merged("fjord")
    assert same(fjord, merged("fedavg"))
    fc1 = "blocks.0.mlp.fc1.weight"
    sent = restrict(fjord, CFG, 0.5, "fjord", server_round=7)
    assert torch.equal(sent[fc1], fjord[fc1][:HALF.mlp, :HALF.width])
    assert same(sent, heterofl.restrict(fjord, CFG, HALF))


@needs_data
@pytest.mark.usefixtures("server_identity")
def test_a_fjord_run_draws_a_width_each_step_and_scores_every_tier(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The real ServerApp and ClientApps in-process, tiers 1 and 0.5 over 3 nodes: each of the two full nodes'
    2 steps a round draws tier 1 or 0.5, the half node trains plainly; every round records each tier's accuracy and
    round 2's narrow node gets the leading slice of the round-1 model."""
    drawn: list[ModelConfig] = []
    draw = OrderedDropout.draw

    def recorded(self: OrderedDropout) -> ModelConfig:
        drawn.append(draw(self))
        return drawn[-1]

    monkeypatch.setattr(OrderedDropout, "draw", recorded)
    grid = run_in_process(tmp_path, **{"num-server-rounds": 2, "aggregation": "fjord", "target-accuracy": 0.01})
    run = tmp_path / "inproc"
    records = json.loads((run / "metrics.json").read_text())["records"]
    assert [r["round"] for r in records] == [0, 1, 2] and all(r["valid"] == 3 for r in records[1:])
    for r in records:
        assert set(r["tier_metrics"]) == {"accuracy@1", "loss@1", "accuracy@0.5", "loss@0.5"}
        assert r["tier_metrics"]["accuracy@1"] == r["central_accuracy"]
    full = preset("vit-tiny")
    assert len(drawn) == 2 * 2 * 2 and {cfg.width for cfg in drawn} == {full.width, full.width // 2}
    global1, _ = load_checkpoint(run / "checkpoints" / "round-001.safetensors")
    [narrow] = [m for m in grid.sent[2] if m.content[protocol.ARRAYS]["norm.weight"].shape[0] < full.width]
    sent = narrow.content[protocol.ARRAYS].to_torch_state_dict()
    assert same(dict(sent), heterofl.restrict(global1, full, scale_width(full, 0.5)))
