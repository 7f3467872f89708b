"""Aligning without copies of the models: the canonical forms folded, B moved and the output written one tensor at a
time (:class:`glmc.core.state.Lazy`) give bit for bit what the whole-state path gives, in every family, and
``glmc align`` writes the same files as that path did (float32 and bfloat16 folders, glmc checkpoints), and ``glmc
barrier`` draws a data-free method's curve from the lazy pair, one model held, as it did from two endpoints held
whole; ``glmc merge``'s are in tests/test_lazy_merge.py."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch.utils.data import TensorDataset

from glmc.archs import build_model, get_arch, random_inputs
from glmc.cli import barrier as cli_barrier
from glmc.cli import main as glmc
from glmc.core.config import PRESETS, ModelConfig
from glmc.core.state import Lazy, Paged, cast, mix, restrict, search_view
from glmc.device import file_pages
from glmc.io import formats
from glmc.io.checkpoint import CheckpointMeta, load_checkpoint, save_checkpoint, save_streamed
from glmc.match.align import align_pair
from glmc.match.balance import balance
from glmc.merging import interpolation
from glmc.merging.interpolation import barrier_curve
from glmc.symmetry.canonical import canonical_view, canonicalize, to_model
from glmc.symmetry.transforms import MATCHABLE, apply, moved, random_transform
from glmc.train import evaluate
from simulations.bench.planting import PLANTERS

FAMILIES = ["vit-tiny", "gpt2-tiny", "llama-tiny", "neox-tiny", "bert-tiny"]


def _cfg(name: str) -> ModelConfig:
    cfg = PRESETS[name]
    cfg = cfg if cfg.vocab_size > 0 else cfg.replace(vocab_size=65)
    return cfg.replace(layer_scale=True) if cfg.family == "vit" else cfg  # a LayerScale to fold as well


def _native(cfg: ModelConfig, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    state = {k: v.detach().to(dtype) for k, v in build_model(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(seed)  # gains and biases off their initial values, so every fold does work
    state = {k: v + 0.1 * torch.randn(v.shape, generator=g).to(dtype) if v.dim() == 1 else v for k, v in state.items()}
    return state | {alias: state[source] for alias, source in get_arch(cfg.family).tied.items()}


def _same(x: Mapping[str, torch.Tensor], y: Mapping[str, torch.Tensor]) -> bool:
    return list(x) == list(y) and all(torch.equal(x[k], y[k]) and x[k].dtype == y[k].dtype for k in x)


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FAMILIES)
def test_the_lazy_canonical_form_is_the_whole_one_bit_for_bit(name: str, stored: torch.dtype) -> None:
    cfg = _cfg(name)
    arch = get_arch(cfg.family)
    native = _native(cfg, 0, stored)
    for dtype in (torch.float64, torch.float32, None):
        whole, lazy = canonicalize(arch, native, cfg, dtype=dtype), canonical_view(arch, native, cfg, dtype=dtype)
        assert isinstance(lazy, Lazy) and _same(whole, lazy)
        assert _same(search_view(whole, torch.float32), search_view(lazy, torch.float32))  # as a search reads it
        names = list(whole)[::2]
        assert _same(restrict(whole, names), restrict(lazy, names))


@pytest.mark.parametrize("name", FAMILIES)
def test_moving_and_writing_natively_one_tensor_at_a_time_is_the_whole_path(name: str) -> None:
    cfg = _cfg(name)
    arch = get_arch(cfg.family)
    a = canonicalize(arch, _native(cfg, 0), cfg, dtype=torch.float64)
    t = random_transform(cfg, MATCHABLE, torch.Generator().manual_seed(1))
    assert _same(apply(a, arch.spec, t, cfg.heads), moved(a, arch.spec, t, cfg.heads))
    b = moved(a, arch.spec, t, cfg.heads)
    assert _same(arch.to_native(apply(a, arch.spec, t, cfg.heads), cfg), arch.native_view(b, cfg))


@pytest.mark.parametrize("name", FAMILIES)
def test_a_lazy_alignment_finds_and_moves_as_the_whole_one(name: str) -> None:
    cfg = _cfg(name)
    native_a, native_b = _native(cfg, 0), _native(cfg, 1)
    whole = align_pair(native_a, native_b, cfg, "weight")
    lazy = align_pair(native_a, native_b, cfg, "weight", lazy=True)
    assert isinstance(lazy.b, Lazy) and whole.result.objective == lazy.result.objective
    tw, tl = whole.result.transform, lazy.result.transform
    assert tw.residual is not None and tl.residual is not None and torch.equal(tw.residual, tl.residual)
    for x, y in zip(tw.heads + tw.mlp + tw.qk + tw.ov, tl.heads + tl.mlp + tl.qk + tl.ov, strict=True):
        assert (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
    assert _same(whole.b, lazy.b)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_balanced_lazy_state_is_searched_as_the_whole_one_and_what_no_map_moves_as_stored(name: str) -> None:
    cfg = _cfg(name)
    arch = get_arch(cfg.family)
    native = _native(cfg, 0)
    (whole, _), (lazy, _) = (balance(form(arch, native, cfg, "standard", torch.float64), cfg)
                             for form in (canonicalize, canonical_view))
    assert isinstance(lazy, Lazy) and _same(whole, lazy)
    searched = search_view(lazy, torch.float32)
    assert _same(search_view(whole, torch.float32), searched)
    if "embed.tok.w" in lazy:  # no fold and no balancing map touches it: the search reads the stored tensor
        assert searched["embed.tok.w"].data_ptr() in {v.data_ptr() for v in native.values()}


def test_a_streamed_checkpoint_is_the_saved_one(tmp_path: Path) -> None:
    meta = CheckpointMeta("neox-tiny", _cfg("neox-tiny"))
    state = {"z.w": torch.randn(3, 5), "a": torch.randn(7).bfloat16(), "m": torch.arange(4), "e": torch.zeros(0, 3)}
    save_checkpoint(tmp_path / "saved.safetensors", state, meta)
    save_streamed(tmp_path / "streamed.safetensors", Lazy(state, state.__getitem__), meta)
    (saved, meta_saved), (streamed, meta_streamed) = (load_checkpoint(tmp_path / f"{n}.safetensors")
                                                      for n in ("saved", "streamed"))
    assert meta_saved == meta_streamed and set(saved) == set(streamed)
    assert all(torch.equal(saved[k], streamed[k]) and saved[k].dtype == streamed[k].dtype for k in saved)
    with safe_open(str(tmp_path / "saved.safetensors"), "pt") as f, \
            safe_open(str(tmp_path / "streamed.safetensors"), "pt") as g:
        assert f.metadata() == g.metadata()  # the same checksum


def _pair(root: Path, name: str, dtype: torch.dtype) -> tuple[Path, Path]:
    """A model saved by transformers in ``dtype`` and a copy moved by a transform planted on its HF names."""
    cfg = _cfg(name)
    torch.manual_seed(0)
    model: Any = build_model(cfg).to(dtype)  # a transformers model: save_pretrained, config
    model.save_pretrained(str(root / "a"))
    planted = PLANTERS[cfg.family]({k: v.float() for k, v in model.state_dict().items()}, model.config, 3)
    model.load_state_dict({k: v.to(dtype) for k, v in planted.items()})
    model.save_pretrained(str(root / "b"))
    return root / "a", root / "b"


def test_a_mapped_pair_whose_pages_are_handed_back_on_every_read_aligns_as_the_whole_one(tmp_path: Path) -> None:
    a, b = _pair(tmp_path, "llama-tiny", torch.bfloat16)
    (state_a, meta), (state_b, _) = formats.read(a, stored=True), formats.read(b, stored=True)
    kept = {k: v.clone() for k, v in state_a.items()}  # in memory, not mapped: file_pages leaves it alone
    file_pages(kept)()
    calls: list[int] = []

    def paged(state: dict[str, torch.Tensor]) -> Paged:  # every page of the file dropped before each read
        release = file_pages(state)
        return Paged(state, lambda: (calls.append(1), release())[1], every=1)

    whole = align_pair(state_a, state_b, meta.config, "weight", dtype=None)
    lazy = align_pair(paged(state_a), paged(state_b), meta.config, "weight", dtype=None, lazy=True)
    assert calls and whole.result.objective == lazy.result.objective and _same(whole.b, lazy.b)
    assert all(torch.equal(kept[k], state_a[k]) for k in kept)


def _tensors(path: Path) -> tuple[dict[str, str], dict[str, tuple[str, bytes]]]:
    """A safetensors file's metadata and tensors (their names, dtypes and bytes), however its header is laid out."""
    with safe_open(str(path), "pt") as f:
        return f.metadata(), {k: (str(f.get_tensor(k).dtype), f.get_tensor(k).view(torch.uint8).numpy().tobytes())
                              for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())} if path.is_dir() else {path.name: path.read_bytes()}


