"""GPT-NeoX (Pythia's ``GPTNeoXForCausalLM``) on models transformers builds and saves: its fused q|k|v, interleaved
per head, read as separate q, k, v and joined back exactly; symmetries planted by hand on Hugging Face's own
parameter names (not by glmc.symmetry.transforms) keep the function and are undone by weight matching at its defaults
on a model that ``glmc train`` trained here; folders written by glmc reload with ``from_pretrained``; the live-module
API, learned and universe matching run; options glmc does not model are refused in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from glmc.archs import build_model, get_arch
from glmc.archs.base import Part
from glmc.cli import main as glmc
from glmc.core.config import preset
from glmc.errors import ConfigError
from glmc.io import formats
from glmc.io.live import read_module
from glmc.match.activation import activation_match
from glmc.match.align import align_pair
from glmc.match.options import LearnConfig, MatchOptions
from glmc.merging.corrections import Corrections
from glmc.merging.options import MergeOptions
from glmc.merging.repair import repair
from glmc.merging.universe import members, universe_match
from glmc.merging.widths import check_embeddable
from glmc.symmetry import groups
from glmc.symmetry.canonical import canonicalize, fixes_ones
from glmc.symmetry.exactness import invariance_errors
from glmc.symmetry.transforms import MATCHABLE, Transform, apply, random_transform
from simulations.bench.planting import plant_neox
from tests.hf_models import hf_logits, planted_barriers, trained_folder
from tests.symmetry_models import NEOX_CONFIGS, canonical, inputs, logits_of, random_native

TOL = 1e-5


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A neox-tiny (parallel residual, rotary on a quarter of each head) that ``glmc train`` trained here, as
    transformers saves it."""
    return trained_folder(tmp_path_factory, "neox-tiny", 100)


