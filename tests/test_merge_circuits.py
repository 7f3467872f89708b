"""Heads merged as circuits (glmc.merging.circuits), in every family: the function is kept where the circuits are
(a model with itself, with a copy moved by within-head maps, at either end of a path), the merged circuits are the
mean where it has the heads' rank and its truncated SVD otherwise, per class of within-head maps (grouped queries
sharing k and v, complex rank-1 circuits per rotary pair), and on the official pair (trained and saved by others) the
merged heads come closer to the averaged circuits than the averaged factors do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from glmc.archs import get_arch
from glmc.cli import main
from glmc.core.state import mix
from glmc.io.formats import read
from glmc.match.align import align_pair
from glmc.merging.circuits import merge_circuits
from glmc.symmetry.canonical import residual_group, to_model
from glmc.symmetry.exactness import classes_for
from glmc.symmetry.transforms import apply, random_transform
from simulations.bench.official import PAIR
from tests.symmetry_models import ALL_CONFIGS, canonical, inputs, logits_of, random_native

NAMES = sorted(ALL_CONFIGS)


def _factors(state, cfg, layer):
    """A layer's q (H_kv, G, d_h, m), k and v (H_kv, d_h, m) rows [W | b] and outputs W_Oᵀ (H_kv, G, d_h, d), read
    from the canonical tensors by name (fused q|k|v in thirds, or separate)."""
    p = f"blocks.{layer}.attn"

    def rows(n):
        w = state[f"{p}.{n}.w"]
        return torch.cat([w, state[f"{p}.{n}.b"][:, None]], 1) if f"{p}.{n}.b" in state else w

    q, k, v = rows("qkv").chunk(3) if f"{p}.qkv.w" in state else (rows("q"), rows("k"), rows("v"))
    shape = (cfg.kv_heads, cfg.head_dim, q.shape[1])
    return (q.reshape(cfg.kv_heads, cfg.group, *shape[1:]), k.reshape(shape), v.reshape(shape),
            state[f"{p}.proj.w"].T.reshape(cfg.kv_heads, cfg.group, cfg.head_dim, cfg.width))


def _circuits(state, cfg, layer):
    """A layer's circuits per KV head, its group's stacked, those the model has: real QK over the dimensions rotary
    positions leave alone (H_kv, G·m, m), complex QK conj(q_c)ᵀ k_c per rotary pair (H_kv, r/2, G·m, m), and OV
    (H_kv, G·d, m)."""
    q, k, v, o = _factors(state, cfg, layer)
    r, h = cfg.rotary_dim, cfg.rotary_dim // 2
    qc, kc = torch.complex(q[:, :, :h], q[:, :, h:r]), torch.complex(k[:, :h], k[:, h:r])
    out = {"qk": torch.einsum("kgam,kan->kgmn", q[:, :, r:], k[:, r:]).flatten(1, 2),
           "pairs": torch.einsum("kgam,kan->kagmn", qc.conj(), kc).flatten(2, 3),
           "ov": torch.einsum("kgad,kam->kgdm", o, v).flatten(1, 2)}
    has = {"qk": r < cfg.head_dim, "pairs": r > 0, "ov": True}
    return {key: x for key, x in out.items() if has[key]}


def _truncated(x, rank):
    """The best rank-``rank`` approximation of each matrix of a batch."""
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    return (u[..., :rank] * s[..., None, :rank].to(u.dtype)) @ vh[..., :rank, :]


def _logits(state, cfg):
    with torch.no_grad():
        return get_arch(cfg.family).logits(to_model(state, cfg), inputs(cfg))


def _scaled(state, q, v):
    """``state`` with every head's q rows scaled by ``q`` and v rows by ``v``: circuits scaled alike."""
    out = dict(state)
    for name, x in state.items():
        if ".attn.qkv." in name:
            out[name] = x * torch.tensor([q, 1.0, v], dtype=x.dtype).repeat_interleave(len(x) // 3).reshape(
                -1, *[1] * (x.dim() - 1))
        elif ".attn.q." in name or ".attn.v." in name:
            out[name] = x * (q if ".attn.q." in name else v)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_a_model_merged_with_itself_or_a_within_head_copy_keeps_its_function(name):
    """In float64: A with itself, and A with a copy moved by random within-head maps (invertible, commuting with
    rotary positions), whose factors differ and circuits do not, merge to A's function; averaging the copy's factors
    does not."""
    cfg = ALL_CONFIGS[name]
    a = canonical(cfg, 1)
    t = random_transform(cfg, ("within-head-invertible",), torch.Generator().manual_seed(3))
    b = apply(a, get_arch(cfg.family).spec, t, cfg.heads)
    want = logits_of(random_native(cfg, 1), cfg, inputs(cfg))
    assert (_logits(merge_circuits(a, (a, a), cfg), cfg) - want).abs().max() <= 1e-5
    assert (_logits(merge_circuits(mix((a, b), (0.3, 0.7)), (a, b), cfg, (0.3, 0.7)), cfg) - want).abs().max() <= 1e-5
    assert (_logits(mix((a, b), (0.3, 0.7)), cfg) - want).abs().max() > 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_a_model_merged_with_its_transformed_copy_after_alignment_keeps_its_function(name):
    """B is A moved by a random element of the whole declared group (residual, heads, within-head and MLP maps);
    after weight matching, the midpoint merged as circuits is A's function, in float64."""
    cfg = ALL_CONFIGS[name]
    arch = get_arch(cfg.family)
    t = random_transform(cfg, classes_for(cfg), torch.Generator().manual_seed(5), residual_group("standard", arch))
    b = arch.to_native(apply(canonical(cfg, 1), arch.spec, t, cfg.heads), cfg)
    aligned = align_pair(random_native(cfg, 1), b, cfg, "weight")
    merged = merge_circuits(mix((aligned.a, aligned.b), (0.5, 0.5)), (aligned.a, aligned.b), cfg)
    assert (_logits(merged, cfg) - logits_of(random_native(cfg, 1), cfg, inputs(cfg))).abs().max() <= 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_an_end_of_the_path_keeps_its_function(name):
    """Weights (1, 0) give A back as the function it is (its heads refactored in another basis), in float64."""
    cfg = ALL_CONFIGS[name]
    a, b = canonical(cfg, 1), canonical(cfg, 2)
    end = merge_circuits(mix((a, b), (1.0, 0.0)), (a, b), cfg, (1.0, 0.0))
    assert any(not torch.equal(end[k], a[k]) for k in a)  # the factors were rewritten, not passed through
    assert (_logits(end, cfg) - logits_of(random_native(cfg, 1), cfg, inputs(cfg))).abs().max() <= 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_merged_circuits_are_the_mean_where_it_has_the_heads_rank(name):
    """B is A moved by within-head maps, its q rows doubled and v rows tripled: every mean circuit is A's times 1.5
    (QK) or 2 (OV), of the heads' rank, and the merge's circuits are exactly that mean."""
    cfg = ALL_CONFIGS[name]
    a = canonical(cfg, 1)
    t = random_transform(cfg, ("within-head-invertible",), torch.Generator().manual_seed(4))
    b = _scaled(apply(a, get_arch(cfg.family).spec, t, cfg.heads), 2.0, 3.0)
    merged = merge_circuits(mix((a, b), (0.5, 0.5)), (a, b), cfg)
    times = {"qk": 1.5, "pairs": 1.5, "ov": 2.0}
    for layer in range(cfg.depth):
        got, own = _circuits(merged, cfg, layer), _circuits(a, cfg, layer)
        for key, x in own.items():
            assert (got[key] - times[key] * x).abs().max() <= 1e-9 * x.abs().max(), (layer, key)


