"""Weight matching's reused products: the fixed tensors' distance, the assignment shortcut and its certificate,
each against a direct computation (scipy's solver, the distance of rotated tensors)."""

from __future__ import annotations

import pytest
import torch
from scipy.optimize import linear_sum_assignment

from glmc.archs import get_arch
from glmc.match.common import sq_distance
from glmc.match.descent import Certificate, Descent, certified_assignment, signed_assignment
from glmc.symmetry import groups
from glmc.symmetry.transforms import MATCHABLE, Transform, apply, random_transform
from tests.symmetry_models import CONFIGS, canonical


def scipy_perm(cost: torch.Tensor) -> torch.Tensor:
    rows, cols = linear_sum_assignment(cost.double().numpy(), maximize=True)
    return torch.as_tensor(cols)[torch.argsort(torch.as_tensor(rows))]


def test_a_row_dominant_cost_is_assigned_without_the_solver_and_as_scipy_does():
    g = torch.Generator().manual_seed(0)
    p = torch.randperm(40, generator=g)
    cost = torch.randn(40, 40, generator=g, dtype=torch.float64)
    cost[torch.arange(40), p] += 10.0  # every row's best column distinct: the shortcut's case
    perm, margin = certified_assignment(cost)
    assert margin is not None and bool((margin > 0).all())
    assert torch.equal(perm, p) and torch.equal(perm, scipy_perm(cost))
    noisy = torch.randn(40, 40, generator=g, dtype=torch.float64)  # rows' maxima collide: scipy decides
    perm, margin = certified_assignment(noisy)
    assert margin is None and torch.equal(perm, scipy_perm(noisy))


def test_the_certificate_holds_only_where_the_solver_agrees():
    """K(Q) = X_A Q X_Bᵀ, linear in Q: wherever the certificate from Q₀ holds at Q, scipy's optimum at Q is its
    permutation; a large move of Q voids it."""
    g = torch.Generator().manual_seed(1)
    d, n = 64, 30
    xb = torch.randn(n, d, generator=g, dtype=torch.float64)
    p = torch.randperm(n, generator=g)
    q0 = groups.random_orthogonal(d, g, fix_ones=False)
    xa = (xb @ q0.T)[p] + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64)  # A ≈ P Q₀(B), rows as units
    perm, margin = certified_assignment(xa @ q0 @ xb.T)
    assert margin is not None and torch.equal(perm, p)
    cert = Certificate(q0, perm, margin, xa.norm(dim=1), float(xb.norm(dim=1).max()))
    held = 0
    for scale in (1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 1.0):
        q = groups.polar(q0 + scale * torch.randn(d, d, generator=g, dtype=torch.float64))
        if cert.holds(q):
            held += 1
            assert torch.equal(scipy_perm(xa @ q @ xb.T), perm)
    assert held >= 2 and not cert.holds(groups.random_orthogonal(d, g, fix_ones=False))


def test_a_signed_certificate_holds_only_where_the_solver_and_the_signs_agree():
    """Gated units as gate rows and up-and-down rows, B's up-and-down rows flipped on some units: the signed
    assignment finds the permutation and the flips, and wherever its certificate from Q₀ holds at Q, scipy's optimum
    of gate + |updown| at Q is its permutation and updown's signs there are its signs."""
    g = torch.Generator().manual_seed(2)
    d, n = 64, 30
    gb, ub = (torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(2))
    p, q0 = torch.randperm(n, generator=g), groups.random_orthogonal(d, g, fix_ones=False)
    flips = torch.where(torch.rand(n, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0).to(torch.float64)
    ga, ua = ((x @ q0.T)[p] * s[:, None] + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64)
              for x, s in ((gb, torch.ones(n, dtype=torch.float64)), (ub, flips)))

    def costs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ga @ q @ gb.T, ua @ q @ ub.T

    perm, signs, margin = signed_assignment(*costs(q0))
    assert margin is not None and torch.equal(perm, p) and torch.equal(signs, flips)
    rows = torch.cat([ga, ua], 1).norm(dim=1)
    cert = Certificate(q0, perm, margin, rows, float(torch.cat([gb, ub], 1).norm(dim=1).max()), signs)
    held = 0
    for scale in (1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 1.0):
        q = groups.polar(q0 + scale * torch.randn(d, d, generator=g, dtype=torch.float64))
        if cert.holds(q):
            held += 1
            gate, updown = costs(q)
            assert torch.equal(scipy_perm(gate + updown.abs()), perm)
            assert torch.equal(torch.sign(updown[torch.arange(n), perm]), signs)
    assert held >= 2 and not cert.holds(groups.random_orthogonal(d, g, fix_ones=False))


@pytest.mark.parametrize("name", ["vit-odd", "gpt2-odd"])
def test_the_fixed_tensors_distance_is_that_of_the_rotated_tensors(name):
    cfg = CONFIGS[name]
    arch = get_arch(cfg.family)
    a, b = canonical(cfg, 1), canonical(cfg, 2)
    work = Descent(a, b, arch.spec, cfg.depth, cfg.heads)
    q = random_transform(cfg, MATCHABLE, torch.Generator().manual_seed(3)).residual
    fixed = {n: a[n] for n in work.fixed_names}
    moved = apply({n: b[n] for n in work.fixed_names}, arch.spec, Transform(cfg.depth, residual=q), cfg.heads)
    assert work.fixed_distance(q) == pytest.approx(sq_distance(fixed, moved), rel=1e-12)
    assert work.fixed_distance(None) == pytest.approx(sq_distance(fixed, {n: b[n] for n in fixed}), rel=1e-12)
    assert work.fixed_distance(q.float()) == pytest.approx(sq_distance(fixed, moved), rel=1e-6)  # Q float32


def test_a_batch_of_maps_inverts_on_two_threads() -> None:
    """torch 2.14's threaded batched LU fails on 2 × 512² at two threads; groups.inverse factors on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        m = torch.linalg.qr(torch.randn(2, 512, 512, generator=torch.Generator().manual_seed(0)))[0]
        assert float((groups.inverse(m) @ m - torch.eye(512)).abs().max()) <= 1e-4
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
