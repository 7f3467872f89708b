"""The symmetry groups' elements: random draws for tests, and nearest-element projections for matching.

The residual group of a standard LayerNorm model is {Q orthogonal : Q·1 = 1} ≅ O(d−1);
the rmsnorm form has the whole O(d); a post-LayerNorm model (BERT), whose norms sit on the stream itself and cannot
fold, has its permutations only (:data:`ResidualGroup`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Literal, TypeVar, get_args

import torch
from scipy.optimize import linear_sum_assignment

from glmc.device import release_heap

T = TypeVar("T")
R = TypeVar("R")

# The residual stream's group: the orthogonal maps fixing the ones vector (a folded LayerNorm), all of O(d) (an
# RMSNorm, or a centred stream), or the permutations (a LayerNorm on the stream itself, whose gain and bias move with
# it). A bool is read as the first two (``fix_ones``), as callers before the third passed it.
ResidualGroup = Literal["fix-ones", "orthogonal", "permutation"]
RESIDUAL_GROUPS: tuple[ResidualGroup, ...] = get_args(ResidualGroup)


def residual_group(group: bool | ResidualGroup) -> ResidualGroup:
    """The group named by ``group``: True → ``fix-ones``, False → ``orthogonal``, a name as it is."""
    if isinstance(group, bool):
        return "fix-ones" if group else "orthogonal"
    if group not in RESIDUAL_GROUPS:
        raise ValueError(f"unknown residual group {group!r}; known: {', '.join(RESIDUAL_GROUPS)}")
    return group


def ones_complement(d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(d, d−1) orthonormal basis B⊥ of the complement of the all-ones vector (a fresh copy of a cached basis)."""
    return _ones_complement(d).to(dtype, copy=True)


@functools.cache
def _ones_complement(d: int) -> torch.Tensor:
    """B⊥ in float64, computed once per width: every residual Procrustes step of a matching needs it."""
    basis = torch.eye(d, dtype=torch.float64)
    basis[:, 0] = 1.0
    q, _ = torch.linalg.qr(basis)
    return q[:, 1:]


def lift_fixing_ones(r: torch.Tensor) -> torch.Tensor:
    """Q = 11ᵀ/d + B⊥ R B⊥ᵀ: the (d, d) map that fixes 1 and acts as R on its complement."""
    d = r.shape[0] + 1
    b = ones_complement(d, r.dtype).to(r.device)
    return torch.full((d, d), 1.0 / d, dtype=r.dtype, device=r.device) + b @ r @ b.T


def random_residual(d: int, generator: torch.Generator, group: bool | ResidualGroup = True) -> torch.Tensor:
    """A random (d, d) element of the residual group: Haar-orthogonal (fixing 1 or not), or a permutation matrix."""
    if residual_group(group) == "permutation":
        return torch.eye(d, dtype=torch.float64)[random_permutation(d, generator)]
    return random_orthogonal(d, generator, residual_group(group) == "fix-ones")


def random_orthogonal(d: int, generator: torch.Generator, fix_ones: bool = True) -> torch.Tensor:
    """A Haar-random orthogonal (d, d) matrix, restricted to Q·1 = 1 when ``fix_ones``."""
    n = d - 1 if fix_ones else d
    q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    return lift_fixing_ones(q) if fix_ones else q


def random_invertible(n: int, generator: torch.Generator) -> torch.Tensor:
    """A well-conditioned random invertible (n, n) matrix, I + small noise."""
    noise = torch.randn(n, n, generator=generator, dtype=torch.float64)
    return torch.eye(n, dtype=torch.float64) + 0.3 * noise / n**0.5


def random_permutation(n: int, generator: torch.Generator) -> torch.Tensor:
    """A uniformly random permutation as a (n,) long tensor."""
    return torch.randperm(n, generator=generator)


@contextlib.contextmanager
def one_thread(x: torch.Tensor) -> Iterator[None]:
    """Run CPU work on ``x`` on one torch thread. MKL's threaded SVD of the matrices weight matching factors (up
    to d × d) gains little on an idle machine and is many times slower when other jobs share the cores (measured
    on 2 shared cores: a (2, 12, 64, 64) batch 0.02 s on one thread, 0.13-0.65 s on two)."""
    if x.device.type != "cpu":
        yield
        return
    with _one_torch_thread():
        yield


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """One torch thread inside, the count before restored after."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def side_by_side(work: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[work(item) for item in items]``, as many at once as torch has threads, each on one thread: independent
    pieces (a layer's assignments, a group's SVD) use the cores without the threaded SVD's cost under load
    (:func:`one_thread`). With tensors on a GPU the CPU's share (scipy's assignments, :func:`polar`'s SVDs) still
    runs side by side while the GPU queues the rest. ``work`` must not touch what another item's work writes."""
    workers = min(torch.get_num_threads(), len(items))
    if workers <= 1:
        return [work(item) for item in items]
    with _one_torch_thread(), concurrent.futures.ThreadPoolExecutor(workers) as pool:
        done = list(pool.map(work, items))
    release_heap()  # what the workers freed stays in their own heaps (glibc's per-thread arenas), unused by others
    return done