@pytest.mark.parametrize("name", NAMES)
def test_merged_circuits_are_the_mean_s_best_fit_of_the_heads_rank(name):
    """Two random models: the mean circuits have rank above the heads', and the merge's are their truncated SVDs
    (rank d_h − r for the real QK circuit, 1 per rotary pair, d_h for OV), computed here directly."""
    cfg = ALL_CONFIGS[name]
    a, b = canonical(cfg, 1), canonical(cfg, 2)
    merged = merge_circuits(mix((a, b), (0.25, 0.75)), (a, b), cfg, (0.25, 0.75))
    ranks = {"qk": cfg.head_dim - cfg.rotary_dim, "pairs": 1, "ov": cfg.head_dim}
    for layer in range(cfg.depth):
        got, of_a, of_b = (_circuits(s, cfg, layer) for s in (merged, a, b))
        for key, x in of_a.items():
            mean = 0.25 * x + 0.75 * of_b[key]
            assert torch.linalg.matrix_rank(mean).min() > ranks[key]
            assert (got[key] - _truncated(mean, ranks[key])).abs().max() <= 1e-9 * mean.abs().max(), (layer, key)


def test_on_the_official_pair_the_merged_heads_are_nearest_the_mean_circuits():
    """After weight matching, the midpoint's heads are closer to the mean of A's and B's circuits than the averaged
    factors' circuits are, in every layer (Eckart–Young), and every tensor outside the heads is the plain mean."""
    (na, meta), (nb, _) = read(PAIR / "seed0"), read(PAIR / "seed1")
    cfg = meta.config
    aligned = align_pair(na, nb, cfg, "weight")
    plain = mix((aligned.a, aligned.b), (0.5, 0.5))
    merged = merge_circuits(plain, (aligned.a, aligned.b), cfg, (1.0, 1.0))  # weights are normalised
    heads = {n for layer in range(cfg.depth) for n in (f"blocks.{layer}.attn.qkv.w", f"blocks.{layer}.attn.qkv.b",
                                                         f"blocks.{layer}.attn.proj.w")}
    assert all(torch.equal(merged[k], plain[k]) for k in plain if k not in heads)
    for layer in range(cfg.depth):
        of_a, of_b, got, averaged = (_circuits(s, cfg, layer) for s in (aligned.a, aligned.b, merged, plain))
        for key, x in of_a.items():
            target = (x + of_b[key]) / 2
            assert (got[key] - target).norm() < 0.9 * (averaged[key] - target).norm(), (layer, key)