@pytest.mark.parametrize(("name", "dtype", "out_dtype"), [("neox-tiny", torch.float32, "float32"),
                                                          ("llama-tiny", torch.bfloat16, "bfloat16")])
def test_glmc_align_writes_what_the_whole_state_path_writes(name: str, dtype: torch.dtype, out_dtype: str,
                                                           tmp_path: Path) -> None:
    a, b = _pair(tmp_path, name, dtype)
    state_a, meta = formats.read(a, stored=True)  # as glmc align reads them: a half-precision pair lands within
    state_b, meta_b = formats.read(b, stored=True)  # its own rounding (glmc.match.align.recovered_share)
    whole = align_pair(state_a, state_b, meta.config, "weight")  # the path glmc align took: float64
    native = get_arch(meta.config.family).to_native(whole.b, meta.config)
    for fmt, suffix in (("hf", ""), ("glmc", ".safetensors")):
        want, got = tmp_path / f"want-{fmt}{suffix}", tmp_path / f"got-{fmt}{suffix}"
        formats.write(want, fmt, native, meta_b, out_dtype)
        assert glmc(["align", str(a), str(b), "--out", str(got), "--format", fmt, "--dtype", out_dtype]) == 0
        if fmt == "hf":  # the same folder (its config.json byte for byte), but for glmc's note of how B was aligned
            skip = {formats.GLMC_JSON, "model.safetensors"}
            assert {k: v for k, v in _files(got).items() if k not in skip} == \
                   {k: v for k, v in _files(want).items() if k not in skip}
            assert _tensors(got / "model.safetensors") == _tensors(want / "model.safetensors")
        else:
            (w, _), (g, meta_got) = load_checkpoint(want), load_checkpoint(got)
            assert set(w) == set(g) and all(torch.equal(w[k], g[k]) and w[k].dtype == g[k].dtype for k in w)
            assert "aligned to a by weight" in meta_got.split


