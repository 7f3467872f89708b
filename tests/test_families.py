"""The RMSNorm families (Llama, Mistral, Qwen2) on models transformers builds and saves: symmetries planted by hand on
Hugging Face's own parameter names (not by glmc.symmetry.transforms) keep the function, weight matching at its defaults
undoes them on a Llama that ``glmc train`` trained here, folders written by glmc reload with ``from_pretrained``, and
options glmc does not model are refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from glmc.archs import build_model, get_arch
from glmc.errors import ConfigError
from glmc.io import formats
from glmc.io.live import read_module
from glmc.match.weight import weight_match
from glmc.symmetry.canonical import canonicalize, fixes_ones
from glmc.symmetry.exactness import invariance_errors
from glmc.symmetry.transforms import MATCHABLE, apply, random_transform
from simulations.bench.planting import plant_llama
from tests.hf_models import hf_logits, planted_barriers, trained_folder
from tests.symmetry_models import RMS_CONFIGS, canonical

TOL = 1e-5


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A llama-tiny (4 query heads on 2 KV heads) that ``glmc train`` trained here, as transformers saves it."""
    return trained_folder(tmp_path_factory, "llama-tiny", 150)


@pytest.mark.parametrize("orthogonal", [True, False])
def test_symmetries_planted_on_hf_names_keep_the_trained_llamas_function(trained: Path, orthogonal: bool) -> None:
    model = LlamaForCausalLM.from_pretrained(str(trained))
    sd = {k: v for k, v in model.state_dict().items()}
    x = torch.randint(0, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    moved = plant_llama({k: v.double() for k, v in sd.items()}, model.config, seed=1, is_orthogonal=orthogonal)
    assert max(float((moved[k] - sd[k].double()).abs().max()) for k in sd) > 0.1  # it moved
    reference = hf_logits(LlamaForCausalLM(model.config), {k: v.double() for k, v in sd.items()}, x)
    # HF's RMSNorm computes in float32 whatever the model's dtype, hence ~1e-7 rather than ~1e-15
    assert float((hf_logits(LlamaForCausalLM(model.config), moved, x) - reference).abs().max()) <= TOL


def test_weight_matching_undoes_a_hand_planted_transform_of_the_trained_llama(trained: Path, tmp_path: Path) -> None:
    """Through ``glmc barrier``, as a user runs it on two transformers folders: distance at float precision, no
    barrier."""
    model = LlamaForCausalLM.from_pretrained(str(trained))
    moved = plant_llama({k: v.double() for k, v in model.state_dict().items()}, model.config, seed=2)
    vanilla, weight = planted_barriers(trained, LlamaForCausalLM, moved, tmp_path / "b")
    assert vanilla > 0.05 and abs(weight) <= 1e-3  # far apart before matching, no barrier after


def test_an_aligned_llama_written_by_glmc_reloads_and_computes_what_was_aligned(trained: Path, tmp_path: Path) -> None:
    state, meta = formats.read(trained)
    cfg, arch = meta.config, get_arch(meta.config.family)
    a = canonicalize(arch, state, cfg, dtype=torch.float64)
    b = apply(a, arch.spec, random_transform(cfg, MATCHABLE, torch.Generator().manual_seed(4),
                                            fixes_ones("standard", arch)), cfg.heads)
    result = weight_match(a, b, arch.spec, cfg.depth, cfg.heads, fix_ones=False, rotary=cfg.rotary_dim)
    aligned = apply(b, arch.spec, result.transform, cfg.heads)
    assert max(float((aligned[k] - a[k]).abs().max()) for k in a) <= 1e-5
    formats.write(tmp_path / "out", "hf", arch.to_native(aligned, cfg), meta)
    reloaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).double().eval()
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    original = LlamaForCausalLM.from_pretrained(str(trained)).double().eval()
    with torch.no_grad():
        assert float((reloaded(input_ids=x).logits - original(input_ids=x).logits).abs().max()) <= 1e-4


@pytest.mark.parametrize("name", RMS_CONFIGS)
def test_default_weight_matching_recovers_every_config_variant(name: str) -> None:
    """KV heads 1, several and equal to the heads; head_dim set apart; q/k/v biases; in float64."""
    cfg = RMS_CONFIGS[name]
    arch = get_arch(cfg.family)
    a = canonical(cfg, 0)
    t = random_transform(cfg, MATCHABLE, torch.Generator().manual_seed(5), fixes_ones("standard", arch))
    b = apply(a, arch.spec, t, cfg.heads)
    result = weight_match(a, b, arch.spec, cfg.depth, cfg.heads, fix_ones=False, rotary=cfg.rotary_dim,
                          dtype=torch.float64)
    aligned = apply(b, arch.spec, result.transform, cfg.heads)
    assert max(float((aligned[k] - a[k]).abs().max()) for k in a) <= 1e-9


