"""BERT (``BertForMaskedLM``), a post-LayerNorm masked language model, on models transformers builds and saves:
symmetries planted by hand on Hugging Face's own parameter names (not by glmc.symmetry.transforms) keep the function,
weight matching at its defaults undoes them on a BERT that ``glmc train`` trained here, folders glmc writes reload with
``from_pretrained``, the masking is BERT's 80/10/10 with fixed evaluation masks, and options glmc does not model are
refused in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForMaskedLM, BertModel

from glmc.archs import get_arch
from glmc.cli import main as glmc
from glmc.core.config import preset
from glmc.data.masking import IGNORE, MaskedWindows, mask_id, mask_tokens
from glmc.errors import ConfigError
from glmc.io import formats
from glmc.io.live import read_module
from glmc.match.weight import weight_match, without_stream_biases
from glmc.merging.widths import check_embeddable
from glmc.symmetry import groups
from glmc.symmetry.canonical import canonicalize, residual_group, to_model
from glmc.symmetry.exactness import invariance_errors
from glmc.symmetry.transforms import MATCHABLE, Transform, apply, random_transform
from tests.hf_models import hf_logits, planted_barriers, trained_folder
from tests.symmetry_models import BERT_CONFIGS, canonical, inputs, logits_of, random_native

TOL = 1e-5
LAYER = "bert.encoder.layer.{}."


def _invertible(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.eye(n, dtype=torch.float64) + 0.3 * torch.randn(n, n, generator=g, dtype=torch.float64) / n**0.5


def plant_by_hand(sd: dict[str, torch.Tensor], hf: BertConfig, seed: int) -> dict[str, torch.Tensor]:
    """A BERT state dict moved by every symmetry class, on HF's names: a permutation of the stream (every LayerNorm's
    gain and bias with it, the MLM transform on both sides, the tied decoder as the word embedding), head
    permutations with an invertible q/k map M (k by M⁻ᵀ) and v/o map N per head, biases included, and an MLP
    permutation."""
    g = torch.Generator().manual_seed(seed)
    s = {k: v.double().clone() for k, v in sd.items()}
    d, heads = hf.hidden_size, hf.num_attention_heads
    hd = d // heads
    p = torch.randperm(d, generator=g)  # new stream unit i is old unit p[i]
    for name in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
        s[f"bert.embeddings.{name}.weight"] = s[f"bert.embeddings.{name}.weight"][:, p]
    norms = ["bert.embeddings.LayerNorm", "cls.predictions.transform.LayerNorm"] + [
        LAYER.format(i) + n for i in range(hf.num_hidden_layers) for n in ("attention.output.LayerNorm",
                                                                          "output.LayerNorm")]
    for norm in norms:
        s[f"{norm}.weight"], s[f"{norm}.bias"] = s[f"{norm}.weight"][p], s[f"{norm}.bias"][p]
    dense = "cls.predictions.transform.dense"
    s[f"{dense}.weight"], s[f"{dense}.bias"] = s[f"{dense}.weight"][p][:, p], s[f"{dense}.bias"][p]
    s["cls.predictions.decoder.weight"] = s["bert.embeddings.word_embeddings.weight"]
    for i in range(hf.num_hidden_layers):
        pre = LAYER.format(i)
        hperm = torch.randperm(heads, generator=g)
        m, n = [_invertible(hd, g) for _ in range(heads)], [_invertible(hd, g) for _ in range(heads)]

        (wq, bq), (wk, bk), (wv, bv) = ((s[f"{pre}attention.self.{name}.weight"][:, p].reshape(heads, hd, d),
                                         s[f"{pre}attention.self.{name}.bias"].reshape(heads, hd))
                                        for name in ("query", "key", "value"))
        wo = s[f"{pre}attention.output.dense.weight"][p].reshape(d, heads, hd)
        new = {k: torch.empty_like(x) for k, x in (("wq", wq), ("bq", bq), ("wk", wk), ("bk", bk), ("wv", wv),
                                                   ("bv", bv), ("wo", wo))}
        for h in range(heads):
            old, mk = int(hperm[h]), torch.linalg.inv(m[h]).T
            new["wq"][h], new["bq"][h] = m[h] @ wq[old], m[h] @ bq[old]
            new["wk"][h], new["bk"][h] = mk @ wk[old], mk @ bk[old]
            new["wv"][h], new["bv"][h] = n[h] @ wv[old], n[h] @ bv[old]
            new["wo"][:, h] = wo[:, old] @ torch.linalg.inv(n[h])
        for key, name in (("q", "query"), ("k", "key"), ("v", "value")):
            s[f"{pre}attention.self.{name}.weight"] = new[f"w{key}"].reshape(d, d)
            s[f"{pre}attention.self.{name}.bias"] = new[f"b{key}"].reshape(d)
        s[f"{pre}attention.output.dense.weight"] = new["wo"].reshape(d, d)
        s[f"{pre}attention.output.dense.bias"] = s[f"{pre}attention.output.dense.bias"][p]
        u = torch.randperm(hf.intermediate_size, generator=g)
        s[f"{pre}intermediate.dense.weight"] = s[f"{pre}intermediate.dense.weight"][u][:, p]
        s[f"{pre}intermediate.dense.bias"] = s[f"{pre}intermediate.dense.bias"][u]
        s[f"{pre}output.dense.weight"] = s[f"{pre}output.dense.weight"][p][:, u]
        s[f"{pre}output.dense.bias"] = s[f"{pre}output.dense.bias"][p]
    return s


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bert-tiny that ``glmc train`` trained here as a masked LM, as transformers saves it."""
    folder = trained_folder(tmp_path_factory, "bert-tiny", 30)
    cfg = formats.read(folder)[1].config
    assert cfg.vocab_size == mask_id(cfg.vocab_size) + 1 and cfg.family == "bert"
    return folder