def _models(root: Path, name: str, dtype: torch.dtype, n: int) -> list[Path]:
    """``n`` independently initialised transformers models of preset ``name``, saved by save_pretrained in
    ``dtype`` (their gains and biases moved off 1 and 0, so every fold does work)."""
    for seed in range(n):
        model: Any = build_model(_cfg(name))
        model.load_state_dict(_native(_cfg(name), seed))
        model.to(dtype).save_pretrained(str(root / f"m{seed}"))
    return [root / f"m{seed}" for seed in range(n)]


def _written(path: Path) -> dict[str, Any]:
    """A written checkpoint's files: each safetensors file's metadata and tensors (:func:`_tensors`), others' bytes."""
    return {k: _tensors(path / k if path.is_dir() else path) if k.endswith(".safetensors") else v
            for k, v in _files(path).items()}


def _data(cfg: ModelConfig) -> TensorDataset:
    """Eight held-out samples of random inputs and targets for ``cfg``'s model."""
    x, g = random_inputs(cfg, 8, seed=2), torch.Generator().manual_seed(3)
    classes = cfg.num_classes if x.is_floating_point() else cfg.vocab_size
    return TensorDataset(x, torch.randint(0, classes, x.shape[:1] if x.is_floating_point() else x.shape, generator=g))


