"""Checkpoints in and out in three formats: glmc's own, a Hugging Face folder, a timm state dict.

- ``glmc``: one .safetensors with JSON metadata (:mod:`glmc.io.checkpoint`);
- ``hf``: a folder with ``config.json`` and ``model.safetensors`` (or a sharded index) of a ``GPT2LMHeadModel`` or
  ``GPT2Model``, as ``save_pretrained`` writes it; a tied head is untied on reading (one INFO line) and tied again
  on writing only if it is still equal to the embedding bit for bit; or of any family that names its transformers
  class (``Arch.hf_class``: Llama, Mistral, Qwen2, GPT-NeoX), read by ``from_pretrained`` and written by its own build;
- ``timm``: a ViT's ``state_dict`` as .safetensors, with ``timm.create_model``'s kwargs, model name included, in a
  JSON file of the same stem beside it (``vit.safetensors`` + ``vit.json``); or a timm Hub folder, as
  ``timm.models.save_for_hf`` writes it and the Hub serves it (``config.json`` naming an ``architecture``, and
  ``model.safetensors``), which ``timm.create_model("local-dir:DIR", pretrained=True)`` loads.

Every model read is checked against glmc's rebuild of it (:func:`glmc.io.live.read_module`) and held in float32,
whatever precision it was stored in; a writer stores float32 unless asked for float16 or bfloat16. Pickle formats
(``pytorch_model.bin``, ``.pt``, ``.pth``) are refused unopened: unpickling a file can run any code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from glmc.archs import ARCHS, get_arch, hf_vit
from glmc.core.config import ModelConfig
from glmc.core.state import Lazy, State, cast
from glmc.errors import CheckpointError, ConfigError, first_line
from glmc.io.checkpoint import (
    META_KEY,
    CheckpointMeta,
    check_out,
    load_checkpoint,
    save_checkpoint,
    save_streamed,
    stream_safetensors,
    written_whole,
)
from glmc.io.files import kwargs_path
from glmc.io.live import read_module

log = logging.getLogger(__name__)

FORMATS = ("glmc", "hf", "timm")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}  # what a writer can store
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
HF_ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "GPT2Model": "gpt2", "ViTForImageClassification": "vit"} | {
    arch.hf_class: arch.hf_model_type or family for family, arch in ARCHS.items() if arch.hf_class}  # → model_type
HF_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal masks older transformers saved with GPT-2's weights
GLMC_JSON = "glmc.json"  # glmc's metadata (dataset, vocabulary, metrics) in an HF or timm folder it wrote
SIDE_FILES = ("preprocessor_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
              "special_tokens_map.json", "added_tokens.json")  # an HF folder's files beside its weights, copied
TIMM_DEFAULT_NAME = "vit_tiny_patch16_224"  # the registered name exported glmc ViTs use; every size is overridden
TIMM_UNSAFE_KWARGS = ("pretrained", "checkpoint_path", "pretrained_cfg", "pretrained_cfg_overlay")
TIMM_NORM_EPS = 1e-6  # timm's LayerNorm default: the only eps a kwargs JSON can carry
CONVERT_HINT = ("convert it to safetensors where you trust it, e.g. `save_pretrained(DIR)` (HF saves safetensors) or "
                "`safetensors.torch.save_file(torch.load(FILE, weights_only=True), OUT)`")


def _pickle_error(path: Path) -> CheckpointError:
    return CheckpointError(f"{path} is a pickle file, which glmc never opens (unpickling can run code); "
                           f"{CONVERT_HINT}")


def read(path: str | Path, *, stored: bool = False) -> tuple[State, CheckpointMeta]:
    """The native (untied) state, in float32 whatever precision was stored (``stored``: in the precision the file
    stores, so a bfloat16 model takes half float32's memory), and metadata of a glmc checkpoint, an HF folder or a
    timm state dict."""
    path = Path(path)
    if path.suffix in PICKLE_SUFFIXES:
        raise _pickle_error(path)
    if path.is_dir():
        return read_timm_folder(path, stored) if is_timm_folder(path) else read_hf(path, stored)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint file or folder at {path}")
    if path.suffix != ".safetensors":
        raise CheckpointError(f"{path} is neither a .safetensors file nor a Hugging Face folder")
    if META_KEY in _header(path):
        state, meta = load_checkpoint(path)
        return (state if stored else cast(state, torch.float32)), meta
    return read_timm(path, stored)


def format_of(meta: CheckpointMeta) -> str:
    """The format a checkpoint was read from: glmc unless its origin says HF or timm."""
    return str(meta.origin.get("format", "glmc"))


def _header(path: Path) -> dict[str, str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception as err:  # safetensors raises several types for a bad header
        raise CheckpointError(f"{path} is not a readable safetensors file: {first_line(err)}") from err


def _tensors(path: Path) -> State:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except Exception as err:
        raise CheckpointError(f"{path} is not a readable safetensors file: {first_line(err)}") from err


def _load_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable {what}: {first_line(err)}") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} is not a JSON object")
    return data


# --- Hugging Face folders --------------------------------------------------------------------------------------


def _folder_tensors(folder: Path) -> State:
    """The weights of an HF or timm folder: model.safetensors, or the shards its index names; pickles refused."""
    state: State = {}
    for path in _safetensors_files(folder):
        state.update(_tensors(path))
    return state


def _safetensors_files(folder: Path) -> list[Path]:
    """A folder's model.safetensors, or the shards its index names; CheckpointError naming a pickle if it has
    only pickles."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        return [folder / shard for shard in
                sorted(set(_load_json(index, "safetensors index").get("weight_map", {}).values()))]
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise _pickle_error(folder / pickles[0])
    raise CheckpointError(f"{folder} has no model.safetensors (nor a sharded model.safetensors.index.json)")