def _hf_llama(**options: object) -> torch.nn.Module:
    base = {"vocab_size": 20, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 16,
            "tie_word_embeddings": False}
    return LlamaForCausalLM(LlamaConfig(**{**base, **options}))


@pytest.mark.parametrize(("model", "message"), [
    (lambda: _hf_llama(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
     "unsupported llama rope_type 'linear'"),
    (lambda: _hf_llama(mlp_bias=True), "unsupported llama option mlp_bias=True"),
    (lambda: MistralForCausalLM(MistralConfig(vocab_size=20, hidden_size=16, intermediate_size=32,
                                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                              max_position_embeddings=64, sliding_window=8)),
     "unsupported mistral sliding_window=8 below max_position_embeddings 64"),
])
def test_options_glmc_does_not_model_are_refused_in_one_line(model, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        read_module(model())
    assert "\n" not in str(err.value)


def test_the_standard_form_is_the_only_form_of_an_rms_family() -> None:
    cfg = RMS_CONFIGS["llama-gqa"]
    arch = get_arch(cfg.family)
    with pytest.raises(ConfigError, match="only the standard form"):
        canonicalize(arch, build_model(cfg).state_dict(), cfg, "rmsnorm")


FAMILY_MODELS = {
    "llama": lambda: _hf_llama(num_attention_heads=4, num_key_value_heads=2, attention_bias=True, head_dim=6),
    # tied: read with its head a copy of the embeddings (folding the final norm unties them), written back untied
    "llama-tied": lambda: _hf_llama(tie_word_embeddings=True),
    "mistral": lambda: MistralForCausalLM(MistralConfig(
        vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=16, sliding_window=None, tie_word_embeddings=False)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(
        vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("family", FAMILY_MODELS)
def test_each_family_goes_in_and_out_as_transformers_saves_it(family: str, tmp_path: Path) -> None:
    """A folder ``save_pretrained`` wrote is read with its config (every class exact on its own weights), and the
    folder glmc writes back reloads with ``from_pretrained`` computing the same logits."""
    torch.manual_seed(0)
    model = FAMILY_MODELS[family]().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # norm gains off one, so folding them is not trivial
    model.save_pretrained(str(tmp_path / "in"))
    state, meta = formats.read(tmp_path / "in")
    assert meta.config.family == family.removesuffix("-tied")
    assert meta.config.kv_heads == model.config.num_key_value_heads
    errors = invariance_errors(meta.config, native=state)
    assert max(errors.values()) <= TOL, errors
    formats.write(tmp_path / "out", "hf", state, meta)
    reloaded = type(model).from_pretrained(str(tmp_path / "out")).eval()
    x = torch.randint(0, 20, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=x).logits, model(input_ids=x).logits)


def test_the_library_api_takes_live_llamas_and_gives_back_their_class() -> None:
    """glmc.check, align, barrier and merge on modules transformers built (grouped queries, RoPE, SwiGLU)."""
    import glmc

    torch.manual_seed(0)
    a, b = (_hf_llama(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2) for _ in range(2))
    assert glmc.check(a) <= TOL
    moved = glmc.align(a, b)
    assert type(moved) is LlamaForCausalLM
    x = torch.randint(0, 20, (8, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # the aligned B computes B's function
        assert float((moved(input_ids=x).logits - b(input_ids=x).logits).abs().max()) <= 1e-4
    data = TensorDataset(x[:, :-1], x[:, 1:])
    curve = glmc.barrier(a, b, data, method="weight")
    with torch.no_grad():  # the path's ends are the two models as they are
        ends = [float(torch.nn.functional.cross_entropy(m(input_ids=x[:, :-1]).logits.flatten(0, 1),
                                                         x[:, 1:].flatten())) for m in (b, a)]
    assert curve.losses[0] == pytest.approx(ends[0], abs=1e-4) and curve.losses[-1] == pytest.approx(ends[1], abs=1e-4)
    assert type(glmc.merge([a, b, moved])) is LlamaForCausalLM


def test_tied_llamas_align_into_an_untied_one_computing_bs_function() -> None:
    """Folding the final RMSNorm into the head unties it: the aligned module keeps B's function, untied."""
    import glmc

    torch.manual_seed(1)
    a, b = (_hf_llama(num_hidden_layers=2, tie_word_embeddings=True) for _ in range(2))
    with torch.no_grad():
        for model in (a, b):
            model.model.norm.weight.add_(0.3 * torch.randn_like(model.model.norm.weight))
    moved = glmc.align(a, b)
    assert not moved.config.tie_word_embeddings
    assert moved.lm_head.weight.data_ptr() != moved.model.embed_tokens.weight.data_ptr()
    x = torch.randint(0, 20, (4, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert float((moved(input_ids=x).logits - b(input_ids=x).logits).abs().max()) <= 1e-4
