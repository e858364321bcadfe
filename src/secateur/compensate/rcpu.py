"""RCPU compensation (Haruta et al. 2026): left (output-space) rotation + optional global scale.

coec.md Sec. 9 / COEC Sec. 4.1:

    Z = W_K X_K,  M = Y Z^T = G_yx W_K^T,  Q* = polar(M) = U_M V_M^T       ("Rot.")
    s* = <G_yx, Q* W_K> / <Q* W_K, Q* W_K G_xx>,  W~ = s* Q* W_K             ("Rot.+Scale", default)

with ``<A, B> = tr(A B^T)``, ``G_xx = C[K, K]``, ``G_yx = W0 C[:, K]``. Q* is the orthogonal Procrustes
minimizer of ``||Y - Q W_K X_K||_F`` over O(d_out) (reflections allowed); s* is the exact minimizer along
the ray ``s Q* W_K`` and is applied only when its denominator is positive (COEC App. B safeguard).
This is COEC with only the left block (invariant C1), which the tests check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from secateur.calib.stats import Gram
from secateur.compensate.base import Compensation, InputStats, finish, prepare
from secateur.linalg import det_sum, polar

__all__ = ["rcpu", "procrustes_left", "global_scale"]


def procrustes_left(gyx: torch.Tensor, w: torch.Tensor, *, info: dict[str, Any] | None = None) -> torch.Tensor:
    """``Q_l = polar(G_yx W^T)`` (``d_out x d_out``): argmin over O(d_out) of
    ``tr(Q W G_xx W^T Q^T) - 2 tr(Q W G_yx^T)`` (the first term is Q-invariant)."""
    return polar(gyx @ w.mT, info=info)


def global_scale(gyx: torch.Tensor, gxx: torch.Tensor, w: torch.Tensor) -> tuple[float, bool]:
    """``s* = <G_yx, W> / <W, W G_xx>`` (COEC Sec. 4.1). Returns ``(s*, ok)``; ``ok`` is False (and
    s* = 1) when the denominator is not positive (indefinite or zero energy, COEC App. B). ``gxx`` is dense
    ``[k, k]`` or diagonal, given as its 1-D eigenvalues (COEC works in the Gram's eigenbasis)."""
    num = float(det_sum(gyx * w))
    den = float(det_sum((w * gxx if gxx.dim() == 1 else w @ gxx) * w))
    if not den > 0:
        return 1.0, False
    return num / den, True


def rcpu(w0: torch.Tensor, stats: InputStats | Gram, kept: torch.Tensor | Sequence[int], *,
         bias: torch.Tensor | None = None, scale: bool = True) -> Compensation:
    """RCPU Rot.+Scale (``scale=True``, what COEC calls "full RCPU compensation", coec.md [A4]) or
    Rot. only. Bias unchanged. Diagnostics: ``scale`` (applied s*), ``scale_ok``."""
    st, k = prepare(w0, stats, kept, bias)
    c = st.second_moment
    w = w0.to(torch.float64)
    gxx = c[k][:, k]
    gyx = w @ c[:, k]
    diag: dict[str, Any] = {"method": "rcpu" if scale else "rcpu_rot"}
    wk = procrustes_left(gyx, w[:, k], info=diag) @ w[:, k]
    s, ok = global_scale(gyx, gxx, wk) if scale else (1.0, False)
    diag.update(scale=s, scale_ok=ok)
    return finish(w0, st, k, s * wk, None, bias, diag)
