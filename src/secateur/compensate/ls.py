"""Least-squares / ridge refit of the retained columns (baselines.md Sec. 6; COEC Sec. 3.2).

    W_ridge = G_yx (G_xx + lambda I)^{-1},   G_xx = C[K, K],  G_yx = W0 C[:, K],  C = E[x x^T]

(COEC Sec. 3.2: ``W^LS = G_yx G_xx^{-1}``, ``W^ridge = G_yx (G_xx + lambda_ls I)^{-1}``). lambda_ls is not
given by the paper; the default is ``0.01 * mean(diag(G_xx))`` (SparseGPT-style relative damping,
baselines.md [A]). With ``intercept=True`` the inputs are augmented with a constant 1 and the fitted
intercept is added to the output bias (unpenalized); at lambda -> 0 this equals CORP's MLP compensation
(corp.md K1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from secateur.calib.stats import Gram
from secateur.compensate.base import Compensation, InputStats, finish, prepare
from secateur.errors import SecateurError
from secateur.linalg import solve_spd

__all__ = ["ls_refit"]


def ls_refit(w0: torch.Tensor, stats: InputStats | Gram, kept: torch.Tensor | Sequence[int], *,
             bias: torch.Tensor | None = None, lam: float | None = None, lam_rel: float = 0.01,
             intercept: bool = False) -> Compensation:
    """Ridge refit ``W~ = G_yx (G_xx + lam I)^{-1}`` (COEC Sec. 3.2, baselines.md Sec. 6).

    lam: absolute ridge; default ``lam_rel * mean(diag(G_xx))``. ``lam=0`` gives plain least squares
    (pseudo-inverse fallback when G_xx is singular).
    intercept: also fit an unpenalized output offset ``beta`` (solve over ``[x_K; 1]``) and return
    ``bias + beta`` as the new bias.
    Diagnostics: ``lambda``, ``solve_method``, ``solve_jitter``, ``cond_est``.
    """
    st, k = prepare(w0, stats, kept, bias)
    c = st.second_moment
    w = w0.to(torch.float64)
    cxx = c[k][:, k]
    gyx = w @ c[:, k]
    if lam is None:
        lam = lam_rel * float(cxx.diagonal().mean())
    if lam < 0:
        raise SecateurError(f"ridge lambda must be >= 0, got {lam}")
    n = k.numel()
    diag: dict = {"method": "ls" if lam == 0 else "ridge", "lambda": float(lam), "intercept": intercept}
    if not intercept:
        a = cxx + lam * torch.eye(n, dtype=c.dtype, device=c.device)
        w_new = solve_spd(a, gyx, info=diag)
        return finish(w0, st, k, w_new, None, bias, diag)
    if st.mean is None:
        raise SecateurError("ls_refit(intercept=True) needs the input mean in the statistics")
    mu = st.mean.to(c)
    a = torch.zeros(n + 1, n + 1, dtype=c.dtype, device=c.device)
    a[:n, :n] = cxx + lam * torch.eye(n, dtype=c.dtype, device=c.device)
    a[:n, n] = mu[k]
    a[n, :n] = mu[k]
    a[n, n] = 1.0
    rhs = torch.cat([gyx, (w @ mu)[:, None]], dim=1)
    x = solve_spd(a, rhs, info=diag)
    base = torch.zeros(w.shape[0], dtype=torch.float64, device=w.device) if bias is None else bias.to(w)
    return finish(w0, st, k, x[:, :n], base + x[:, n], bias, diag)