def _counted(state: Lazy, reads: list[str]) -> Lazy:
    """``state``, each tensor it makes noted in ``reads``."""
    def make(name: str) -> torch.Tensor:
        reads.append(name)
        return state[name]

    return Lazy(state, make)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_path_between_lazy_models_is_made_tensor_by_tensor_into_one_model_as_the_whole_path(name: str) -> None:
    cfg = _cfg(name)
    arch = get_arch(cfg.family)
    native_a, native_b = _native(cfg, 0), _native(cfg, 1)
    t = random_transform(cfg, MATCHABLE, torch.Generator().manual_seed(1))
    whole = [canonicalize(arch, native_a, cfg, dtype=torch.float64),
             apply(canonicalize(arch, native_b, cfg, dtype=torch.float64), arch.spec, t, cfg.heads)]
    reads: list[str] = []
    lazy = [_counted(canonical_view(arch, native_a, cfg, dtype=torch.float64), reads),  # type: ignore[arg-type]
            _counted(moved(canonical_view(arch, native_b, cfg, dtype=torch.float64), arch.spec, t, cfg.heads), reads)]
    want, got = (barrier_curve(a, b, cfg, _data(cfg), points=3, dtype=torch.float32) for a, b in (whole, lazy))
    assert got == want and want.losses[0] != want.losses[-1]  # two models, one curve
    middle = to_model(mix([cast(s, torch.float32) for s in whole], (0.5, 0.5)), cfg)  # the midpoint made whole
    assert evaluate(middle, arch, _data(cfg))["loss"] == want.losses[1]
    assert len(reads) >= 3 * 2 * len(whole[0])  # every tensor of both ends made again at each λ: neither is held


@pytest.fixture
def spied(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """What ``glmc barrier`` loaded, which endpoints it passed to the curve and which it rounded whole to float32."""
    seen: dict[str, list[Any]] = {"loaded": [], "ends": [], "rounded": []}
    load_pair, curve, in_float32 = cli_barrier.load_pair, interpolation.barrier_curve, cli_barrier._in_float32

    def loaded(*args: Any, **kwargs: Any) -> Any:
        pair = load_pair(*args, **kwargs)
        seen["loaded"].append({v.dtype for s in pair[:2] for v in s.values()})
        return pair

    def ends(a: Any, b: Any, *args: Any, **kwargs: Any) -> Any:
        seen["ends"].append((type(a), type(b)))
        return curve(a, b, *args, **kwargs)

    def rounded(*args: Any) -> Any:
        seen["rounded"].append(1)
        return in_float32(*args)

    monkeypatch.setattr(cli_barrier, "load_pair", loaded)
    monkeypatch.setattr(interpolation, "barrier_curve", ends)
    monkeypatch.setattr(cli_barrier, "_in_float32", rounded)
    return seen


def test_glmc_barrier_streams_a_data_free_path_from_the_stored_pair_and_draws_the_whole_paths_curve(
        tmp_path: Path, spied: dict[str, list[Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _models(tmp_path, "llama-tiny", torch.bfloat16, 2)
    test = tmp_path / "test.npy"
    np.save(test, np.random.default_rng(0).integers(0, 65, (8, _cfg("llama-tiny").context)))
    argv = ["barrier", *map(str, paths), "--data-file", str(test), "--points", "3", "--json"]
    assert glmc([*argv, str(tmp_path / "streamed.json")]) == 0
    assert spied["loaded"] == [{torch.bfloat16}] and spied["ends"] == [(Lazy, Lazy)] and not spied["rounded"]
    with monkeypatch.context() as patch:  # the whole path: float32 inputs, both ends rounded and held
        patch.setattr(cli_barrier, "_streamed", lambda *_: False)
        assert glmc([*argv, str(tmp_path / "whole.json")]) == 0
    assert spied["loaded"][1] == {torch.float32} and spied["ends"][1] == (dict, dict) and spied["rounded"] == [1, 1]
    (streamed,), (whole,) = (json.loads((tmp_path / f"{n}.json").read_text())["curves"] for n in ("streamed", "whole"))
    fields = ("lambdas", "losses", "accuracies", "barriers", "barrier", "align_info")
    assert {k: streamed[k] for k in fields} == {k: whole[k] for k in fields} and whole["barrier"] > 0
