"""Standard checkpoints in and out: models built and saved by timm and transformers themselves go through read →
check → align (a planted symmetry transform is undone) → merge → write → reload with plain timm / transformers,
and compute what they computed."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from timm.models.vision_transformer import VisionTransformer

import glmc
from glmc.archs import get_arch
from glmc.cli import main
from glmc.cli.export import DTYPE_NAMES
from glmc.core.state import cast
from glmc.io.formats import DTYPES, read
from glmc.io.live import like, read_module
from glmc.symmetry.canonical import canonicalize
from glmc.symmetry.exactness import TOLERANCE, classes_for, invariance_errors
from glmc.symmetry.transforms import MATCHABLE, apply, random_transform
from tests.interop_models import (
    HF,
    HF_VIT,
    TIMM,
    TIMM_FOLDER,
    VIT_VARIANTS,
    Library,
    gpt2,
    hf_vit,
    logits,
    perturb,
    vit,
    vit_kwargs,
)

F32 = 1e-4  # the bar for the same function in float32 (files are written in float32)
CASES = {"gpt2-tied": (lambda: gpt2(tied=True), HF, {}), "gpt2-untied": (lambda: gpt2(tied=False), HF, {})} | {
    name: (lambda name=name: vit(name), TIMM, vit_kwargs(name)) for name in VIT_VARIANTS} | {
    "vit-hub-folder": (lambda: vit("vit-dinov2-like"), TIMM_FOLDER, {}), "hf-vit": (hf_vit, HF_VIT, {}),
    "hf-vit-relu-no-qkv-bias": (lambda: hf_vit(hidden_act="relu", qkv_bias=False, layer_norm_eps=1e-6), HF_VIT, {})}


@pytest.mark.parametrize("name", VIT_VARIANTS)
def test_every_symmetry_class_is_exact_on_timm_variants(name):
    """Transforms applied by glmc, loaded back into the VisionTransformer timm's own class built: same logits."""
    kwargs = {k: v for k, v in vit_kwargs(name).items() if k != "model_name"}
    torch.manual_seed(1)
    model = VisionTransformer(**kwargs).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    arch, cfg, native = read_module(model)
    x = TIMM.inputs(model).double()
    state, reference = canonicalize(arch, native, cfg), logits(model, x)
    g = torch.Generator().manual_seed(2)
    classes = classes_for(cfg)
    for group in [*((c,) for c in classes), classes]:
        moved = copy.deepcopy(model)
        moved.load_state_dict(arch.to_native(apply(state, arch.spec, random_transform(cfg, group, g), cfg.heads),
                                             cfg), strict=True)
        assert (logits(moved, x) - reference).abs().max() <= TOLERANCE, group


def _plant(model, seed=5):
    """A copy of the model moved by a random symmetry of every matchable class (glmc.symmetry.transforms), float32."""
    arch, cfg, native = read_module(model)
    state = canonicalize(arch, native, cfg, dtype=torch.float64)
    t = random_transform(cfg, MATCHABLE, torch.Generator().manual_seed(seed))
    return like(model, cast(arch.to_native(apply(state, arch.spec, t, cfg.heads), cfg), torch.float32))


def _roundtrip_paths(tmp_path, lib: Library, model, kwargs):
    a, b = tmp_path / f"a{lib.suffix}", tmp_path / f"b{lib.suffix}"
    lib.save(model, a, kwargs)
    lib.save(_plant(model), b, kwargs)
    return a, b


