"""Models stored in half precision go in without a wider copy of the pair: the read check at scale runs in float32
on the model's own tensors, readers keep the stored precision when asked, weight matching widens a bfloat16 state
tensor by tensor, and ``glmc align --precision stored`` undoes a transform planted by hand on a Llama that
``glmc train`` trained here and transformers saved in bfloat16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from glmc.archs import build_model, get_arch
from glmc.cli import main as glmc
from glmc.core.config import PRESETS
from glmc.core.state import Widened, cast, search_view
from glmc.errors import ConfigError
from glmc.io import formats, live
from glmc.match.weight import weight_match
from glmc.symmetry.canonical import canonicalize
from glmc.symmetry.transforms import MATCHABLE, apply, random_transform
from simulations.bench.planting import plant_llama
from tests.hf_models import hf_logits, trained_folder

FAMILIES = ["vit-tiny", "gpt2-tiny", "llama-tiny", "neox-tiny", "bert-tiny"]


def _model(name: str, dtype: torch.dtype) -> torch.nn.Module:
    cfg = PRESETS[name]
    return build_model(cfg if cfg.vocab_size > 0 else cfg.replace(vocab_size=65)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FAMILIES)
def test_the_lean_read_check_reads_every_family_in_its_own_precision(
        name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(live, "FLOAT64_CHECK_PARAMS", 0)  # every model counts as a billion-parameter one
    model = _model(name, dtype).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _, _, state = live.read_module(model)
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {dtype}
    assert model.training and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("lean", [False, True])
def test_both_read_checks_refuse_a_function_the_config_does_not_describe(
        lean: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if lean:
        monkeypatch.setattr(live, "FLOAT64_CHECK_PARAMS", 0)
    model = _model("llama-tiny", torch.float32)
    model.model.norm.variance_epsilon = 0.5  # the config still says 1e-6
    with pytest.raises(ConfigError, match="computes other logits") as err:
        live.read_module(model)
    assert "\n" not in str(err.value)


def test_readers_keep_the_stored_precision_only_when_asked(tmp_path: Path) -> None:
    model = _model("gpt2-tiny", torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    native, meta = formats.read(tmp_path / "hf")
    formats.write(tmp_path / "c.safetensors", "glmc", native, meta, "bfloat16")
    for path in (tmp_path / "hf", tmp_path / "c.safetensors"):
        assert {v.dtype for v in formats.read(path)[0].values()} == {torch.float32}
        stored = formats.read(path, stored=True)[0]
        assert {v.dtype for v in stored.values()} == {torch.bfloat16}
        assert all(torch.equal(stored[k].float(), native[k]) for k in native)


def test_weight_matching_reads_a_bfloat16_state_widened_as_its_float32_copy() -> None:
    cfg = PRESETS["llama-tiny"].replace(vocab_size=65)
    arch = get_arch(cfg.family)
    a = canonicalize(arch, build_model(cfg).state_dict(), cfg, dtype=torch.bfloat16)
    t = random_transform(cfg, MATCHABLE, torch.Generator().manual_seed(3))
    b = apply(a, arch.spec, t, cfg.heads)
    assert isinstance(search_view(a, torch.float32), Widened) and b["head.w"].dtype == torch.bfloat16
    wide_b = apply(cast(a, torch.float32), arch.spec, t, cfg.heads)
    assert all(torch.equal(v, wide_b[k].to(torch.bfloat16)) for k, v in b.items())  # moved in float32, rounded once
    args = (arch.spec, cfg.depth, cfg.heads)
    half = weight_match(a, b, *args, rotary=cfg.rotary_dim)
    wide = weight_match(cast(a, torch.float32), cast(b, torch.float32), *args, rotary=cfg.rotary_dim)
    assert half.objective == wide.objective
    assert all(torch.equal(p, q) for p, q in zip(half.transform.mlp, wide.transform.mlp, strict=True))


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.Tensor, torch.Tensor]:
    """A llama-tiny trained here, saved by transformers in bfloat16, and a copy moved by a transform planted on
    its HF names (in float32, then rounded to bfloat16 and saved), with B's float64 logits on a probe."""
    trained = trained_folder(tmp_path_factory, "llama-tiny", 150)
    root = tmp_path_factory.mktemp("bf16")
    model = LlamaForCausalLM.from_pretrained(str(trained), dtype=torch.bfloat16)
    model.save_pretrained(str(root / "a"))
    moved = plant_llama({k: v.float() for k, v in model.state_dict().items()}, model.config, 7)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in moved.items()})
    model.save_pretrained(str(root / "b"))
    for folder in (root / "a", root / "b"):
        (folder / formats.GLMC_JSON).write_text((trained / formats.GLMC_JSON).read_text())
    x = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    want = hf_logits(LlamaForCausalLM(model.config), {k: v.double() for k, v in model.state_dict().items()}, x)
    return root / "a", root / "b", x, want


def test_align_in_the_stored_precision_undoes_a_planted_transform(bf16_pair, tmp_path: Path) -> None:
    a, b, x, want = bf16_pair
    outs = {}
    for precision in ("stored", "float64"):
        out = tmp_path / precision
        assert glmc(["align", str(a), str(b), "--out", str(out), "--precision", precision, "--dtype",
                     "bfloat16"]) == 0
        outs[precision] = formats.read(out, stored=True)[0]
        assert {v.dtype for v in outs[precision].values()} == {torch.bfloat16}
    state_a, meta = formats.read(a)
    cfg = meta.config
    target = canonicalize(get_arch(cfg.family), state_a, cfg, dtype=torch.float64)
    ours = canonicalize(get_arch(cfg.family), outs["stored"], cfg, dtype=torch.float64)
    moved = canonicalize(get_arch(cfg.family), formats.read(b)[0], cfg, dtype=torch.float64)

    def distance(s: dict[str, torch.Tensor]) -> float:
        return (sum(float(((s[k] - target[k]) ** 2).sum()) for k in target)
                / sum(float((v ** 2).sum()) for v in target.values())) ** 0.5

    assert distance(moved) > 0.5 and distance(ours) <= 1e-2  # bfloat16 keeps about 3 digits
    got = hf_logits(LlamaForCausalLM.from_pretrained(str(tmp_path / "stored")),
                    {k: v.double() for k, v in outs["stored"].items()}, x)
    assert float((got - want).abs().max()) <= 0.01 * float(want.abs().max())  # B's function, to bfloat16
    assert all(float((outs["stored"][k].float() - v.float()).abs().max()) <= 0.01 for k, v in outs["float64"].items())


def test_align_refuses_what_the_stored_precision_cannot_do_in_one_line(bf16_pair, tmp_path: Path, capsys,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, _, _ = bf16_pair
    out = str(tmp_path / "c")
    assert glmc(["align", str(a), str(b), "--out", out, "--precision", "stored", "--method", "activation"]) == 2
    assert "runs the models" in capsys.readouterr().err
    monkeypatch.setattr("glmc.device.available_memory", lambda: 10_000)
    assert glmc(["align", str(a), str(b), "--out", out, "--method", "activation"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--precision float32, or align them by a data-free method" in err and "\n" not in err
    for precision in ("float64", "stored"):  # a data-free method holds only the two models: nothing to refuse
        assert glmc(["align", str(a), str(b), "--out", out, "--precision", precision, "--force"]) == 0
        assert json.loads(capsys.readouterr().out)["dtype"] == "float32"
