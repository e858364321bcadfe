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
from secateur.compensate.base import Compensation, InputStats, ReconError, finish, prepare
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
    recon = ReconError(w0, st)  # W0 C: G_yx is its kept columns, and the diagnostics reuse it
    w = recon.w
    gyx = recon.w0c[:, k]
    n = k.numel()
    if intercept and st.mean is None:
        raise SecateurError("ls_refit(intercept=True) needs the input mean in the statistics")
    a = torch.zeros(n + int(intercept), n + int(intercept), dtype=c.dtype, device=c.device)
    a[:n, :n] = c[k[:, None], k]  # G_xx, built in place (no d x k intermediate, no identity)
    if lam is None:
        lam = lam_rel * float(a.diagonal()[:n].mean())
    if lam < 0:
        raise SecateurError(f"ridge lambda must be >= 0, got {lam}")
    a.diagonal()[:n] += lam
    diag: dict = {"method": "ls" if lam == 0 else "ridge", "lambda": float(lam), "intercept": intercept}
    if not intercept:
        w_new = solve_spd(a, gyx, info=diag)
        return finish(w0, st, k, w_new, None, bias, diag, recon=recon)
    mu = st.mean.to(c)
    a[:n, n] = mu[k]
    a[n, :n] = mu[k]
    a[n, n] = 1.0
    rhs = torch.cat([gyx, (w @ mu)[:, None]], dim=1)
    x = solve_spd(a, rhs, info=diag)
    base = torch.zeros(w.shape[0], dtype=torch.float64, device=w.device) if bias is None else bias.to(w)
    return finish(w0, st, k, x[:, :n], base + x[:, n], bias, diag, recon=recon)