@pytest.mark.parametrize("name", CASES)
def test_round_trip_through_the_command_line(tmp_path, name):
    make, lib, kwargs = CASES[name]
    model = make()
    a, b = _roundtrip_paths(tmp_path, lib, model, kwargs)
    x, want = lib.inputs(model), logits(model, lib.inputs(model))
    assert (logits(lib.load(b), x) - want).abs().max() <= F32  # the planted copy computes the same
    state, meta = read(a)
    assert max((read(b)[0][k] - v).abs().max() for k, v in state.items()) > 0.05  # the plant moved the weights
    assert max(invariance_errors(meta.config, native=state).values()) <= TOLERANCE
    for command in (["align", str(a), str(b)], ["merge", str(a), str(b)]):
        out = tmp_path / f"{command[0]}{lib.suffix}"
        assert main([*command, "--out", str(out)]) == 0
        reloaded = lib.load(out)
        assert type(reloaded) is type(model)
        assert (logits(reloaded, x) - want).abs().max() <= F32, command[0]
    aligned, _ = read(tmp_path / f"align{lib.suffix}")
    arch = get_arch(meta.config.family)
    folded = arch.to_native(canonicalize(arch, state, meta.config), meta.config)
    assert max((aligned[k] - folded[k]).abs().max() for k in folded) <= F32  # the planted transform is undone


HALF = 1e-2  # the bar for the same weights after rounding to float16 or bfloat16 and back (a plant moves them > 0.5)


@pytest.mark.parametrize(("name", "dtype"), [("gpt2-untied", "float16"), ("gpt2-tied", "bfloat16"),
                                             ("vit-layer-scale", "bfloat16"), ("vit-plain", "float16")])
def test_half_precision_checkpoints_are_read_as_float32_and_written_as_asked(tmp_path, name, dtype):
    """A model and its planted copy, saved in half precision by their own library: glmc reads them as float32,
    undoes the plant, and stores the result in the --dtype asked for, which the library loads back."""
    make, lib, kwargs = CASES[name]
    model = make()
    a, b, out = (tmp_path / f"{stem}{lib.suffix}" for stem in ("a", "b", "out"))
    lib.save(copy.deepcopy(model).to(DTYPES[dtype]), a, kwargs)
    lib.save(_plant(model).to(DTYPES[dtype]), b, kwargs)
    state, meta = read(a)
    assert {v.dtype for v in state.values()} == {torch.float32}
    assert main(["align", str(a), str(b), "--out", str(out), "--dtype", dtype]) == 0
    stored = load_file(str(out / "model.safetensors" if out.is_dir() else out))
    assert {v.dtype for v in stored.values()} == {DTYPES[dtype]}
    x = lib.inputs(model)
    assert (logits(lib.load(out).float(), x) - logits(model, x)).abs().max() <= 3 * HALF
    arch = get_arch(meta.config.family)
    folded = arch.to_native(canonicalize(arch, state, meta.config), meta.config)
    assert max((read(out)[0][k] - folded[k]).abs().max() for k in folded) <= HALF  # the plant is undone


def test_export_stores_the_precision_asked_and_reads_it_back_exactly(tmp_path):
    model = gpt2(tied=False)
    HF.save(model, tmp_path / "hf", {})
    assert main(["export", str(tmp_path / "hf"), "--glmc", str(tmp_path / "bf16.safetensors"), "--dtype",
                 "bfloat16"]) == 0
    assert main(["export", str(tmp_path / "bf16.safetensors"), "--glmc", str(tmp_path / "f32.safetensors")]) == 0
    state, half, back = (read(tmp_path / p)[0] for p in ("hf", "bf16.safetensors", "f32.safetensors"))
    assert all(torch.equal(half[k], state[k].to(torch.bfloat16).float()) for k in state)  # rounded once, upcast
    assert all(torch.equal(back[k], half[k]) for k in state) and any(not torch.equal(half[k], state[k]) for k in state)
    assert list(DTYPES) == DTYPE_NAMES  # the CLI lists them without importing torch


@pytest.mark.parametrize("name", ["gpt2-tied", "vit-dinov2-like", "hf-vit", "hf-vit-relu-no-qkv-bias"])
def test_api_round_trip_in_float64(name):
    make, lib, _ = CASES[name]
    model = make().double()
    planted = _plant(model).double()
    x = lib.inputs(model)
    want = logits(model, x)
    assert glmc.check(model) <= TOLERANCE
    moved = glmc.align(model, planted)
    assert type(moved) is type(model) and (logits(moved, x) - want).abs().max() <= TOLERANCE
    merged = glmc.merge([model, planted])
    assert (logits(merged, x) - want).abs().max() <= TOLERANCE
    labels = torch.randint(0, want.shape[-1], (len(x),), generator=torch.Generator().manual_seed(4))
    curve = glmc.barrier(model, planted, (x, labels) if x.is_floating_point() else x, points=3)
    assert curve.lambdas == [0.0, 0.5, 1.0] and abs(curve.barrier) <= F32


