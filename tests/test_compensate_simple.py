"""Common compensator interface + the simple compensators: slice-only, FLAP bias, LS/ridge, RCPU.

Invariants from baselines.md (B3, B5) and coec.md (C1 via RCPU's formula, C11 Gram path)."""

from __future__ import annotations

import pytest
import torch

from secateur.calib.stats import Gram
from secateur.compensate import COMPENSATORS, InputStats, compensate, flap_bias, ls_refit, rcpu, relative_recon_error
from secateur.errors import SecateurError

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


def make(d_out: int = 24, d_in: int = 40, n: int = 600, seed: int = 0):
    """Correlated, non-centered inputs X [n, d_in], dense weight, bias and a kept set (2/3 of columns)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(d_in, dtype=F64) + 1.5 * torch.randn(d_in, d_in, generator=g, dtype=F64) / d_in**0.5
    x = torch.randn(n, d_in, generator=g, dtype=F64) @ mix + torch.randn(d_in, generator=g, dtype=F64)
    w0 = torch.randn(d_out, d_in, generator=g, dtype=F64)
    b = torch.randn(d_out, generator=g, dtype=F64)
    kept = torch.sort(torch.randperm(d_in, generator=g)[: (2 * d_in) // 3]).values
    return x, w0, b, kept


def brute_err(x, w0, b, kept, w_new, b_new):
    y = x @ w0.T + b
    yh = x[:, kept] @ w_new.T + (b if b_new is None else b_new)
    return float(((y - yh) ** 2).sum(1).mean() / ((x @ w0.T) ** 2).sum(1).mean())


def test_gram_path_matches_samples():
    """C11: streamed Gram == X^T X of the concatenation; errors from statistics == errors on tokens."""
    x, w0, b, kept = make()
    acc = Gram(x.shape[1], compute_dtype=F64)
    for chunk in x.reshape(6, 100, -1).split([1, 2, 3]):
        acc.update(chunk)
    st = InputStats.from_gram(acc)
    ref = InputStats.from_samples(x)
    torch.testing.assert_close(st.second_moment, ref.second_moment)
    torch.testing.assert_close(st.mean, ref.mean)
    assert st.n == 600
    w_new = torch.randn(w0.shape[0], kept.numel(), dtype=F64)
    b_new = b + 0.3
    got = relative_recon_error(w0, st, kept, w_new, b_new - b)
    torch.testing.assert_close(got, brute_err(x, w0, b, kept, w_new, b_new))


@pytest.mark.parametrize("name", sorted(COMPENSATORS))
def test_common_interface_and_no_error_increase(name):
    """Every compensator returns [d_out, |K|] (+ optional [d_out] bias), reports recon errors that
    match a brute-force evaluation on the calibration tokens, and does not raise the error it
    minimizes (slice-only -> equal)."""
    x, w0, b, kept = make()
    st = InputStats.from_samples(x)
    opts = {"coec": {"alpha": 1.0, "max_rounds": 3}}.get(name, {})
    out = compensate(name, w0, st, kept, bias=b, **opts)
    assert out.weight.shape == (w0.shape[0], kept.numel()) and out.weight.dtype == w0.dtype
    assert out.bias is None or out.bias.shape == (w0.shape[0],)
    d = out.diagnostics
    torch.testing.assert_close(d["recon_after"], brute_err(x, w0, b, kept, out.weight, out.bias))
    torch.testing.assert_close(d["recon_before"], brute_err(x, w0, b, kept, w0[:, kept], None))
    assert d["recon_after"] <= d["recon_before"] + 1e-12


def test_flap_bias_keeps_calibration_mean_exact():
    """B3: mean(W_K x_K + b_new) == mean(W0 x + b) on the calibration data, bias-free layers too."""
    x, w0, b, kept = make(seed=1)
    st = InputStats.from_samples(x)
    for bias in (b, None):
        out = flap_bias(w0, st, kept, bias=bias)
        dense = (x @ w0.T + (0 if bias is None else bias)).mean(0)
        comp = (x[:, kept] @ out.weight.T + out.bias).mean(0)
        torch.testing.assert_close(comp, dense, atol=1e-10, rtol=0)
        torch.testing.assert_close(out.weight, w0[:, kept])


def test_flap_bias_needs_mean():
    x, w0, b, kept = make()
    st = InputStats(InputStats.from_samples(x).second_moment)
    with pytest.raises(SecateurError):
        flap_bias(w0, st, kept)


def test_ridge_to_ls_and_closed_form_error():
    """B5: ridge(lambda -> 0) == LS == brute-force least squares on tokens; LS error equals
    ``||Y||^2 - tr(G_yx G_xx^-1 G_yx^T)``; error(LS) <= error(ridge) <= error(slice) for small lambda."""
    x, w0, b, kept = make(seed=2)
    st = InputStats.from_samples(x)
    ls = ls_refit(w0, st, kept, lam=0.0)
    near = ls_refit(w0, st, kept, lam=1e-10)
    brute = torch.linalg.lstsq(x[:, kept], x @ w0.T).solution.T
    torch.testing.assert_close(ls.weight, brute, atol=1e-8, rtol=1e-8)
    torch.testing.assert_close(near.weight, ls.weight, atol=1e-7, rtol=1e-7)
    c = st.second_moment
    gxx, gyx = c[kept][:, kept], w0 @ c[:, kept]
    y = float(((w0 @ c) * w0).sum())
    closed = (y - float(torch.trace(gyx @ torch.linalg.solve(gxx, gyx.T)))) / y
    torch.testing.assert_close(ls.diagnostics["recon_after"], closed)
    ridge = ls_refit(w0, st, kept)  # default lambda = 0.01 mean diag
    torch.testing.assert_close(ridge.diagnostics["lambda"], 0.01 * float(gxx.diagonal().mean()))
    assert ls.diagnostics["recon_after"] <= ridge.diagnostics["recon_after"] <= ridge.diagnostics["recon_before"]


def test_ls_intercept_matches_brute_force():
    x, w0, b, kept = make(seed=3)
    st = InputStats.from_samples(x)
    out = ls_refit(w0, st, kept, bias=b, lam=0.0, intercept=True)
    xa = torch.cat([x[:, kept], torch.ones(x.shape[0], 1, dtype=F64)], 1)
    sol = torch.linalg.lstsq(xa, x @ w0.T).solution.T
    torch.testing.assert_close(out.weight, sol[:, :-1], atol=1e-8, rtol=1e-8)
    torch.testing.assert_close(out.bias, b + sol[:, -1], atol=1e-8, rtol=1e-8)


def test_rcpu_formula_and_geometry():
    """RCPU Rot.+Scale = s* polar(G_yx W_K^T) W_K: an orthogonal left factor times a scalar, so
    W~^T W~ = s*^2 W_K^T W_K; Rot. only preserves the Gram of the columns exactly."""
    x, w0, b, kept = make(d_out=16, d_in=30, seed=4)
    st = InputStats.from_samples(x)
    wk = w0[:, kept]
    c = st.second_moment
    gxx, gyx = c[kept][:, kept], w0 @ c[:, kept]
    u, _, vh = torch.linalg.svd(gyx @ wk.T)
    q = u @ vh
    s = float((gyx * (q @ wk)).sum() / (((q @ wk) @ gxx) * (q @ wk)).sum())
    out = rcpu(w0, st, kept)
    torch.testing.assert_close(out.weight, s * q @ wk)
    torch.testing.assert_close(out.diagnostics["scale"], s)
    rot = rcpu(w0, st, kept, scale=False)
    torch.testing.assert_close(rot.weight.T @ rot.weight, wk.T @ wk)
    assert out.diagnostics["recon_after"] <= rot.diagnostics["recon_after"] <= rot.diagnostics["recon_before"]


def test_dense_kept_set_is_fixed_point():
    """K = all columns: LS, RCPU and FLAP leave the dense layer unchanged (coec.md C2 for RCPU)."""
    x, w0, b, _ = make(d_out=12, d_in=20, seed=5)
    st = InputStats.from_samples(x)
    allk = torch.arange(20)
    torch.testing.assert_close(ls_refit(w0, st, allk, lam=0.0).weight, w0)
    torch.testing.assert_close(rcpu(w0, st, allk).weight, w0)
    fb = flap_bias(w0, st, allk, bias=b)
    torch.testing.assert_close(fb.bias, b)


def test_input_validation():
    x, w0, b, kept = make()
    st = InputStats.from_samples(x)
    with pytest.raises(SecateurError):
        compensate("nope", w0, st, kept)
    with pytest.raises(SecateurError):
        rcpu(w0, st, [0, 0, 1])
    with pytest.raises(SecateurError):
        rcpu(w0, st, [w0.shape[1]])
    with pytest.raises(SecateurError):
        rcpu(w0, st, [])
    with pytest.raises(SecateurError):
        rcpu(w0[:, :-1], st, kept)
    with pytest.raises(SecateurError):
        ls_refit(w0, st, kept, lam=-1.0)
