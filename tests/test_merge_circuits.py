"""Heads merged as circuits (glmc.merging.circuits): both ends of a path are kept as the functions they are, the
merged heads come closer to the averaged circuits than the averaged factors do, on the official pair (trained and
saved by others), and families without the circuit layout are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from glmc.archs import get_arch
from glmc.cli import main
from glmc.core.state import mix
from glmc.errors import ConfigError
from glmc.io.formats import read
from glmc.match.align import align_pair
from glmc.merging.circuits import merge_circuits
from glmc.symmetry.canonical import canonicalize, forms_for, to_model
from simulations.bench.official import PAIR
from tests.symmetry_models import ALL_CONFIGS, inputs, logits_of, random_native

FUSED = sorted(n for n, c in ALL_CONFIGS.items() if "circuit" in forms_for(get_arch(c.family)))


def _circuits(state, cfg, layer):
    """A layer's (H, e, e) QK and (H, d, e) OV circuits over [x; 1], written out from the fused tensors."""
    p, d = f"blocks.{layer}.attn", cfg.width
    qkv = torch.cat([state[f"{p}.qkv.w"], state[f"{p}.qkv.b"][:, None]], 1)
    q, k, v = qkv.reshape(3, cfg.heads, cfg.head_dim, d + 1)
    proj = state[f"{p}.proj.w"].reshape(d, cfg.heads, cfg.head_dim)
    return (torch.stack([q[h].T @ k[h] for h in range(cfg.heads)]),
            torch.stack([proj[:, h] @ v[h] for h in range(cfg.heads)]))


@pytest.mark.parametrize("name", FUSED)
def test_an_end_of_the_path_keeps_its_function(name):
    """Weights (0, 1) give B back as the function it is (its heads refactored in another basis), in float64."""
    cfg = ALL_CONFIGS[name]
    arch = get_arch(cfg.family)
    a, b = (canonicalize(arch, random_native(cfg, s), cfg, dtype=torch.float64) for s in (1, 2))
    end = merge_circuits(mix((a, b), (0.0, 1.0)), (a, b), cfg, (0.0, 1.0))
    assert any(not torch.equal(end[k], b[k]) for k in b)  # the factors were rewritten, not passed through
    x = inputs(cfg)
    with torch.no_grad():
        moved = arch.logits(to_model(end, cfg), x)
    assert (moved - logits_of(random_native(cfg, 2), cfg, x)).abs().max() <= 1e-5


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
        target = [(x + y) / 2 for x, y in zip(*(_circuits(s, cfg, layer) for s in (aligned.a, aligned.b)),
                                               strict=True)]
        for circuit, got, averaged in zip(target, _circuits(merged, cfg, layer), _circuits(plain, cfg, layer),
                                          strict=True):
            assert (got - circuit).norm() < 0.9 * (averaged - circuit).norm(), layer


def test_families_without_fused_heads_are_refused():
    cfg = ALL_CONFIGS["llama-gqa"]
    a = canonicalize(get_arch(cfg.family), random_native(cfg, 1), cfg, dtype=torch.float64)
    with pytest.raises(ConfigError, match=r"needs q\|k\|v fused in thirds .* a llama model does not have"):
        merge_circuits(a, (a, a), cfg)


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