def test_a_tied_gpt2_stays_tied_only_while_equal(tmp_path):
    """Folding ln_f's gain into the head moves it off the embedding: the written folder must say so."""
    model = gpt2(tied=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    HF.save(model, tmp_path / "a", {})
    assert main(["align", str(tmp_path / "a"), str(tmp_path / "a"), "--out", str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert config["tie_word_embeddings"] is False and "lm_head.weight" in tensors
    assert not torch.equal(tensors["lm_head.weight"], tensors["transformer.wte.weight"])
    untouched = glmc.merge([model, model], method="none")
    assert untouched.lm_head.weight is untouched.transformer.wte.weight  # still bit-equal: still tied


def _permute_timm_vit(state, heads, units, num_heads):
    """Head and MLP-unit permutations written directly on timm's names (not glmc.symmetry.transforms): layer 0 only."""
    out = dict(state)
    qkv = state["blocks.0.attn.qkv.weight"]
    out["blocks.0.attn.qkv.weight"] = qkv.reshape(3, num_heads, -1, qkv.shape[1])[:, heads].reshape(qkv.shape)
    bias = state["blocks.0.attn.qkv.bias"]
    out["blocks.0.attn.qkv.bias"] = bias.reshape(3, num_heads, -1)[:, heads].reshape(bias.shape)
    proj = state["blocks.0.attn.proj.weight"]
    out["blocks.0.attn.proj.weight"] = proj.reshape(proj.shape[0], num_heads, -1)[:, heads].reshape(proj.shape)
    out["blocks.0.mlp.fc1.weight"] = state["blocks.0.mlp.fc1.weight"][units]
    out["blocks.0.mlp.fc1.bias"] = state["blocks.0.mlp.fc1.bias"][units]
    out["blocks.0.mlp.fc2.weight"] = state["blocks.0.mlp.fc2.weight"][:, units]
    return out


def test_an_independently_written_permutation_is_undone(tmp_path):
    model = vit("vit-registers")
    kwargs = vit_kwargs("vit-registers")
    TIMM.save(model, tmp_path / "a.safetensors", kwargs)
    g = torch.Generator().manual_seed(0)
    heads, units = torch.randperm(3, generator=g), torch.randperm(60, generator=g)
    permuted = copy.deepcopy(model)
    permuted.load_state_dict(_permute_timm_vit(model.state_dict(), heads, units, 3))
    x = TIMM.inputs(model)
    assert (logits(permuted, x) - logits(model, x)).abs().max() <= F32
    TIMM.save(permuted, tmp_path / "b.safetensors", kwargs)
    out = tmp_path / "out.safetensors"
    assert main(["align", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "--out", str(out),
                 "--method", "weight-perm", "--format", "timm"]) == 0
    aligned, (arch, cfg, native) = TIMM.load(out).state_dict(), read_module(model)
    folded = arch.to_native(canonicalize(arch, native, cfg), cfg)  # glmc writes LayerNorms folded
    assert max((aligned[k] - v).abs().max() for k, v in folded.items()) <= 1e-6


def test_a_timm_hub_folder_in_the_older_layout_reads_and_writes_back_as_timm(tmp_path):
    """A folder as the Hub serves timm/test_vit.r160_in1k: config.json with the architecture and its pretrained_cfg,
    no model_args (the sizes are the registered model's). glmc reads it, and a folder out is a timm folder again."""
    import timm

    model = perturb(timm.create_model("test_vit", num_classes=5), 1)
    hub = tmp_path / "hub"
    hub.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(hub / "model.safetensors"))
    (hub / "config.json").write_text(json.dumps({
        "architecture": "test_vit", "num_classes": 5, "num_features": 64, "global_pool": "token",
        "pretrained_cfg": {"tag": "r160_in1k", "custom_load": False, "input_size": [3, 160, 160],
                           "fixed_input_size": True, "mean": [0.5] * 3, "std": [0.5] * 3, "num_classes": 5,
                           "first_conv": "patch_embed.proj", "classifier": "head"}}))
    _, meta = read(hub)
    assert meta.origin["kwargs"] == {"model_name": "test_vit", "num_classes": 5} and meta.config.img_size == 160
    assert main(["align", str(hub), str(hub), "--out", str(tmp_path / "out")]) == 0
    x = torch.randn(2, 3, 160, 160, generator=torch.Generator().manual_seed(0))
    reloaded = timm.create_model(f"local-dir:{tmp_path / 'out'}", pretrained=True).eval()
    assert (logits(reloaded, x) - logits(model, x)).abs().max() <= F32


# The Hub's ViT checkpoints (google/vit-*) carry the weight names transformers used before it renamed them.
HUB_VIT_NAMES = {"attention.q_proj": "attention.attention.query", "attention.k_proj": "attention.attention.key",
                 "attention.v_proj": "attention.attention.value", "attention.o_proj": "attention.output.dense",
                 "mlp.fc1": "intermediate.dense", "mlp.fc2": "output.dense"}


def _hub_vit_name(name: str) -> str:
    if not (match := re.fullmatch(r"vit\.layers\.(\d+)\.(.+)\.(weight|bias)", name)):
        return name
    block, module, leaf = match.groups()
    return f"vit.encoder.layer.{block}.{HUB_VIT_NAMES.get(module, module)}.{leaf}"


def test_a_hub_vit_folder_with_the_older_weight_names_reads_and_a_wrong_one_is_refused(tmp_path, capsys):
    model = hf_vit()
    model.save_pretrained(str(tmp_path / "hub"))
    state = {_hub_vit_name(k): v.contiguous() for k, v in model.state_dict().items()}
    assert "vit.encoder.layer.1.attention.attention.value.bias" in state
    save_file(state, str(tmp_path / "hub" / "model.safetensors"), metadata={"format": "pt"})
    assert main(["align", str(tmp_path / "hub"), str(tmp_path / "hub"), "--out", str(tmp_path / "out")]) == 0
    x = HF_VIT.inputs(model)
    assert (logits(HF_VIT.load(tmp_path / "out"), x) - logits(model, x)).abs().max() <= F32
    del state["vit.encoder.layer.1.output.dense.bias"]  # a weight missing must not be filled with a random init
    save_file(state, str(tmp_path / "hub" / "model.safetensors"), metadata={"format": "pt"})
    assert main(["check", str(tmp_path / "hub")]) == 2
    assert "does not hold its config's ViT" in capsys.readouterr().err


def test_a_gpt2model_folder_reads_as_a_tied_lm(tmp_path):
    from transformers import GPT2Config, GPT2Model

    from tests.interop_models import GPT2_BASE

    torch.manual_seed(0)
    GPT2Model(GPT2Config(**GPT2_BASE)).save_pretrained(str(tmp_path / "base"))
    state, meta = read(tmp_path / "base")
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    assert state["lm_head.weight"].data_ptr() != state["transformer.wte.weight"].data_ptr()
    assert meta.config.vocab_size == GPT2_BASE["vocab_size"] and meta.origin["format"] == "hf"


def _refused(capsys, argv, *phrases):
    capsys.readouterr()  # what the fixtures printed
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("glmc: error:") and len(err.splitlines()) == 1, err
    for phrase in phrases:
        assert phrase in err, err


def test_bad_inputs_get_one_line_and_write_nothing(tmp_path, capsys):
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(vocab_size=20, hidden_size=12, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=16)).save_pretrained(str(tmp_path / "bert"))
    HF.save(gpt2(tied=True), tmp_path / "g2", {})
    deep = gpt2(tied=False).config.to_dict() | {"n_layer": 3}
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config.from_dict(deep)).save_pretrained(str(tmp_path / "g3"))
    TIMM.save(vit("vit-plain"), tmp_path / "v.safetensors", vit_kwargs("vit-plain"))
    (tmp_path / "model.pth").write_bytes(b"not even opened")
    out = tmp_path / "out"
    _refused(capsys, ["check", str(tmp_path / "bert")], "unsupported architecture BertModel")
    _refused(capsys, ["align", str(tmp_path / "model.pth"), str(tmp_path / "g2"), "--out", str(out)], "pickle",
             "safetensors")
    _refused(capsys, ["align", str(tmp_path / "g2"), str(tmp_path / "v.safetensors"), "--out", str(out)],
             "is a gpt2 but")
    _refused(capsys, ["merge", str(tmp_path / "g2"), str(tmp_path / "g3"), "--out", str(out)], "depth")
    TIMM.save(vit("vit-registers"), tmp_path / "r.safetensors", vit_kwargs("vit-registers"))
    _refused(capsys, ["export", str(tmp_path / "r.safetensors"), "--hf", str(out)], "needs no register tokens")
    assert not out.exists()


