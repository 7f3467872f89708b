"""Devices: names and their errors, and every public entry point computing where it is told and leaving its results
there. Each device test runs on the CPU here and, where torch sees a GPU, on CUDA too (marked ``cuda``, skipped
without one), against the same computation on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from federation.protocol import Client
from federation.settings import RunSettings
from glmc.archs import build_model, get_arch
from glmc.cli import main
from glmc.device import check_name, device_of, peak_memory_mb, resolve
from glmc.errors import ConfigError
from glmc.match.align import align_pair
from glmc.match.common import sq_distance
from glmc.match.options import ActivationOptions, LearnConfig, MatchOptions
from glmc.merging.corrections import Corrections
from glmc.merging.interpolation import barrier_curve
from glmc.merging.merge import MergeSetup, merge_models
from glmc.merging.options import MergeOptions
from glmc.merging.universe import members
from glmc.symmetry import groups
from glmc.symmetry.canonical import to_model
from glmc.symmetry.exactness import TOLERANCE, invariance_errors
from glmc.symmetry.transforms import MATCHABLE, apply, random_transform
from glmc.train import TrainConfig, evaluate, train
from server.aggregation import merge
from tests.conftest import synthetic_images, synthetic_text
from tests.symmetry_models import CONFIGS, MERGE_CONFIGS, canonical, dataset, merge_data, random_native

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])]
FAMILIES = ["vit-odd", "gpt2-odd"]


def _on(state: dict[str, torch.Tensor], device: str) -> bool:
    return all(v.device.type == device for v in state.values())


def test_names_resolve_or_fail_in_one_line():
    assert resolve("cpu") == torch.device("cpu")
    assert resolve("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert check_name("CUDA:1") == "cuda:1"  # known to glmc whatever this machine has: run configs travel
    for bad in ("tpu", "gpu", "cuda:x"):
        with pytest.raises(ConfigError, match="device"):
            resolve(bad)
    with pytest.raises(ConfigError, match="client-device"):
        RunSettings.from_run_config({"client-device": "gpu0"})
    with pytest.raises(ConfigError, match="precision"):
        TrainConfig(precision="fp8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_missing_gpu_is_refused_before_any_work(capsys):
    assert main(["check", "--model", "vit-tiny", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("glmc: error: device 'cuda'") and "\n" not in err
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        resolve("cuda:0")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_and_evaluation_run_on_the_device(tiny_vit, device, precision):
    arch, data = get_arch("vit"), synthetic_images(64)
    torch.manual_seed(0)
    model = build_model(tiny_vit)
    before = evaluate(model, arch, data)["loss"]
    fit = train(model, arch, data, TrainConfig(epochs=6, batch_size=16, lr=3e-3, device=device, precision=precision),
                progress=False)
    assert next(model.parameters()).device.type == device
    after = evaluate(model, arch, data, precision=precision)
    assert fit["steps"] == 24 and after["loss"] < before  # it learned, in either precision


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", FAMILIES)
def test_weight_matching_on_the_device_undoes_a_planted_transform(name, device):
    cfg = CONFIGS[name]
    arch = get_arch(cfg.family)
    native = random_native(cfg, 3)
    a = canonical(cfg, 3)
    t = random_transform(cfg, MATCHABLE, torch.Generator().manual_seed(5))
    moved = arch.to_native(apply(a, arch.spec, t, cfg.heads), cfg)
    aligned = align_pair(native, moved, cfg, "weight", device=device)
    assert _on(aligned.a, device) and _on(aligned.b, device)
    assert sq_distance(aligned.a, aligned.b) < 1e-8  # the float32 search, to its precision
    curve = barrier_curve(aligned.a, aligned.b, cfg, dataset(cfg), points=3)
    assert abs(curve.barrier) < 1e-8


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [12, groups.CPU_SVD_MAX + 1])  # a GPU's small matrices are factored on the CPU
def test_polar_factor_stays_on_the_device_and_keeps_its_gradient(device, n):
    m = torch.randn(3, n, n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    moved = m.to(device).requires_grad_()
    q = groups.polar(moved)
    assert q.device.type == device
    assert (q.detach().cpu() - groups.polar(m)).abs().max() < 1e-10
    (q * torch.arange(n, dtype=q.dtype, device=q.device)).sum().backward()
    grad = moved.grad
    assert grad is not None and grad.device.type == device and bool(torch.isfinite(grad).all())
    assert grad.abs().max() > 0  # the gradient came through the factor (and the copies, where there are some)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", FAMILIES)
def test_invariance_holds_on_the_device(name, device):
    errors = invariance_errors(CONFIGS[name], seed=1, device=device)
    assert max(errors.values()) <= TOLERANCE


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["activation", "learned", "dual"])
def test_data_methods_on_the_device_match_the_cpu(method, device):
    """Activation and learned matching (and dual, through the same loop) on the device: the aligned B is on it,
    computes B's function exactly, and its barrier equals the CPU's to float32 rounding."""
    cfg = MERGE_CONFIGS["gpt2"]
    data, test = merge_data(cfg), dataset(cfg)
    a, b = random_native(cfg, 0), random_native(cfg, 1)
    options = MatchOptions(activation=ActivationOptions(32), learn=LearnConfig(steps=6, eval_every=3, batch_size=8))
    results = {}
    for dev in dict.fromkeys(["cpu", device]):
        aligned = align_pair(a, b, cfg, method, options, data=data, device=dev)
        assert _on(aligned.a, dev) and _on(aligned.b, dev)
        results[dev] = barrier_curve(aligned.a, aligned.b, cfg, test, points=3, dtype=torch.float32)
    plain = barrier_curve(*(canonical(cfg, s) for s in (0, 1)), cfg, test, points=3, dtype=torch.float32)
    for curve in results.values():  # both ends are the models' own losses, whatever the transform
        assert curve.losses[0] == pytest.approx(plain.losses[0], abs=1e-4)
        assert curve.losses[-1] == pytest.approx(plain.losses[-1], abs=1e-4)
    assert results[device].barrier == pytest.approx(results["cpu"].barrier, abs=2e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_merging_with_corrections_on_the_device_matches_the_cpu(device):
    """Universe matching, norm restoration, refit and REPAIR of three models on the device: the merge stays there
    and computes the CPU merge's function. (Not its parameters to 1e-4: the float32 searches round apart by ~1e-6,
    which the refit's least squares amplifies in single weights.)"""
    cfg = MERGE_CONFIGS["vit"]
    natives = [random_native(cfg, s) for s in range(3)]
    options = MergeOptions("weight", corrections=Corrections(restore_norms=True, refit=32, repair=32))
    setup = MergeSetup(cfg, options, train=synthetic_images(48))
    cpu = merge_models(members(natives, [cfg] * 3), setup).universe
    moved = merge_models(members(natives, [cfg] * 3), dataclasses.replace(setup, options=dataclasses.replace(
        options, device=device))).universe
    assert _on(moved.merged, device)
    x = synthetic_images(16).tensors[0].double()
    arch = get_arch(cfg.family)
    ref = arch.logits(to_model(cpu.merged, cfg), x)
    assert (arch.logits(to_model(moved.merged, cfg), x.to(device)).cpu() - ref).abs().max() <= 1e-3 * ref.abs().max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("aggregation", ["weight", "learned", "fedavg-ft"])