@pytest.mark.parametrize("orthogonal", [True, False])
def test_symmetries_planted_on_hf_names_keep_the_trained_models_function(trained: Path, orthogonal: bool) -> None:
    model = GPTNeoXForCausalLM.from_pretrained(str(trained))
    assert model.config.use_parallel_residual and model.config.rope_parameters["partial_rotary_factor"] == 0.25
    sd = dict(model.state_dict())
    x = torch.randint(0, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    moved = plant_neox({k: v.double() for k, v in sd.items()}, model.config, 1, orthogonal)
    assert max(float((moved[k] - sd[k].double()).abs().max()) for k in sd) > 0.1  # it moved
    reference = hf_logits(GPTNeoXForCausalLM(model.config), {k: v.double() for k, v in sd.items()}, x)
    assert float((hf_logits(GPTNeoXForCausalLM(model.config), moved, x) - reference).abs().max()) <= TOL


def test_weight_matching_undoes_a_hand_planted_transform_of_the_trained_model(trained: Path, tmp_path: Path) -> None:
    """Through ``glmc barrier``, as a user runs it on two transformers folders: no barrier after matching."""
    model = GPTNeoXForCausalLM.from_pretrained(str(trained))
    moved = plant_neox({k: v.double() for k, v in model.state_dict().items()}, model.config, 2)
    vanilla, weight = planted_barriers(trained, GPTNeoXForCausalLM, moved, tmp_path / "b")
    assert vanilla > 0.05 and abs(weight) <= 1e-3  # far apart before matching, no barrier after


def test_glmc_align_writes_a_folder_that_reloads_computing_the_model_it_aligned(trained: Path, tmp_path: Path) -> None:
    """``glmc align`` of a transformed copy (written by transformers) to the trained model: the folder it writes
    reloads with ``from_pretrained`` computing B's function, with weights next to A's."""
    model = GPTNeoXForCausalLM.from_pretrained(str(trained))
    moved = plant_neox({k: v.double() for k, v in model.state_dict().items()}, model.config, 3)
    b = GPTNeoXForCausalLM(model.config)
    b.load_state_dict({k: v.float() for k, v in moved.items()})
    b.save_pretrained(str(tmp_path / "b"))
    shutil.copy(trained / formats.GLMC_JSON, tmp_path / "b")
    assert glmc(["align", str(trained), str(tmp_path / "b"), "--out", str(tmp_path / "out")]) == 0
    reloaded = GPTNeoXForCausalLM.from_pretrained(str(tmp_path / "out")).double().eval()
    x = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert float((reloaded(input_ids=x).logits - b.double().eval()(input_ids=x).logits).abs().max()) <= 1e-4
    state, meta = formats.read(tmp_path / "out")
    arch, cfg = get_arch("neox"), meta.config
    a = canonicalize(arch, dict(model.state_dict()), cfg, dtype=torch.float64)
    aligned = canonicalize(arch, state, cfg, dtype=torch.float64)
    assert max(float((aligned[k] - a[k]).abs().max()) for k in a) <= 1e-4


@pytest.mark.parametrize("name", NEOX_CONFIGS)
def test_the_fused_qkv_is_read_per_head_and_joined_back_exactly(name: str) -> None:
    """Canonical q, k, v are rows [h·3·d_h + slot·d_h, …) of query_key_value (HF views its output as (H, 3·d_h) and
    chunks it); writing them back gives the native tensors bit for bit."""
    cfg = NEOX_CONFIGS[name]
    arch, native = get_arch("neox"), random_native(cfg, 0)
    state = arch.to_canonical(native, cfg)
    fused = native["gpt_neox.layers.0.attention.query_key_value.weight"].reshape(cfg.heads, 3, cfg.head_dim, -1)
    for slot, part in enumerate("qkv"):
        assert torch.equal(state[f"blocks.0.attn.{part}.w"], fused[:, slot].reshape(cfg.attn_dim, -1))
    back = arch.to_native(state, cfg)
    assert back.keys() == native.keys() and all(torch.equal(back[k], native[k]) for k in native)


@pytest.mark.parametrize("per_head", [True, False])
def test_a_part_takes_its_slot_and_joins_and_replaces_exactly(per_head: bool) -> None:
    """Slot i of 3 over 4 heads of 5: rows [h·15 + i·5, …) interleaved per head, [i·20, …) in blocks; along the
    rows of a weight and the features of an output alike."""
    fused = torch.randn(60, 7, dtype=torch.float64)
    parts = [Part(i, 3, per_head) for i in range(3)]
    rows = [torch.cat([torch.arange(h * 15 + i * 5, h * 15 + i * 5 + 5) for h in range(4)]) if per_head
            else torch.arange(i * 20, i * 20 + 20) for i in range(3)]
    for part, index in zip(parts, rows, strict=True):
        assert torch.equal(part.take(fused, 4), fused[index])
        assert torch.equal(part.take(fused.T, 4, axis=-1), fused[index].T)
    assert torch.equal(parts[0].join([p.take(fused, 4) for p in parts], 4), fused)
    replaced = parts[1].put(fused.T, torch.zeros(7, 20, dtype=torch.float64), 4, axis=-1).T
    assert torch.equal(replaced[rows[1]], torch.zeros(20, 7, dtype=torch.float64))
    assert torch.equal(replaced[torch.cat([rows[0], rows[2]])], fused[torch.cat([rows[0], rows[2]])])


def test_a_qk_map_pairing_the_whole_head_breaks_a_partial_rotary_model() -> None:
    """The pairing is i with i + r/2 on the first r dimensions: the same rotation on i, i + d_h/2 (the full-rotary
    pairing) changes the function, so the invariance tests would catch a wrong convention."""
    cfg = NEOX_CONFIGS["neox-parallel"]
    arch, x = get_arch("neox"), inputs(cfg, 3)
    state = canonicalize(arch, random_native(cfg, 1), cfg)
    reference = logits_of(arch.to_native(state, cfg), cfg, x)
    g = torch.Generator().manual_seed(2)
    t = Transform(cfg.depth)
    t.qk = [torch.stack([groups.random_rotary(cfg.head_dim, cfg.rotary_dim, g, True) for _ in range(cfg.heads)])
            for _ in range(cfg.depth)]
    same = apply(state, arch.spec, t, cfg.heads)
    assert (logits_of(arch.to_native(same, cfg), cfg, x) - reference).abs().max() <= TOL
    t.qk = [torch.stack([groups.random_rotary(cfg.head_dim, cfg.head_dim, g, True) for _ in range(cfg.heads)])
            for _ in range(cfg.depth)]
    wrong = apply(state, arch.spec, t, cfg.heads)
    assert (logits_of(arch.to_native(wrong, cfg), cfg, x) - reference).abs().max() > 1e-3


@pytest.mark.parametrize("name", NEOX_CONFIGS)
def test_default_weight_matching_recovers_every_config_variant(name: str) -> None:
    """Parallel and sequential, rotary on 0.25, 0.5 and 1.0 of each head, without attention biases; float64."""
    cfg = NEOX_CONFIGS[name]
    arch = get_arch(cfg.family)
    from glmc.match.weight import weight_match

    a = canonical(cfg, 0)
    t = random_transform(cfg, MATCHABLE, torch.Generator().manual_seed(5), fixes_ones("standard", arch))
    b = apply(a, arch.spec, t, cfg.heads)
    result = weight_match(a, b, arch.spec, cfg.depth, cfg.heads, fix_ones=True, rotary=cfg.rotary_dim,
                          dtype=torch.float64)
    aligned = apply(b, arch.spec, result.transform, cfg.heads)
    assert max(float((aligned[k] - a[k]).abs().max()) for k in a) <= 1e-9


def test_learned_activation_and_universe_matching_run_on_neox() -> None:
    """A few steps of learned matching keep B's function; activation matching, hooked on the heads ``dense`` reads
    and the units ``dense_4h_to_h`` reads, undoes head and unit permutations; universe matching of a model and two
    transformed copies merges them back into it."""
    cfg = NEOX_CONFIGS["neox-sequential"]
    arch, x = get_arch("neox"), inputs(cfg, 16)
    native = random_native(cfg, 0)
    a = canonicalize(arch, native, cfg)
    copies = [apply(a, arch.spec, random_transform(cfg, MATCHABLE, torch.Generator().manual_seed(s), True),
                    cfg.heads) for s in (1, 2)]
    gelu = NEOX_CONFIGS["neox-parallel"]  # the sequential config's ReLU leaves units dead on a random model: ties
    start = canonical(gelu, 0)
    permuted = apply(start, arch.spec, random_transform(gelu, ("head-perm", "mlp-perm"),
                                                        torch.Generator().manual_seed(4)), gelu.heads)
    found = activation_match(start, permuted, gelu, inputs(gelu, 16)).transform
    back = apply(permuted, arch.spec, found, gelu.heads)
    assert max(float((back[k] - start[k]).abs().max()) for k in start) <= 1e-9
    data = TensorDataset(x[:, :-1], x[:, 1:])
    learned = align_pair(native, random_native(cfg, 3), cfg, "learned",
                         MatchOptions(learn=LearnConfig(steps=3, batch_size=8, eval_every=2)), data=data)
    b = arch.to_native(learned.b, cfg)
    assert (logits_of(b, cfg, x) - logits_of(random_native(cfg, 3), cfg, x)).abs().max() <= TOL
    result = universe_match(members([a, *copies], [cfg] * (len(copies) + 1)), cfg)
    assert max(float((result.merged[k] - a[k]).abs().max()) for k in a) <= 1e-6


def _hf_neox(**options: object) -> GPTNeoXForCausalLM:
    base = {"vocab_size": 20, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 16, "tie_word_embeddings": False}
    return GPTNeoXForCausalLM(GPTNeoXConfig(**{**base, **options}))


@pytest.mark.parametrize(("model", "message"), [
    (lambda: _hf_neox(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                       "partial_rotary_factor": 0.25}), "unsupported neox rope_type 'linear'"),
    (lambda: _hf_neox(hidden_act="gelu_new"), "unsupported neox hidden_act 'gelu_new'"),
    (lambda: _hf_neox(rotary_pct=0.375), "unsupported neox rotary dimensions 3"),
])
def test_options_glmc_does_not_model_are_refused_in_one_line(model, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        read_module(model())
    assert "\n" not in str(err.value)


def test_what_neox_cannot_do_is_refused_in_one_line() -> None:
    """No circuit forms (q|k|v are not fused in thirds), no head size change (rotary positions), no REPAIR without
    attention biases, no parallel residual outside the families that have one."""
    cfg = NEOX_CONFIGS["neox-nobias"]
    arch = get_arch(cfg.family)
    state = canonicalize(arch, random_native(cfg, 0), cfg)
    errors = []
    for attempt, message in [
        (lambda: canonicalize(arch, build_model(cfg).state_dict(), cfg, "circuit"), "only the standard and rmsnorm"),
        (lambda: check_embeddable(cfg.replace(width=24, heads=3, head_dim=8), cfg), "rotary positions fix"),
        (lambda: repair(state, [state], cfg, TensorDataset(inputs(cfg, 4), inputs(cfg, 4))), "attn.proj has none"),
        (lambda: preset("gpt2-tiny").replace(parallel_residual=True), "parallel_residual needs one of neox"),
    ]:
        with pytest.raises(ConfigError, match=message) as err:
            attempt()
        errors.append(str(err.value))
    assert not any("\n" in e for e in errors)


def test_a_folder_goes_in_and_out_as_transformers_saves_it(tmp_path: Path) -> None:
    """A ``save_pretrained`` folder (sequential residual, full rotary, no attention biases, Pythia's older
    ``embed_out`` name for the head) is read with its config, every class exact on its own weights; the folder glmc
    writes back reloads with ``from_pretrained`` computing the same logits."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = _hf_neox(num_hidden_layers=2, num_attention_heads=4, use_parallel_residual=False, rotary_pct=1.0,
                     attention_bias=False).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # norm gains off one, so folding them is not trivial
    model.save_pretrained(str(tmp_path / "in"))
    weights = tmp_path / "in" / "model.safetensors"
    save_file({k.replace("lm_head.", "embed_out."): v for k, v in load_file(weights).items()}, weights,
              metadata={"format": "pt"})
    state, meta = formats.read(tmp_path / "in")
    assert (meta.config.family, meta.config.parallel_residual, meta.config.qkv_bias) == ("neox", False, False)
    errors = invariance_errors(meta.config, native=state)
    assert max(errors.values()) <= TOL, errors
    formats.write(tmp_path / "out", "hf", state, meta)
    reloaded = GPTNeoXForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    x = torch.randint(0, 20, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=x).logits, model(input_ids=x).logits)


def test_the_library_api_takes_live_neox_models_and_gives_back_their_class() -> None:
    """glmc.check, align, barrier and merge on modules transformers built (Pythia's defaults: parallel residual,
    rotary on a quarter of each head)."""
    import glmc as api

    torch.manual_seed(0)
    a, b = (_hf_neox(num_hidden_layers=2, num_attention_heads=2) for _ in range(2))
    assert api.check(a) <= TOL
    moved = api.align(a, b)
    assert type(moved) is GPTNeoXForCausalLM
    x = torch.randint(0, 20, (8, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # the aligned B computes B's function
        assert float((moved(input_ids=x).logits - b(input_ids=x).logits).abs().max()) <= 1e-4
    data = TensorDataset(x[:, :-1], x[:, 1:])
    curve = api.barrier(a, b, data, method="weight")
    with torch.no_grad():  # the path's ends are the two models as they are
        ends = [float(torch.nn.functional.cross_entropy(m(input_ids=x[:, :-1]).logits.flatten(0, 1),
                                                         x[:, 1:].flatten())) for m in (b, a)]
    assert curve.losses[0] == pytest.approx(ends[0], abs=1e-4) and curve.losses[-1] == pytest.approx(ends[1], abs=1e-4)
    assert type(api.merge([a, b, moved])) is GPTNeoXForCausalLM
    every = MergeOptions(corrections=Corrections(restore_norms=True, refit=8, repair=8))  # hooks on q, k, v's parts
    corrected = api.merge([a, b], data=data, options=every)
    with torch.no_grad():
        assert type(corrected) is GPTNeoXForCausalLM and bool(torch.isfinite(corrected(input_ids=x).logits).all())


def test_a_tied_neox_is_read_and_aligned_into_an_untied_one_computing_bs_function() -> None:
    """As for the Llama families: folding the final LayerNorm into the head unties it from the embeddings."""
    import glmc

    torch.manual_seed(2)
    a, b = (_hf_neox(num_hidden_layers=2, tie_word_embeddings=True) for _ in range(2))
    with torch.no_grad():
        for model in (a, b):
            model.gpt_neox.final_layer_norm.weight.add_(0.3 * torch.randn(16))
    moved = glmc.align(a, b)
    assert not moved.config.tie_word_embeddings
    x = torch.randint(0, 20, (4, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert float((moved(input_ids=x).logits - b(input_ids=x).logits).abs().max()) <= 1e-4