def _hf_architecture(folder: Path, config: Mapping[str, Any]) -> str:
    names = list(config.get("architectures") or [])
    name = names[0] if names else str(config.get("model_type", "unknown"))
    if name == "gpt2" or HF_ARCHITECTURES.get(name) == config.get("model_type"):
        return "GPT2LMHeadModel" if name == "gpt2" else name
    raise ConfigError(f"{folder}: unsupported architecture {name}; glmc reads Hugging Face "
                      f"{', '.join(HF_ARCHITECTURES)} folders and timm ViTs")


def read_hf(folder: Path, stored: bool = False) -> tuple[State, CheckpointMeta]:
    """A GPT2LMHeadModel (or GPT2Model, read as one with a tied head) or a ViTForImageClassification from a
    ``save_pretrained`` folder."""
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} is a folder without config.json: not a Hugging Face model folder")
    config = _load_json(folder / "config.json", "config.json")
    architecture = _hf_architecture(folder, config)
    if architecture == hf_vit.ARCHITECTURE or architecture in {a.hf_class for a in ARCHS.values() if a.hf_class}:
        model = _pretrained(folder, architecture, stored)
    else:
        model = _hf_gpt2(folder, config, architecture, stored)
    _, cfg, state = read_module(model)
    meta = _meta(cfg, _saved(folder), f"read from the Hugging Face folder {folder}",
                 {"format": "hf", "config": config, "path": str(folder)})
    return state, meta


def _pretrained(folder: Path, architecture: str, stored: bool = False) -> nn.Module:
    """The folder's model, loaded by its transformers class itself (which also renames the Hub's older weight
    names); safetensors only, and every weight present and expected."""
    import transformers

    _safetensors_files(folder)
    try:
        with _quiet_transformers():
            loaded: Any = getattr(transformers, architecture).from_pretrained(
                str(folder), use_safetensors=True, local_files_only=True, dtype="auto" if stored else torch.float32,
                output_loading_info=True)
            model, info = loaded
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise CheckpointError(f"{folder} does not hold its config's {architecture}: {first_line(err)}") from err
    if off := [f"lacks {k!r}" for k in info["missing_keys"]] + [f"has an unexpected {k!r}"
                                                                for k in info["unexpected_keys"]]:
        raise CheckpointError(f"{folder} does not hold its config's {architecture}: it {sorted(off)[0]}")
    return model.eval()


def _in_precision(model: nn.Module, tensors: State, stored: bool) -> nn.Module:
    """``model`` in the precision of ``tensors``' floating-point values when ``stored``, else as built (float32)."""
    dtypes = {v.dtype for v in tensors.values() if v.is_floating_point()}
    return model.to(dtypes.pop()) if stored and len(dtypes) == 1 else model