def test_server_aggregation_on_the_device_returns_a_cpu_model(aggregation, device):
    """The strategy's merge on ``server-device``: the global model comes back on the CPU in float32, finite, and GPU
    memory does not grow from one round to the next."""
    cfg = CONFIGS["gpt2-odd"]
    clients = [Client(random_native(cfg, s), 10.0 + s, 1.0) for s in range(3)]
    data = synthetic_text(24, vocab=cfg.vocab_size, context=cfg.context)
    learn, tune = LearnConfig(steps=4, eval_every=2, batch_size=8), TrainConfig(max_steps=3, batch_size=8)
    peaks = []
    for _ in range(3):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        options = MergeOptions(max_iters=1, match=MatchOptions(learn=learn), device=device)
        result = merge(clients, cfg, aggregation, options, anchor=clients[0].state, data=data, tune=tune)
        peaks.append(peak_memory_mb(resolve(device)))
        assert result.state is not None and _on(result.state, "cpu")
        assert all(v.dtype == torch.float32 and bool(torch.isfinite(v).all()) for v in result.state.values())
    assert max(peaks) <= 1.05 * peaks[0] + 1.0  # MiB: no growth from round to round


def test_device_of_names_where_a_state_lives():
    state = {"w": torch.zeros(2)}
    assert device_of(state) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_simulation_asking_for_gpus_on_a_cpu_machine_is_refused_before_ray_waits_for_one(capsys):
    from simulations.compare import main as compare

    assert compare(["--config", "simulations/configs/drift-smoke.toml", "--client-gpus", "0.25"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    assert compare(["--config", "simulations/configs/drift-smoke.toml", "--client-gpus", "-1"]) == 2
