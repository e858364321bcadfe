"""secateur.linalg: SVD fallback chain, polar / Newton-Schulz, retractions, PSD power, SPD solves."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from secateur import linalg
from secateur.linalg import (
    cayley_retract,
    gram_polar,
    newton_schulz_inverse,
    newton_schulz_polar,
    polar,
    polar_retract,
    psd_power,
    safe_svd,
    solve_spd,
    sym,
)

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed), dtype=F64)


def rand_orth(n: int, seed: int) -> torch.Tensor:
    q, r = torch.linalg.qr(rand(n, n, seed=seed))
    return q * torch.sign(torch.diagonal(r))


def stiefel(b: int, k: int, seed: int) -> torch.Tensor:
    return rand_orth(k, seed)[:b]


def tangent(r: torch.Tensor, seed: int) -> torch.Tensor:
    e = rand(*r.shape, seed=seed)
    return e - sym(e @ r.mT) @ r


@pytest.mark.parametrize("shape", [(20, 12), (12, 20), (16, 16)])
def test_safe_svd_default(shape):
    a = rand(*shape, seed=1)
    info: dict = {}
    u, s, vh = safe_svd(a, info=info)
    assert info["svd_driver"] == "default"
    torch.testing.assert_close(u * s @ vh, a)
    assert bool((s[:-1] >= s[1:]).all())


def test_safe_svd_falls_back_to_cpu_float64(monkeypatch):
    a = rand(10, 7, seed=2)
    real = torch.linalg.svd
    calls = {"n": 0}

    def flaky(x, *args, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.linalg.LinAlgError("simulated gesdd failure")
        return real(x, *args, **kw)

    monkeypatch.setattr(torch.linalg, "svd", flaky)
    info: dict = {}
    u, s, vh = safe_svd(a, info=info)
    assert info["svd_driver"] == "cpu_float64" and info["svd_errors"]
    torch.testing.assert_close(u * s @ vh, a)


@pytest.mark.parametrize("shape,full", [((10, 7), False), ((7, 10), False), ((10, 7), True)])
def test_safe_svd_last_resort_eigh(monkeypatch, shape, full):
    """When every LAPACK SVD fails (raises or returns NaN), the eigh-based SVD still decomposes."""
    a = rand(*shape, seed=3)
    a[:, 0] = 0.0  # rank deficient: exercises the completion of the null directions

    def broken(x, *args, **kw):
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(torch.linalg, "svd", broken)
    info: dict = {}
    u, s, vh = safe_svd(a, full_matrices=full, info=info)
    assert info["svd_driver"] == "eigh_float64"
    k = min(shape)
    torch.testing.assert_close(u[:, :k] * s @ vh[:k], a, atol=1e-9, rtol=0)
    torch.testing.assert_close(u.mT @ u, torch.eye(u.shape[1], dtype=F64), atol=1e-9, rtol=0)
    torch.testing.assert_close(vh @ vh.mT, torch.eye(vh.shape[0], dtype=F64), atol=1e-9, rtol=0)


def test_safe_svd_rejects_nan():
    a = rand(4, 4)
    a[0, 0] = float("nan")
    with pytest.raises(ValueError):
        safe_svd(a)


@pytest.mark.parametrize("n,rank", [(12, 12), (12, 5)])
def test_polar_is_procrustes_maximizer(n, rank):
    a = rand(n, rank, seed=4) @ rand(rank, n, seed=5)
    q = polar(a)
    torch.testing.assert_close(q @ q.mT, torch.eye(n, dtype=F64))
    best = float(torch.trace(q.mT @ a))
    for seed in range(50):
        assert float(torch.trace(rand_orth(n, 100 + seed).mT @ a)) <= best + 1e-10
    torch.testing.assert_close(best, float(torch.linalg.svdvals(a).sum()))


def test_newton_schulz_polar_matches_svd():
    z = rand(6, 15, seed=6)
    u, _, vh = torch.linalg.svd(z, full_matrices=False)
    info: dict = {}
    p = newton_schulz_polar(z, info=info)
    torch.testing.assert_close(p, u @ vh, atol=1e-10, rtol=0)
    assert info["ns_polar_err"] < 1e-12
    torch.testing.assert_close(newton_schulz_polar(z.mT), (u @ vh).mT, atol=1e-10, rtol=0)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 24), extra=st.integers(0, 40), norm=st.floats(0.0, 1.0), seed=st.integers(0, 10**6))
def test_gram_polar_is_the_polar_factor_of_a_retraction_step(b, extra, norm, seed):
    """``polar(R - step)`` for row-orthonormal R and a tangent step with ||step||_F <= 1 (the COEC step cap): the Gram
    route equals the SVD's ``U V^T``. Error argument: ``Z Z^T`` has eigenvalues in [1, 2], so a backward-stable eigh
    and two products leave an error of a few ``sqrt(b) eps`` (bound 1e-12 at these sizes, ~100x eps*sqrt(b))."""
    k = b + extra
    g = torch.Generator().manual_seed(seed)
    r = torch.linalg.qr(torch.randn(k, b, generator=g, dtype=F64)).Q.mT  # b x k, orthonormal rows
    e = torch.randn(b, k, generator=g, dtype=F64)
    step = e - 0.5 * (e @ r.mT + r @ e.mT) @ r  # tangent: step R^T is skew
    n = float(step.norm())
    step = step * (norm / n) if n > 0 else step
    z = r - step
    u, _, vh = torch.linalg.svd(z, full_matrices=False)
    info: dict = {}
    q = gram_polar(z, info=info)
    torch.testing.assert_close(q, u @ vh, atol=1e-12, rtol=0)
    assert info["polar_err"] < 1e-12 and info["polar_cond"] <= 2 + 1e-9
    torch.testing.assert_close(polar_retract(r, step), q, atol=0, rtol=0)  # the retraction takes this route
    torch.testing.assert_close(gram_polar(z.mT), q.mT, atol=1e-12, rtol=0)  # tall input: the transpose's factor


def test_newton_schulz_inverse():
    b = torch.eye(9, dtype=F64) + 0.3 * rand(9, 9, seed=7)
    info: dict = {}
    x = newton_schulz_inverse(b, info=info)
    torch.testing.assert_close(x @ b, torch.eye(9, dtype=F64), atol=1e-11, rtol=0)
    assert not info["ns_inv_fallback"]
    x32 = newton_schulz_inverse(b, dtype=torch.float32)
    assert x32.dtype == F64
    torch.testing.assert_close(x32 @ b, torch.eye(9, dtype=F64), atol=1e-4, rtol=0)


@pytest.mark.parametrize("b,k,kind", [(5, 12, "polar"), (12, 12, "cayley"), (5, 12, "cayley"), (12, 12, "polar")])
def test_retractions_stay_on_stiefel_and_move_along_minus_gamma(b, k, kind):
    r = stiefel(b, k, seed=8)
    gam = tangent(r, seed=9)
    gam = gam / gam.norm()
    torch.testing.assert_close(sym(gam @ r.mT), torch.zeros(b, b, dtype=F64), atol=1e-12, rtol=0)
    errs = []
    for tau in (1e-2, 5e-3):
        rn = polar_retract(r, tau * gam) if kind == "polar" else cayley_retract(r, gam, tau)
        assert float((rn @ rn.mT - torch.eye(b, dtype=F64)).norm()) < 1e-10
        errs.append(float((rn - (r - tau * gam)).norm()))
    # first-order agreement with R - tau Gamma (error O(tau^2): halving tau quarters the error);
    # the right-acting Cayley form for b < k moves Gamma's normal part at half speed, so skip it there
    if not (kind == "cayley" and b < k):
        assert errs[1] < errs[0] / 3


def test_psd_power():
    x = rand(50, 8, seed=10)
    g = x.mT @ x
    torch.testing.assert_close(psd_power(g, 1.0), g)
    ga = psd_power(g, 0.5)
    assert float(torch.linalg.eigvalsh(ga).min()) > -1e-10
    torch.testing.assert_close(ga @ ga, g, atol=1e-9, rtol=1e-9)
    # (G^a)^(1/a) = G for PSD G (coec.md C10), also with a singular G (eigenvalue clamp)
    gs = rand(8, 3, seed=11)
    gs = gs @ gs.mT
    info: dict = {}
    g3 = psd_power(gs, 0.3, info=info)
    torch.testing.assert_close(psd_power(g3, 1 / 0.3), gs, atol=1e-8, rtol=1e-8)
    assert float(torch.linalg.eigvalsh(g3).min()) > -1e-10


def test_solve_spd_paths():
    x = rand(40, 6, seed=12)
    a = x.mT @ x
    rhs = rand(3, 6, seed=13)
    info: dict = {}
    sol = solve_spd(a, rhs, info=info)
    assert info["solve_method"] == "cholesky" and info["cond_est"] >= 1
    torch.testing.assert_close(sol @ a, rhs)
    left = solve_spd(a, rhs.mT, side="left")
    torch.testing.assert_close(a @ left, rhs.mT)
    # singular PSD: Cholesky fails -> jitter or least squares, and the normal equations still hold
    a_sing = a.clone()
    a_sing[:, 0] = 0
    a_sing[0, :] = 0
    rhs_in_range = rand(3, 6, seed=14) @ a_sing
    info2: dict = {}
    sol2 = solve_spd(a_sing, rhs_in_range, info=info2)
    assert info2["solve_method"] in ("cholesky_jitter", "lstsq")
    torch.testing.assert_close(sol2 @ a_sing, rhs_in_range, atol=1e-6, rtol=1e-6)


def test_solve_spd_lstsq_fallback(monkeypatch):
    a = torch.zeros(4, 4, dtype=F64)
    monkeypatch.setattr(linalg.torch.linalg, "cholesky_ex",
                        lambda m: (m, torch.tensor(1)))
    info: dict = {}
    sol = solve_spd(a + torch.eye(4, dtype=F64), torch.ones(2, 4, dtype=F64), info=info)
    assert info["solve_method"] == "lstsq"
    torch.testing.assert_close(sol, torch.ones(2, 4, dtype=F64))


def test_cayley_newton_schulz_start_is_tight():
    """With the skew bound sigma_max(I + tau/2 A)^2 <= 1 + (tau/2)^2 ||A||_F^2 the Newton-Schulz inverse
    inside the Cayley retraction converges in a few quadratic steps (||tau Gamma||_F <= 1)."""
    r = stiefel(30, 30, seed=15)
    gam = tangent(r, seed=16)
    tau = 1.0 / float(gam.norm())
    info: dict = {}
    rn = cayley_retract(r, gam, tau, info=info)
    assert not info["ns_inv_fallback"] and info["ns_inv_iters"] <= 7
    assert float((rn @ rn.mT - torch.eye(30, dtype=F64)).norm()) < 1e-12


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(d=st.integers(1, 3 * linalg.TRI_LEAF + 7), cond_exp=st.integers(0, 8), seed=st.integers(0, 2**31 - 1))
def test_chol_inverse_upper_matches_the_factor_of_the_inverse(d, cond_exp, seed):
    """``chol_inverse_upper(H)`` is the upper Cholesky factor of ``H^-1``: upper triangular, positive diagonal, and
    equal to ``chol(cholesky_inverse(chol(H)), upper)`` within their joint error bound. Sizes straddle the recursion's
    leaf (``TRI_LEAF``) and odd splits; condition numbers up to 1e8. Bound: both are backward stable, so each
    factor is within ~``d eps kappa(H)`` of the exact one relative to its norm (Cholesky's perturbation bound, with
    backward errors of order ``d eps``); the test allows 50x that, and would see any wrong block at O(1)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    ev = torch.logspace(0, -cond_exp, d, dtype=torch.float64)
    h = (q * ev) @ q.T
    h = 0.5 * (h + h.T)
    u = linalg.chol_inverse_upper(h)
    ref = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    assert torch.equal(u, torch.triu(u)) and bool((torch.diag(u) > 0).all())
    kappa = float(ev.max() / ev.min())
    bound = 50 * d * torch.finfo(torch.float64).eps * kappa
    assert float((u - ref).abs().max() / ref.abs().max()) <= bound
    # and it is what SparseGPT needs: U^T U H = I, to the same order
    eye = torch.eye(d, dtype=torch.float64)
    assert float((u.T @ u @ h - eye).abs().max()) <= bound


def test_chol_inverse_upper_refuses_an_indefinite_matrix():
    h = torch.diag(torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64))
    with pytest.raises(torch.linalg.LinAlgError):
        linalg.chol_inverse_upper(h)