def test_timm_kwargs_that_would_download_or_change_the_function_are_refused(tmp_path, capsys):
    model = vit("vit-plain")
    for name, extra, phrase in [("pre", {"pretrained": True}, "would download"),
                                ("max", {"global_pool": "max"}, "global_pool"),
                                ("qkn", {"qk_norm": True}, "q_norm.weight"),  # the parameter glmc lacks, named
                                ("pos", {"pos_embed": "none"}, "pos_embed")]:
        kwargs = vit_kwargs("vit-plain") | extra
        path = tmp_path / f"{name}.safetensors"
        built = model if name == "pre" else perturb_like(kwargs)
        TIMM.save(built, path, kwargs)
        _refused(capsys, ["check", str(path)], phrase)


def perturb_like(kwargs):
    import timm

    from tests.interop_models import perturb

    return perturb(timm.create_model(**kwargs), 0)


def test_a_glmc_text_model_exports_with_its_char_tokenizer(tmp_path):
    from transformers import AutoTokenizer, GPT2LMHeadModel

    from glmc.archs import build_model
    from glmc.core.config import preset
    from glmc.data import CharVocab
    from glmc.io.checkpoint import CheckpointMeta, save_checkpoint

    vocab = CharVocab("\n !abcdefghi")
    cfg = preset("gpt2-tiny").replace(vocab_size=vocab.size, context=8)
    model = build_model(cfg).eval()
    save_checkpoint(tmp_path / "c.safetensors", model, CheckpointMeta("gpt2-tiny", cfg, dataset="shakespeare",
                                                                      vocab=vocab.to_json()))
    assert main(["export", str(tmp_path / "c.safetensors"), "--hf", str(tmp_path / "hf")]) == 0
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ids = tokenizer("bad fig\n")["input_ids"]
    assert ids == vocab.encode("bad fig\n").tolist() and tokenizer.decode(ids) == "bad fig\n"
    x = torch.tensor([ids])
    assert (logits(GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")), x) - logits(model, x)).abs().max() <= F32
    assert read(tmp_path / "hf")[1].dataset == "shakespeare"  # glmc.json keeps what glmc knew


def test_data_files(tmp_path):
    import numpy as np

    from glmc.errors import ConfigError
    from glmc.io.userdata import load_data_file

    cfg = read_module(vit("vit-plain"))[1]
    images = np.random.default_rng(0).normal(size=(6, 1, 16, 16)).astype(np.float32)
    np.savez(tmp_path / "v.npz", images=images, labels=np.arange(6) % 5)
    x, y = load_data_file(tmp_path / "v.npz", cfg)[:]
    assert x.shape == (6, 1, 16, 16) and y.tolist() == [0, 1, 2, 3, 4, 0]
    text = read_module(gpt2(tied=True))[1]
    np.save(tmp_path / "stream.npy", np.arange(25) % 19)
    x, y = load_data_file(tmp_path / "stream.npy", text)[:]
    assert x.shape == (2, 10) and torch.equal(y[:, :-1], x[:, 1:])  # windows of context + 1, targets shifted
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object))
    for bad, phrase in (("objects.npy", "not a readable"), ("v.npz", "does not fit the gpt2")):
        with pytest.raises(ConfigError, match=phrase):
            load_data_file(tmp_path / bad, text)