def _hf_gpt2(folder: Path, config: dict[str, Any], architecture: str, stored: bool = False) -> nn.Module:
    """The folder's GPT2LMHeadModel; a GPT2Model is read as one whose head is its embedding."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tensors = {k: v for k, v in _folder_tensors(folder).items() if not k.endswith(HF_BUFFERS)}
    if architecture == "GPT2Model" or not any(k.startswith("transformer.") for k in tensors):
        tensors = {f"transformer.{k}": v for k, v in tensors.items()}  # the base model: its head is its embedding
    hf = GPT2Config.from_dict(config)
    if architecture == "GPT2Model":
        hf.tie_word_embeddings = True
    model = _in_precision(GPT2LMHeadModel(hf), tensors, stored)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and hf.tie_word_embeddings)]
    if missing or unexpected:
        what = f"lacks {missing[0]!r}" if missing else f"has an unexpected {unexpected[0]!r}"
        raise CheckpointError(f"{folder} does not hold its config's GPT-2: it {what}")
    return model.eval()


def _saved(folder: Path) -> dict[str, Any]:
    """The metadata glmc wrote into a folder it wrote (dataset, vocabulary, metrics), else nothing."""
    return _load_json(folder / GLMC_JSON, GLMC_JSON) if (folder / GLMC_JSON).is_file() else {}


def _meta(cfg: ModelConfig, saved: Mapping[str, Any], split: str, origin: dict[str, Any]) -> CheckpointMeta:
    """Metadata of a model read from another format: what glmc wrote beside it, if anything, with its config."""
    fields = {f.name for f in dataclasses.fields(CheckpointMeta)} - {"config", "origin"}
    known = {k: v for k, v in saved.items() if k in fields}
    return CheckpointMeta(**{"preset": "", "split": split, **known}, config=cfg, origin=origin)


def _tied_pairs(model: object) -> dict[str, str]:
    """The weights an HF model ties (name → the name it shares), as transformers declares them."""
    pairs = getattr(model, "_tied_weights_keys", None) or {}
    return dict(pairs) if isinstance(pairs, Mapping) else {}


def hf_model(native: Mapping[str, torch.Tensor], meta: CheckpointMeta) -> Any:
    """The transformers model of a native state, in the config it was read with (if any) at the state's sizes: a
    ViTForImageClassification, or a GPT2LMHeadModel tied only where the tied weights are equal bit for bit."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from glmc.archs import build_model

    cfg = meta.config
    if cfg.family == "vit":
        return hf_vit.hf_module(native, cfg, meta.origin.get("config"))
    if get_arch(cfg.family).hf_class:  # built on the meta device to hold the state's own tensors: no copy at 1B
        with torch.device("meta"):
            model: Any = build_model(cfg)
        model.config.architectures = [get_arch(cfg.family).hf_class]
        model.load_state_dict(dict(native), strict=True, assign=True)
        model.tie_weights()  # BERT's decoder is its word embeddings again (the state holds an equal copy)
        return model.eval()
    if cfg.attn_dim != cfg.width:
        raise ConfigError(f"this GPT-2's heads are {cfg.head_dim} wide, not width/heads: transformers cannot load it; "
                          "write --format glmc")
    ours: Any = build_model(cfg).config
    sizes = {k: getattr(ours, k) for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
                                           "layer_norm_epsilon", "activation_function")}
    hf = GPT2Config.from_dict({**(meta.origin.get("config") or ours.to_dict()), **sizes})
    hf.architectures = ["GPT2LMHeadModel"]
    pairs = _tied_pairs(GPT2LMHeadModel)
    hf.tie_word_embeddings = bool(pairs) and all(torch.equal(native[k], native[v]) for k, v in pairs.items())
    model = GPT2LMHeadModel(hf)
    model.load_state_dict(dict(native), strict=True)
    return model.eval()


def _write_tokenizer(folder: Path, meta: CheckpointMeta) -> None:
    """The input folder's tokenizer files, or a char-level tokenizer from glmc's vocabulary."""
    source = Path(str(meta.origin.get("path", ""))) if meta.origin.get("format") == "hf" else None
    copied = [name for name in SIDE_FILES if source is not None and (source / name).is_file()]
    for name in copied:
        shutil.copy2(source / name, folder / name)  # type: ignore[operator]
    if copied or not meta.vocab:
        return
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from glmc.data import CharVocab

    chars = CharVocab.from_json(meta.vocab).chars
    # No unknown token: a character outside the vocabulary is an error, as in glmc's CharVocab, not a silent stand-in.
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token a character
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(str(folder))


