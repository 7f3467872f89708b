"""Aligning without copies of the models: the canonical forms folded, B moved and the output written one tensor at a
time (:class:`glmc.core.state.Lazy`) give bit for bit what the whole-state path gives, in every family, and
``glmc align`` writes the same files as that path did (float32 and bfloat16 folders, glmc checkpoints);
``glmc merge``'s are in tests/test_lazy_merge.py."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from glmc.archs import build_model, get_arch
from glmc.cli import main as glmc
from glmc.core.config import PRESETS, ModelConfig
from glmc.core.state import Lazy, Paged, restrict, search_view
from glmc.device import file_pages
from glmc.io import formats
from glmc.io.checkpoint import CheckpointMeta, load_checkpoint, save_checkpoint, save_streamed
from glmc.match.align import align_pair
from glmc.match.balance import balance
from glmc.symmetry.canonical import canonical_view, canonicalize
from glmc.symmetry.transforms import MATCHABLE, apply, moved, random_transform
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


def _written(path: Path) -> dict[str, Any]:
    """A written checkpoint's files: each safetensors file's metadata and tensors (:func:`_tensors`), others' bytes."""
    return {k: _tensors(path / k if path.is_dir() else path) if k.endswith(".safetensors") else v
            for k, v in _files(path).items()}
