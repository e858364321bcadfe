"""COEC's right rotation (COEC Sec. 4.1-4.2, App. B; coec.md Sec. 4.5): projected gradient on the reduced Stiefel
manifold St(b, k), polar retraction for rectangular frames (the polar factor from the b x b Gram's
eigendecomposition, :func:`secateur.linalg.gram_polar`), Cayley with a Newton-Schulz inverse for square ones,
Q_r = I start, step eta / s^2 capped so that ||step * grad||_F <= 1, the scale recomputed after every step; per row
slice of the iterate (slice_rows) or on the full matrix."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from secateur.compensate.coec_align import Alignment
from secateur.compensate.coec_gcv import gmul
from secateur.linalg import (
    cayley_retract,
    det_norm,
    det_sum,
    eps_of,
    newton_schulz_polar,
    one_thread,
    polar_retract,
    sym,
)


@dataclass
class _StiefelObjective:
    """``F(R)`` of :func:`reduced_stiefel_solve` (its docstring) and its Euclidean gradient. ``a_sq``: the
    diagonal of ``A^T A`` when A has orthogonal columns, else ``ata`` = ``A^T A``; ``align`` None = no alignment
    term."""

    atg: torch.Tensor
    gxx: torch.Tensor
    a_sq: torch.Tensor | None
    ata: torch.Tensor | None
    ynorm: float
    y_c: float
    update_scale: bool
    align: Alignment | None
    lam_a: float
    frame: torch.Tensor | None

    def apply_ata(self, r: torch.Tensor) -> torch.Tensor:
        return self.a_sq[:, None] * r if self.a_sq is not None else self.ata @ r

    def terms(self, r: torch.Tensor, s_prev: float) -> tuple[float, float, torch.Tensor]:
        """``(F(R), s(R), R G_xx)``; ``s`` stays ``s_prev`` when the quadratic term is not positive."""
        rg = gmul(r, self.gxx)
        quad = float(det_sum(self.apply_ata(r) * rg))
        lin = float(det_sum(self.atg * r))
        s = (lin / quad if quad > 0 else s_prev) if self.update_scale else 1.0
        f = (self.y_c - 2 * s * lin + s * s * quad) / self.ynorm
        if self.align is not None:
            f += self.lam_a * self.align.value(self.frame @ r)
        return f, s, rg

    def egrad(self, r: torch.Tensor, rg: torch.Tensor, s: float) -> torch.Tensor:
        """``(-2 s A^T G_yx + 2 s^2 A^T A R G_xx) / ||Y||^2 + lambda_a frame^T dA/dR_1``."""
        g = (-2 * s * self.atg + 2 * s * s * self.apply_ata(rg)) / self.ynorm
        if self.align is not None:
            g = g + self.lam_a * self.frame.mT @ self.align.grad(self.frame @ r)
        return g


@dataclass
class StiefelResult:
    r: torch.Tensor
    s: float
    objective_before: float
    objective_after: float
    iters: int
    stop: str


def reduced_stiefel_solve(a: torch.Tensor, gyx: torch.Tensor, gxx: torch.Tensor, ynorm: float,
                          r0: torch.Tensor, *, a_sq: torch.Tensor | None = None, lmax_gxx: float | None = None,
                          align: Alignment | None = None, lam_a: float = 0.0, frame: torch.Tensor | None = None,
                          delta: float = 7e-4, max_iter: int = 500, update_scale: bool = True,
                          retraction: str = "auto", ns_dtype: torch.dtype | None = None,
                          y_const: float | None = None, atg: torch.Tensor | None = None) -> StiefelResult:
    """Minimize ``F(R) = f(R; s(R)) / ||Y||^2 + lambda_a A(frame R)`` over row-orthonormal ``R`` (``b x k``).

    ``f(R; s) = y_const - 2 s <A^T G_yx, R> + s^2 <R, A^T A R G_xx>`` is the reconstruction of
    ``s A R`` (``A = U S`` for the reduced problem, so ``A R = W Q_r`` with ``R = V^T Q_r``; ``A = W`` and
    ``R = Q_r`` for the full one). ``s(R) = <A^T G_yx, R> / <R, A^T A R G_xx>`` is recomputed after every
    step (kept when the denominator is <= 0, frozen at 1 if ``update_scale`` is False).
    Euclidean gradient ``(-2 s A^T G_yx + 2 s^2 A^T A R G_xx) / ||Y||^2 + lambda_a frame^T dA/dR_1``;
    Riemannian ``Gamma = E - sym(E R^T) R``; step ``tau = eta / s^2``,
    ``eta = ||Y||^2 / (2 lmax(A^T A) lmax(G_xx))`` (inverse Lipschitz constant at s = 1), capped so that
    ``||tau Gamma||_F <= 1``; retraction: Cayley (square, ``auto``) or Newton-Schulz polar; steps that
    would increase F are halved (at most 30 times, else stop). Stops when
    ``||R_{t+1} - R_t||_F / sqrt(b) < delta`` or after ``max_iter`` steps.

    ``a_sq``: the diagonal of ``A^T A`` when A has orthogonal columns (reduced case, ``S^2``), which
    avoids a ``b x b`` product per step. ``frame``: ``r x b`` map from R to the alignment frame
    ``R_1 = frame R`` (default: the first r rows). ``gxx`` may be 1-D: a diagonal G_xx (its eigenvalues,
    the caller working in its eigenbasis), which makes ``R G_xx`` a column scaling. ``atg``: ``A^T G_yx``
    when the caller has it.
    """
    b, k = r0.shape
    ata = None if a_sq is not None else a.mT @ a
    with one_thread():  # LAPACK's last bits depend on the thread count; eta scales every step
        lmax_a = float(a_sq.max()) if a_sq is not None else float(torch.linalg.eigvalsh(sym(ata)).max())
        if lmax_gxx is None:
            lmax_gxx = float(gxx.max()) if gxx.dim() == 1 else float(torch.linalg.eigvalsh(sym(gxx)).max())
    eta = ynorm / (2 * lmax_a * lmax_gxx) if lmax_a > 0 and lmax_gxx > 0 else 1.0
    use_align = align is not None and lam_a > 0
    if use_align and frame is None:
        frame = torch.eye(b, dtype=a.dtype, device=a.device)[: min(align.r, b)]
    obj = _StiefelObjective(atg=a.mT @ gyx if atg is None else atg, gxx=gxx, a_sq=a_sq, ata=ata, ynorm=ynorm,
                            y_c=ynorm if y_const is None else y_const, update_scale=update_scale,
                            align=align if use_align else None, lam_a=lam_a, frame=frame)
    terms = obj.terms
    square = b == k
    use_cayley = retraction == "cayley" or (retraction == "auto" and square)
    r = r0
    f0, s, rg = terms(r, 1.0)
    f = f0
    it, stop = 0, "max_iter"
    # ||R R^T - I||_F of the current iterate when a converged Newton-Schulz polar retraction produced it
    # (its last convergence check is that very number); otherwise the final drift check measures it once
    drift_known: float | None = None
    rinfo: dict[str, Any] = {}
    for it in range(1, max_iter + 1):  # noqa: B007
        egrad = obj.egrad(r, rg, s)
        gam = egrad - sym(egrad @ r.mT) @ r
        gn = float(det_norm(gam))
        if gn == 0 or not math.isfinite(gn):
            stop = "zero_gradient" if gn == 0 else "non_finite"
            break
        tau = min(eta / (s * s) if s != 0 else float("inf"), 1.0 / gn)
        found = _descent_step(terms, r, gam, tau, s, f, use_cayley, ns_dtype, rinfo)
        if found is None:
            stop = "no_descent"
            break
        r_new, f_new, s_new, rg_new = found
        step = float(det_norm(r_new - r)) / math.sqrt(b)
        r, s, f, rg = r_new, s_new, f_new, rg_new
        drift_known = rinfo["ns_polar_err"] if (not use_cayley and rinfo.get("ns_polar_converged")) else None
        if step < delta:
            stop = "delta"
            break
    r, s, f = _reorthonormalized(obj, r, s, f, drift_known)
    return StiefelResult(r=r, s=s, objective_before=f0, objective_after=f, iters=it, stop=stop)


def _descent_step(terms, r: torch.Tensor, gam: torch.Tensor, tau: float, s: float, f: float, use_cayley: bool,
                  ns_dtype: torch.dtype | None, rinfo: dict[str, Any]) -> tuple[torch.Tensor, float, float, Any] | None:
    """``(R_new, F, s, terms)`` of the first retracted step along ``-Gamma`` that does not increase ``F``, halving
    ``tau`` at most 30 times; None when none does. ``rinfo``: what a Newton-Schulz retraction measured (its drift)."""
    for _ in range(30):
        rinfo.clear()  # only a Newton-Schulz retraction measures its drift (gram_polar does not)
        r_new = (cayley_retract(r, gam, tau, ns_dtype=ns_dtype) if use_cayley
                 else polar_retract(r, tau * gam, info=rinfo))
        f_new, s_new, rg_new = terms(r_new, s)
        if f_new <= f:
            return r_new, f_new, s_new, rg_new
        tau *= 0.5
    return None


def _reorthonormalized(obj: _StiefelObjective, r: torch.Tensor, s: float, f: float, drift_known: float | None
                       ) -> tuple[torch.Tensor, float, float]:
    """``(R, s, F)`` re-orthonormalized when Cayley/Newton-Schulz round-off has accumulated (``||R R^T - I||_F``
    above ``sqrt(eps)``; ``drift_known`` when the last polar retraction measured it), kept only if not worse."""
    drift = drift_known if drift_known is not None else float(
        det_norm(r @ r.mT - torch.eye(r.shape[0], dtype=r.dtype, device=r.device)))
    if drift > math.sqrt(eps_of(r.dtype)):
        r_c = newton_schulz_polar(r, prescaled=True)
        f_c, s_c, _ = obj.terms(r_c, s)
        if f_c <= f:
            return r_c, s_c, f_c
    return r, s, f