def write_hf(folder: Path, native: Mapping[str, torch.Tensor], meta: CheckpointMeta,
             dtype: torch.dtype = torch.float32) -> None:
    """``save_pretrained`` of the state's GPT2LMHeadModel in ``dtype`` (its config.json says which), its tokenizer,
    and glmc's metadata. A :class:`Lazy` state of a family transformers builds untied is streamed instead
    (:func:`_stream_hf`): the same folder, without a copy of the model in memory."""
    streamed = isinstance(native, Lazy) and _stream_hf(native, meta, dtype)
    model = streamed or hf_model(cast(native, dtype), meta).to(dtype)

    def fill(tmp: Path) -> None:
        with _quiet_transformers():
            model.save_pretrained(str(tmp))
        _write_tokenizer(tmp, meta)
        _write_saved(tmp, meta)

    _replace_folder(folder, fill)


class _StreamedModel:
    """What :func:`write_hf` saves for a streamed state: the model's config and generation config (of a model built
    on the meta device) and its weights written one tensor at a time, cast to the folder's dtype."""

    def __init__(self, model: Any, native: Lazy, dtype: torch.dtype, saved: Mapping[str, str]) -> None:
        self.model, self.native, self.dtype, self.saved = model, native, dtype, saved

    def save_pretrained(self, folder: str) -> None:
        self.model.config.dtype = str(self.dtype).split(".")[1]  # as save_pretrained records it
        self.model.config.architectures = [type(self.model).__name__]
        self.model.config.save_pretrained(folder)
        if self.model.can_generate():
            self.model.generation_config.save_pretrained(folder)
        cast_view = Lazy(self.saved, lambda name: self.native[self.saved[name]].detach().to(self.dtype))
        stream_safetensors(Path(folder) / "model.safetensors", cast_view, lambda _: {"format": "pt"})


def _stream_hf(native: Lazy, meta: CheckpointMeta, dtype: torch.dtype) -> _StreamedModel | None:
    """The streamed save of a state whose family transformers loads by class, untied, with exactly the model's
    parameter names (None otherwise: it is saved by ``save_pretrained`` of the model holding it)."""
    from glmc.archs import build_model

    arch = get_arch(meta.config.family)
    if not arch.hf_class or arch.tied:
        return None
    with torch.device("meta"):
        model: Any = build_model(meta.config).to(dtype)
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False) or set(state) != set(native):
        return None
    saved = _saved_names(model, state)
    if saved is None:
        return None
    return _StreamedModel(model, native, dtype, saved)


def _saved_names(model: Any, state: State) -> dict[str, str] | None:
    """The names ``save_pretrained`` gives the model's parameters (the checkpoint's own, where transformers renames
    them on loading: GPT-NeoX's ``embed_out``) → the model's names; None where saving converts a tensor rather than
    renaming it (computed on the meta device: no tensor is read)."""
    from transformers.core_model_loading import revert_weight_conversion

    ids = {id(v): k for k, v in state.items()}
    reverted = revert_weight_conversion(model, dict(state))
    saved = {new: ids.get(id(v)) for new, v in reverted.items()}
    return None if None in saved.values() or len(saved) != len(state) else saved  # type: ignore[return-value]