def test_glmc_barrier_merges_the_heads_as_circuits_and_keeps_the_ends(tmp_path: Path):
    """On the official pair: the curve is named weight+circuits, its ends are the plain curve's losses (the models
    themselves), and its midpoint is another model's."""
    argv = ["barrier", str(PAIR / "seed0"), str(PAIR / "seed1"), "--points", "3", "--limit", "4", "--data-file",
            str(PAIR / "test.npy"), "--threads", "2"]
    outs = {flag: tmp_path / f"{flag or 'plain'}.json" for flag in ("", "--circuit-heads")}
    for flag, out in outs.items():
        assert main([*argv, *([flag] if flag else []), "--json", str(out)]) == 0
    plain, circuits = (json.loads(out.read_text()) for out in outs.values())
    assert (plain["method"], circuits["method"]) == ("weight", "weight+circuits")
    assert [circuits["losses"][i] for i in (0, 2)] == pytest.approx([plain["losses"][i] for i in (0, 2)], abs=1e-4)
    assert abs(circuits["losses"][1] - plain["losses"][1]) > 1e-4


@pytest.mark.parametrize(("extra", "expect"), [
    (["--form", "circuit"], "not 'circuit'"),
    (["--simplex", str(PAIR / "seed0")], "--circuit-heads applies to the pairwise curves")])
def test_glmc_barrier_refuses_circuit_heads_where_it_does_not_apply(extra, expect, tmp_path, capsys):
    argv = ["barrier", str(PAIR / "seed0"), str(PAIR / "seed1"), "--circuit-heads", *extra, "--data-file",
            str(PAIR / "test.npy"), "--json", str(tmp_path / "never.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0], err
    assert not (tmp_path / "never.json").exists()