# On a GPU, matrices up to this size are factored on the CPU, where LAPACK beats cuSOLVER's per-call cost. Chosen
# before measuring: on one H200 (float64) LAPACK won only for single matrices up to ~128 (127²: 2.6 against 3.8 ms)
# and lost on batches of small ones (12 × 32²: 2.4 against 0.5 ms); the accelerator rows ran with this value.
CPU_SVD_MAX = 512


def polar(m: torch.Tensor) -> torch.Tensor:
    """The orthogonal factor U Vᵀ of M's SVD: argmax_Q ⟨M, Q⟩ over O(n). Differentiable (through the copies
    too, where a small matrix on a GPU is factored on the CPU: :data:`CPU_SVD_MAX`)."""
    if m.device.type != "cpu" and m.shape[-1] <= CPU_SVD_MAX:
        return polar(m.cpu()).to(m.device)
    with one_thread(m):
        u, _, vh = torch.linalg.svd(m)
    return u @ vh


def inverse(m: torch.Tensor) -> torch.Tensor:
    """M⁻¹ per matrix of a batch (..., n, n), on one CPU thread: MKL's threaded batched LU in torch 2.14 fails on two
    threads ("Parameter 6 was incorrect on entry to DLASWP", then a RuntimeError) for batches of 512² matrices, and
    at times of 256² ones; one thread factors them all. A singular matrix gives non-finite entries."""
    with one_thread(m):
        return torch.linalg.inv_ex(m).inverse


def procrustes(m: torch.Tensor, group: bool | ResidualGroup) -> torch.Tensor:
    """argmax_Q ⟨M, Q⟩ over the residual group: O(d) (False), {Q·1 = 1} by solving on the complement of 1 (True),
    or the permutation matrices by a linear assignment (``permutation``; differentiable nowhere, as an assignment is
    not: a learned path takes it straight through)."""
    kind = residual_group(group)
    if kind == "permutation":
        return torch.eye(m.shape[0], dtype=m.dtype, device=m.device)[assignment(m).to(m.device)]
    if kind == "orthogonal":
        return polar(m)
    b = ones_complement(m.shape[0], m.dtype).to(m.device)
    return lift_fixing_ones(polar(b.T @ m @ b))


def assignment(score: torch.Tensor) -> torch.Tensor:
    """The permutation p maximising Σ_i score[i, p[i]] (Hungarian, scipy), as a (n,) long tensor."""
    rows, cols = linear_sum_assignment(score.detach().cpu().double().numpy(), maximize=True)
    perm = torch.empty(len(rows), dtype=torch.long)
    perm[torch.as_tensor(rows)] = torch.as_tensor(cols)
    return perm


def rotary_halves(rotary: int) -> tuple[slice, slice]:
    """The two halves of a head's first ``rotary`` dimensions that rotary positions pair up: dimension i with
    i + rotary/2 (Hugging Face's ``rotate_half``, in Llama, Mistral, Qwen2 and GPT-NeoX alike)."""
    half = rotary // 2
    return slice(0, half), slice(half, 2 * half)


def random_rotary(head_dim: int, rotary: int, generator: torch.Generator, orthogonal: bool) -> torch.Tensor:
    """A random (d_h, d_h) map that commutes with every rotary position: on each rotated pair a rotation (times a
    positive scale unless ``orthogonal``), on the dimensions left alone any orthogonal (or invertible) map."""
    first, second = rotary_halves(rotary)
    half = rotary // 2
    angle = 2 * torch.pi * torch.rand(half, generator=generator, dtype=torch.float64)
    scale = torch.ones(half, dtype=torch.float64) if orthogonal else torch.exp(
        0.3 * torch.randn(half, generator=generator, dtype=torch.float64))
    m = torch.zeros(head_dim, head_dim, dtype=torch.float64)
    m[first, first] = m[second, second] = torch.diag(scale * torch.cos(angle))
    m[second, first], m[first, second] = torch.diag(scale * torch.sin(angle)), torch.diag(-scale * torch.sin(angle))
    rest = head_dim - rotary
    if rest:
        m[rotary:, rotary:] = (random_orthogonal(rest, generator, fix_ones=False) if orthogonal
                               else random_invertible(rest, generator))
    return m


def rotary_polar(m: torch.Tensor, rotary: int) -> torch.Tensor:
    """argmax_R ⟨M, R⟩ over the orthogonal maps that commute with rotary positions on the first ``rotary``
    dimensions, batched over leading axes: per rotated pair the rotation of angle atan2(M_ba − M_ab, M_aa + M_bb),
    on the other dimensions the polar factor (:func:`polar` when ``rotary`` is 0)."""
    if rotary == 0:
        return polar(m)
    first, second = rotary_halves(rotary)
    diag = functools.partial(torch.diagonal, dim1=-2, dim2=-1)
    angle = torch.atan2(diag(m[..., second, first]) - diag(m[..., first, second]),
                        diag(m[..., first, first]) + diag(m[..., second, second]))
    out = torch.zeros_like(m)
    cos, sin = torch.diag_embed(torch.cos(angle)), torch.diag_embed(torch.sin(angle))
    out[..., first, first], out[..., second, second] = cos, cos
    out[..., second, first], out[..., first, second] = sin, -sin
    if rotary < m.shape[-1]:
        out[..., rotary:, rotary:] = polar(m[..., rotary:, rotary:])
    return out