def _write_saved(folder: Path, meta: CheckpointMeta) -> None:
    """glmc's metadata beside a folder's weights, for :func:`_saved` to read back."""
    (folder / GLMC_JSON).write_text(json.dumps(meta.to_dict() | {"origin": {}}, indent=1, sort_keys=True))


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' progress bars off for one call (a CLI prints its own one-line result)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _replace_folder(folder: Path, fill: Callable[[Path], None]) -> None:
    """Fill a temporary sibling folder, then put it in ``folder``'s place: never half-written, and an old folder
    is removed only once the new one is complete."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    old = tmp.with_suffix(".old")
    try:
        tmp.mkdir()
        fill(tmp)
        if folder.exists():
            folder.rename(old)
        tmp.rename(folder)
    finally:
        for leftover in (tmp, old):
            shutil.rmtree(leftover, ignore_errors=True)


# --- timm state dicts --------------------------------------------------------------------------------------------


def timm_model(kwargs: Mapping[str, Any], where: Path | str) -> nn.Module:
    """``timm.create_model(**kwargs)``, never pretrained (nothing is downloaded, no file is opened)."""
    import timm

    unsafe = [k for k in TIMM_UNSAFE_KWARGS if kwargs.get(k)]
    if unsafe:
        raise ConfigError(f"{where}: timm kwarg {unsafe[0]!r} would download or open weights; glmc reads them "
                          "from the .safetensors beside it")
    if not isinstance(kwargs.get("model_name"), str):
        raise ConfigError(f"{where}: the timm kwargs need a \"model_name\" (e.g. \"vit_small_patch16_224\")")
    try:
        return timm.create_model(**{**kwargs, "pretrained": False})
    except (RuntimeError, TypeError, ValueError, AssertionError, KeyError) as err:
        raise ConfigError(f"{where}: timm.create_model failed: {first_line(err)}") from err


def read_timm(path: Path, stored: bool = False) -> tuple[State, CheckpointMeta]:
    """A timm ViT from its state dict and the create_model kwargs beside it."""
    where = kwargs_path(path)
    if not where.is_file():
        raise CheckpointError(f"{path} has no glmc metadata and no timm kwargs at {where}; for a timm model write "
                              "{\"model_name\": ..., <create_model kwargs>} there")
    kwargs = _load_json(where, "timm kwargs")
    cfg, state = _timm_state(kwargs, where, path, _tensors(path), stored)
    return state, _meta(cfg, {}, f"read from the timm state dict {path}",
                        {"format": "timm", "kwargs": kwargs, "path": str(path)})


def is_timm_folder(folder: Path) -> bool:
    """Whether a folder holds a timm model: its config.json names an ``architecture`` (an HF one a model_type)."""
    config = folder / "config.json"
    return config.is_file() and "architecture" in _load_json(config, "config.json")


def read_timm_folder(folder: Path, stored: bool = False) -> tuple[State, CheckpointMeta]:
    """A timm ViT from a Hub folder: create_model kwargs as timm parses its config.json (the older layout without
    ``model_args`` too), weights from its safetensors."""
    from timm.models._hub import load_model_config_from_path

    try:
        pretrained_cfg, name, model_args = load_model_config_from_path(folder)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{folder}: unreadable timm config.json: {first_line(err)}") from err
    classes = {"num_classes": pretrained_cfg["num_classes"]} if "num_classes" in pretrained_cfg else {}
    kwargs = {"model_name": name, **classes, **model_args}
    cfg, state = _timm_state(kwargs, folder / "config.json", folder, _folder_tensors(folder), stored)
    return state, _meta(cfg, _saved(folder), f"read from the timm folder {folder}",
                        {"format": "timm", "kwargs": kwargs, "path": str(folder)})


def _timm_state(kwargs: Mapping[str, Any], where: Path, path: Path, tensors: State,
                stored: bool = False) -> tuple[ModelConfig, State]:
    """The config and native state of the timm model ``kwargs`` build (``where`` names them), holding ``tensors``."""
    model = _in_precision(timm_model(kwargs, where), tensors, stored)
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"{path} does not fit the timm model of {where.name}: {first_line(err)}") from err
    _, cfg, state = read_module(model.eval())
    return cfg, state


def timm_kwargs(cfg: ModelConfig, origin: Mapping[str, Any]) -> dict[str, Any]:
    """create_model kwargs for ``cfg``: the ones it was read with (if any), every size and variant option set."""
    if cfg.family != "vit":
        raise ConfigError(f"a timm state dict holds a ViT here, not a {cfg.family}; write --format glmc or hf")
    if cfg.norm_eps != TIMM_NORM_EPS or cfg.attn_dim != cfg.width:
        raise ConfigError(f"timm kwargs cannot give this ViT its LayerNorm eps {cfg.norm_eps:g} or head size "
                          f"{cfg.head_dim} (a width embedding changes them); write --format glmc")
    kwargs = dict(origin.get("kwargs") or {"model_name": TIMM_DEFAULT_NAME})
    ratio = kwargs.get("mlp_ratio")
    if not isinstance(ratio, int | float) or int(cfg.width * ratio) != cfg.mlp:
        ratio = (cfg.mlp + 0.5) / cfg.width  # timm floors d·ratio
    layer_scale = kwargs.get("init_values") or 1e-5
    kwargs.update(img_size=cfg.img_size, patch_size=cfg.patch, in_chans=cfg.in_chans, num_classes=cfg.num_classes,
                  embed_dim=cfg.width, depth=cfg.depth, num_heads=cfg.heads, mlp_ratio=ratio, qkv_bias=cfg.qkv_bias,
                  class_token=cfg.class_token, reg_tokens=cfg.reg_tokens, global_pool=cfg.global_pool,
                  fc_norm=cfg.fc_norm, no_embed_class=cfg.no_embed_class,
                  init_values=layer_scale if cfg.layer_scale else None,
                  act_layer="relu" if cfg.activation == "relu" else "gelu")
    return kwargs


def write_timm(path: Path, native: Mapping[str, torch.Tensor], meta: CheckpointMeta,
               dtype: torch.dtype = torch.float32) -> None:
    """The state dict in ``dtype``, checked to load strictly, either as a .safetensors (a glmc checkpoint, so it
    keeps its metadata) with its kwargs JSON, or, for a ``path`` without that suffix, as a timm Hub folder."""
    kwargs = timm_kwargs(meta.config, meta.origin)
    model, state = timm_model(kwargs, path), cast(native, dtype)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ConfigError(f"the timm model of these kwargs does not take the state: {first_line(err)}") from err
    if path.suffix != ".safetensors":
        _replace_folder(path, lambda tmp: _fill_timm_folder(tmp, model.to(dtype), kwargs, meta))
        return
    save_checkpoint(path, state, dataclasses.replace(meta, origin={"format": "timm", "kwargs": kwargs}))
    _write_text(kwargs_path(path), json.dumps(kwargs, indent=1, sort_keys=True))


def _fill_timm_folder(folder: Path, model: nn.Module, kwargs: Mapping[str, Any], meta: CheckpointMeta) -> None:
    """timm's own Hub layout (config.json with the create_model kwargs as model_args, model.safetensors), and
    glmc's metadata."""
    from timm.models._hub import save_for_hf

    save_for_hf(model, str(folder), model_args={k: v for k, v in kwargs.items() if k != "model_name"},
                safe_serialization=True)
    _write_saved(folder, meta)


