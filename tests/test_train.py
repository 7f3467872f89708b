"""The shared training loop: reproducible, learns, evaluates by hand-checkable formulas."""

import itertools
import math

import pytest
import torch
from conftest import synthetic_images, synthetic_text

from glmc.archs import build_model, get_arch
from glmc.errors import ConfigError
from glmc.train import TrainConfig, cosine_schedule, evaluate, seed_everything, train


def _trained_state(cfg, data, seed: int, steps: int = 4) -> dict[str, torch.Tensor]:
    seed_everything(seed)
    model = build_model(cfg)
    train(
        model,
        get_arch(cfg.family),
        data,
        TrainConfig(batch_size=16, seed=seed, max_steps=steps, threads=1),
        progress=False,
    )
    return model.state_dict()


def test_same_seed_gives_identical_weights(tiny_vit, images):
    a, b = _trained_state(tiny_vit, images, 7), _trained_state(tiny_vit, images, 7)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_different_seed_gives_different_weights(tiny_vit, images):
    a, b = _trained_state(tiny_vit, images, 7), _trained_state(tiny_vit, images, 8)
    assert not all(torch.equal(a[k], b[k]) for k in a)


def test_same_seed_gives_identical_weights_for_text(tiny_gpt2, text):
    a, b = _trained_state(tiny_gpt2, text, 1), _trained_state(tiny_gpt2, text, 1)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", ["vit", "gpt2"])
def test_training_lowers_the_test_loss(family, tiny_vit, tiny_gpt2):
    cfg = tiny_vit if family == "vit" else tiny_gpt2
    make = synthetic_images if family == "vit" else synthetic_text
    train_set, test_set = make(n=192, seed=0), make(n=64, seed=1)
    arch = get_arch(family)
    seed_everything(0)
    model = build_model(cfg)
    before = evaluate(model, arch, test_set)
    fit = train(model, arch, train_set, TrainConfig(epochs=6, batch_size=16, lr=3e-3, threads=1), progress=False)
    after = evaluate(model, arch, test_set)
    assert fit["steps"] == 6 * 12
    assert after["loss"] < 0.5 * before["loss"]
    assert after["accuracy"] > 0.9


def test_evaluate_matches_hand_computed_values(tiny_vit, images):
    """A zeroed head gives uniform logits: loss log(3), and argmax picks class 0 on ties."""
    model = build_model(tiny_vit)
    torch.nn.init.zeros_(model.head.weight)
    torch.nn.init.zeros_(model.head.bias)
    metrics = evaluate(model, get_arch("vit"), images, batch_size=10)
    labels = images.tensors[1]
    assert metrics["loss"] == pytest.approx(math.log(3), rel=1e-6)
    assert metrics["accuracy"] == pytest.approx(float((labels == 0).float().mean()))


def test_max_steps_stops_early(tiny_gpt2, text):
    fit = train(
        build_model(tiny_gpt2),
        get_arch("gpt2"),
        text,
        TrainConfig(epochs=5, batch_size=8, max_steps=3, threads=1),
        progress=False,
    )
    assert fit["steps"] == 3


def test_cosine_schedule_warms_up_then_decays_to_zero():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    schedule = cosine_schedule(opt, total=100, warmup=0.1)
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))
    assert lrs[-1] < 1e-3


@pytest.mark.parametrize("bad", [{"epochs": 0}, {"lr": 0.0}, {"warmup": 1.0}, {"max_steps": 0}])
def test_bad_train_config_is_a_config_error(bad):
    with pytest.raises(ConfigError):
        TrainConfig(**bad)