def test_symmetries_planted_on_hf_names_keep_the_trained_berts_function(trained: Path) -> None:
    model = BertForMaskedLM.from_pretrained(str(trained))
    sd = dict(model.state_dict())
    x = torch.randint(0, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    moved = plant_by_hand(sd, model.config, seed=1)
    assert max(float((moved[k] - sd[k].double()).abs().max()) for k in sd) > 0.1  # it moved
    reference = hf_logits(BertForMaskedLM(model.config), {k: v.double() for k, v in sd.items()}, x)
    assert float((hf_logits(BertForMaskedLM(model.config), moved, x) - reference).abs().max()) <= TOL


def test_weight_matching_undoes_a_hand_planted_transform_of_the_trained_bert(trained: Path, tmp_path: Path) -> None:
    """Through ``glmc barrier`` on two transformers folders: no barrier left after default weight matching."""
    model = BertForMaskedLM.from_pretrained(str(trained))
    moved = plant_by_hand(dict(model.state_dict()), model.config, seed=2)
    vanilla, weight = planted_barriers(trained, BertForMaskedLM, moved, tmp_path / "b", limit=64)
    assert vanilla > 0.01 and abs(weight) <= 1e-3  # far apart before matching, no barrier after


def test_an_aligned_bert_written_by_glmc_reloads_and_computes_what_was_aligned(trained: Path, tmp_path: Path) -> None:
    state, meta = formats.read(trained)
    cfg, arch = meta.config, get_arch(meta.config.family)
    a = canonicalize(arch, state, cfg, dtype=torch.float64)
    native = arch.to_native(a, cfg)  # the decoder is no canonical tensor; it is written as the word embedding
    assert "head.w" not in a and torch.equal(native["cls.predictions.decoder.weight"],
                                             native["bert.embeddings.word_embeddings.weight"])
    group = residual_group("standard", arch)
    b = apply(a, arch.spec, random_transform(cfg, MATCHABLE, torch.Generator().manual_seed(4), group), cfg.heads)
    result = weight_match(a, b, arch.spec, cfg.depth, cfg.heads, fix_ones=group)
    aligned = apply(b, arch.spec, result.transform, cfg.heads)
    assert max(float((aligned[k] - a[k]).abs().max()) for k in a) <= 1e-5
    formats.write(tmp_path / "out", "hf", arch.to_native(aligned, cfg), meta)
    reloaded = BertForMaskedLM.from_pretrained(str(tmp_path / "out")).double().eval()
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    original = BertForMaskedLM.from_pretrained(str(trained)).double().eval()
    with torch.no_grad():
        assert float((reloaded(input_ids=x).logits - original(input_ids=x).logits).abs().max()) <= 1e-4
    # and through the CLI: glmc align of the planted copy, exported as a transformers folder
    planted = BertForMaskedLM(original.config)
    planted.load_state_dict({k: v.float() for k, v in plant_by_hand(dict(original.state_dict()),
                                                                      original.config, 3).items()})
    planted.save_pretrained(str(tmp_path / "planted"))
    shutil.copy(trained / formats.GLMC_JSON, tmp_path / "planted")
    assert glmc(["align", str(trained), str(tmp_path / "planted"), "--out", str(tmp_path / "aligned.safetensors")]) == 0
    assert glmc(["export", str(tmp_path / "aligned.safetensors"), "--hf", str(tmp_path / "aligned")]) == 0
    again = BertForMaskedLM.from_pretrained(str(tmp_path / "aligned")).double().eval()
    with torch.no_grad():  # the aligned copy computes the planted one's function, with A's weights
        assert float((again(input_ids=x).logits - original(input_ids=x).logits).abs().max()) <= 1e-4
    assert float((again.bert.embeddings.word_embeddings.weight - original.bert.embeddings.word_embeddings.weight
                  ).detach().abs().max()) <= 1e-5


@pytest.mark.parametrize("name", BERT_CONFIGS)
def test_default_weight_matching_recovers_every_config_variant(name: str) -> None:
    """A permutation residual, heads and within-head maps, GELU and ReLU; float64."""
    cfg = BERT_CONFIGS[name]
    arch = get_arch(cfg.family)
    a = canonical(cfg, 0)
    t = random_transform(cfg, MATCHABLE, torch.Generator().manual_seed(5), "permutation")
    b = apply(a, arch.spec, t, cfg.heads)
    result = weight_match(a, b, arch.spec, cfg.depth, cfg.heads, fix_ones="permutation", dtype=torch.float64)
    aligned = apply(b, arch.spec, result.transform, cfg.heads)
    assert max(float((aligned[k] - a[k]).abs().max()) for k in a) <= 1e-9
    q = result.transform.residual
    assert q is not None and torch.equal(q.abs().sum(0), torch.ones(cfg.width, dtype=q.dtype))  # a permutation
    # two unrelated models: the objective it reports is the distance the stream-to-stream head map included, over
    # what it reads (the weights: the stream's biases are left out by default)
    other = weight_match(a, canonical(cfg, 1), arch.spec, cfg.depth, cfg.heads, fix_ones="permutation",
                         dtype=torch.float64)
    moved = apply(canonical(cfg, 1), arch.spec, other.transform, cfg.heads)
    read_a, read_b = (without_stream_biases(s, arch.spec, cfg.depth) for s in (a, moved))
    assert other.objective[-1] == pytest.approx(sum(float(((read_b[k] - read_a[k]) ** 2).sum()) for k in read_a),
                                                rel=1e-9)


def test_an_orthogonal_map_of_the_stream_breaks_a_post_layernorm_model() -> None:
    """Only permutations commute with a LayerNorm on the stream: one fixing 1 (a pre-LN family's) changes logits."""
    cfg = BERT_CONFIGS["bert-odd"]
    arch = get_arch(cfg.family)
    native, x = random_native(cfg, 2), inputs(cfg)
    state = canonicalize(arch, native, cfg)
    t = Transform(cfg.depth, residual=groups.random_residual(cfg.width, torch.Generator().manual_seed(3), True))
    with torch.no_grad():
        moved = arch.logits(to_model(apply(state, arch.spec, t, cfg.heads), cfg), x)
    assert float((moved - logits_of(native, cfg, x)).abs().max()) > 1e-3
    assert max(invariance_errors(cfg).values()) <= TOL


def test_the_masking_is_80_10_10_of_15_percent_and_evaluation_masks_are_fixed() -> None:
    vocab = 51
    x = torch.randint(0, vocab - 1, (4000, 32), generator=torch.Generator().manual_seed(0))
    masked, targets = mask_tokens(x, vocab, torch.Generator().manual_seed(1))
    selected = targets != IGNORE
    assert torch.equal(targets[selected], x[selected]) and bool(selected.any(1).all())
    assert abs(float(selected.float().mean()) - 0.15) < 0.005
    shares = [float((masked[selected] == mask_id(vocab)).float().mean()),
              float((masked[selected] == x[selected]).float().mean())]
    assert abs(shares[0] - 0.8) < 0.01
    assert abs(shares[1] - (0.1 + 0.1 / (vocab - 1))) < 0.01  # kept, or replaced by the same token by chance
    assert torch.equal(masked[~selected], x[~selected]) and int(masked.max()) <= mask_id(vocab)
    windows = TensorDataset(x[:20], x[:20])
    fixed, train = MaskedWindows(windows, vocab, fixed=True), MaskedWindows(windows, vocab, seed=0)
    assert all(torch.equal(fixed[i][0], fixed[i][0]) and torch.equal(fixed[i][1], fixed[i][1]) for i in range(20))
    assert not all(torch.equal(train[i][1], train[i][1]) for i in range(20))  # training draws fresh masks


def _hf_bert(**options: object) -> BertForMaskedLM:
    base = {"vocab_size": 21, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 24, "max_position_embeddings": 16, "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0}
    return BertForMaskedLM(BertConfig(**{**base, **options}))


def test_the_library_api_takes_live_berts_and_gives_back_their_class() -> None:
    """glmc.check, align, barrier and merge on modules transformers built; the barrier's ends are the models."""
    import glmc as api

    torch.manual_seed(0)
    a, b = _hf_bert().eval(), _hf_bert().eval()
    assert api.check(a) <= TOL
    moved = api.align(a, b)
    assert type(moved) is BertForMaskedLM
    x = torch.randint(0, 20, (8, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # the aligned B computes B's function
        assert float((moved(input_ids=x).logits - b(input_ids=x).logits).abs().max()) <= 1e-4
    data = MaskedWindows(TensorDataset(x, x), 21, fixed=True)
    curve = api.barrier(a, b, data, method="weight")
    (xm, ym), = DataLoader(data, batch_size=8)
    with torch.no_grad():
        ends = [float(torch.nn.functional.cross_entropy(m(input_ids=xm).logits.flatten(0, 1), ym.flatten()))
                for m in (b, a)]
    assert curve.losses[0] == pytest.approx(ends[0], abs=1e-4) and curve.losses[-1] == pytest.approx(ends[1], abs=1e-4)
    merged = api.merge([a, b, moved])
    assert type(merged) is BertForMaskedLM
    assert torch.equal(merged.cls.predictions.decoder.weight, merged.bert.embeddings.word_embeddings.weight)


@pytest.mark.parametrize(("model", "message"), [
    (lambda: _hf_bert(position_embedding_type="relative_key"), "unsupported bert position_embedding_type"),
    (lambda: _hf_bert(is_decoder=True), "unsupported bert option is_decoder=True"),
    (lambda: _hf_bert(hidden_act="gelu_new"), "unsupported bert hidden_act 'gelu_new'"),
    (lambda: _hf_bert(tie_word_embeddings=False), "unsupported bert option tie_word_embeddings=False"),
    (lambda: _hf_bert(type_vocab_size=1), "unsupported bert type_vocab_size=1"),
    (lambda: BertModel(BertConfig(vocab_size=21, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=24)), "unsupported model class BertModel"),
])
def test_options_glmc_does_not_model_are_refused_in_one_line(model, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        read_module(model())
    assert "\n" not in str(err.value)


def test_forms_and_widths_a_post_layernorm_family_lacks_are_refused_in_one_line() -> None:
    cfg = BERT_CONFIGS["bert-odd"]
    arch = get_arch(cfg.family)
    refusal = r"only the standard form \(form .rmsnorm.\): its norms sit on the stream"
    with pytest.raises(ConfigError, match=refusal) as err:
        canonicalize(arch, random_native(cfg, 0), cfg, "rmsnorm")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="post-LayerNorm stream's norm statistics change with the width") as err:
        check_embeddable(cfg.replace(width=30, heads=2, mlp=40, head_dim=15), cfg)
    assert "\n" not in str(err.value)
    assert preset("bert-tiny").norm_eps == 1e-12 and arch.hf_class == "BertForMaskedLM"


def test_learned_soft_dual_and_universe_matching_run_on_bert_with_every_correction() -> None:
    """The permutation residual is learned straight through its assignment: learned and dual matching stay exact;
    universe merging (learned) and REPAIR, refit and restore-norms give back the class, the decoder still tied."""
    import glmc as api
    from glmc.match.options import LearnConfig, MatchOptions
    from glmc.merging.corrections import Corrections
    from glmc.merging.options import MergeOptions

    torch.manual_seed(1)
    a, b = _hf_bert().eval(), _hf_bert().eval()
    x = torch.randint(0, 20, (32, 17), generator=torch.Generator().manual_seed(3))
    fast = LearnConfig(steps=3, eval_every=3)
    for method in ("learned", "dual", "soft"):
        moved = api.align(a, b, method, data=x, options=MatchOptions(learn=fast))
        with torch.no_grad():
            error = float((moved(input_ids=x[:, :16]).logits - b(input_ids=x[:, :16]).logits).abs().max())
        assert method == "soft" or error <= 1e-4, method
    merged = api.merge([a, b], "learned", data=x, options=MergeOptions(
        method="learned", corrections=Corrections(restore_norms=True, refit=16, repair=16)))
    assert type(merged) is BertForMaskedLM
    assert torch.equal(merged.cls.predictions.decoder.weight, merged.bert.embeddings.word_embeddings.weight)