def _write_text(path: Path, text: str) -> None:
    with written_whole(path) as f:
        f.write(text.encode())


# --- writing any format ------------------------------------------------------------------------------------------


def check_output(path: Path, fmt: str, force: bool) -> None:
    """Fail before any work if ``path`` does not suit ``fmt`` or would be overwritten without ``force``."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown output format {fmt!r}; known: {', '.join(FORMATS)}")
    if fmt == "glmc" or (fmt == "timm" and path.suffix == ".safetensors"):
        check_out(path, force)
        if fmt == "timm" and kwargs_path(path).exists() and not force:
            raise CheckpointError(f"{kwargs_path(path)} already exists; pass --force to overwrite it")
        return
    if (path.suffix and not path.is_dir()) or (path.exists() and not path.is_dir()):
        raise ConfigError(f"--out must end in .safetensors, or name a folder for a Hugging Face or timm output; "
                          f"got {path}")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise CheckpointError(f"{path} already exists; pass --force to overwrite it")


def write(path: str | Path, fmt: str, native: Mapping[str, torch.Tensor], meta: CheckpointMeta,
          dtype: str = "float32") -> Path:
    """Write a native state in ``fmt`` (glmc, hf or timm), its tensors stored as ``dtype`` (a key of
    :data:`DTYPES`); returns the path. Every reader computes in float32 or float64 whatever was stored."""
    path = Path(path)
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    if fmt == "hf":
        write_hf(path, native, meta, DTYPES[dtype])
    elif fmt == "timm":
        write_timm(path, dict(native), meta, DTYPES[dtype])
    elif fmt == "glmc" and isinstance(native, Lazy):  # made tensor by tensor: written so, never held whole
        save_streamed(path, Lazy(native, lambda name: native[name].detach().to(DTYPES[dtype])), meta)
    elif fmt == "glmc":
        save_checkpoint(path, cast(native, DTYPES[dtype]), meta)
    else:
        raise ConfigError(f"unknown output format {fmt!r}; known: {', '.join(FORMATS)}")
    return path


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` looks like one checkpoint of some format (not yet read): a .safetensors file or an HF
    folder (one with a config.json)."""
    return (path.is_file() and path.suffix == ".safetensors") or (path.is_dir() and (path / "config.json").is_file())


def checkpoint_paths(path: str | Path) -> list[Path]:
    """One checkpoint, or every checkpoint in a folder of them in name order (timm kwargs JSONs beside them are
    not checkpoints); CheckpointError if there is none."""
    path = Path(path)
    if path.suffix in PICKLE_SUFFIXES:
        raise _pickle_error(path)
    if is_checkpoint(path):
        return [path]
    found = sorted(p for p in path.iterdir() if is_checkpoint(p)) if path.is_dir() else []
    if not found:
        raise CheckpointError(f"{path} is neither a checkpoint (.safetensors, Hugging Face folder) nor a folder of "
                              "them")
    return found
