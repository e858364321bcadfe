"""COEC - Calibrated Orthogonal-Equivalence Compensation (seed 000; spec coec.md).

After structured column pruning of a residual-writing projection (``o_proj`` / ``down_proj``), COEC
replaces the kept slice ``W_K = W0[:, K]`` by ``W~ = Q_l W_K^(S) Q_r`` minimizing (COEC Eq. 1)

    L(W~, Q_r) = ||Y - W~ X_K||_F^2 / ||Y||_F^2 + lambda_a A(Q_r)
               = [tr(W~ G_xx W~^T) - 2 tr(W~ G_yx^T) + ||Y||^2] / ||Y||^2 + lambda_a A,

``G = C^alpha`` (tempered second moment), ``G_xx = G[K, K]``, ``G_yx = W0 G[:, K]``,
``||Y||^2 = tr(W0 G W0^T)``. Components (each switchable through :class:`COECOptions`, for the
paper's Table 3 ablation; see :func:`coec_ablation_options`):

* Gram tempering ``G^alpha`` (Sec. 4.4), on the full ``d_in x d_in`` matrix before slicing.
* Left rotation ``Q_l = polar(G_yx W^T)`` (Sec. 4.1, closed form) - :func:`procrustes_left`.
* Global scale ``s* = <G_yx, W>/<W, W G_xx>`` (Sec. 4.1), applied only if the denominator is > 0.
* GCV per-mode rescale (Sec. 4.3, App. B) - :func:`gcv_rescale`.
* Right rotation by projected gradient on the reduced Stiefel manifold (Sec. 4.1-4.2, App. B) -
  :func:`reduced_stiefel_solve`; Newton-Schulz polar retraction for rectangular frames, Cayley with a
  Newton-Schulz inverse for square ones; ``Q_r = I`` initialization; step ``eta / s^2`` capped so that
  ``||step * grad||_F <= 1``; the scale is recomputed after every step.
* Anchored alignment penalty on ``o_proj`` (Sec. 4.5) - :func:`build_alignment`, which needs the value
  projection expanded to the query-head layout (:func:`expand_value_to_query_heads`).
* Alternation ``Q_l -> s -> Q_r -> s`` (Alg. 1) for at most 50 rounds.

Reconstructed details follow coec.md ([R] there). Where this module departs from coec.md, the paper
wins and the choice is marked **[paper>spec]**; choices neither document fixes are marked **[impl]**:

* **[paper>spec]** early stop: App. B says "early stop at 1e-4 *relative* change" - default
  ``tol_mode='relative'`` (``|L - L_prev| < tol |L_prev|``); coec.md uses an absolute change
  (``tol_mode='absolute'``).
* **[impl]** Cayley skew matrix ``A = (Gamma R^T - R Gamma^T)/2`` (coec.md omits the 1/2): both
  retractions then move ``R - tau Gamma`` to first order, so the step rule ``eta/s^2`` means the same
  thing for square and rectangular frames.
* **[impl]** Newton-Schulz polar iterates to a tolerance (max 100) instead of "8 iterations after
  Frobenius normalization": Frobenius scaling of a ``b x k`` frame shrinks its singular values to
  ``~1/sqrt(b)`` and 8 iterations do not converge for large b. The retraction needs no prescaling
  because ``(R - tau Gamma)`` has singular values in ``[1, sqrt(2)]`` under the step cap.
* **[impl]** monotonicity safeguards: every right-solver step is backtracked (halved, at most 30
  times) until the solver objective does not increase, and the returned weight is the best iterate of
  the paper's objective ``L`` over the alternation (the slice-only ``W_K`` included). Without the
  alignment term ``L`` is non-increasing anyway (the left rotation is a conditional minimizer, the
  rescale never increases the reconstruction term - invariant C5), so this only matters with
  ``lambda_a > 0``, where the rescale may reorder modes and move the leading right subspace.
* Non-finite results fall back to the RCPU solution and then to the plain slice (coec.md Sec. 7.5).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from secateur.calib.stats import Gram
from secateur.compensate.base import Compensation, InputStats, finish, output_energy, prepare
from secateur.compensate.rcpu import global_scale, procrustes_left
from secateur.errors import SecateurError
from secateur.linalg import (
    cayley_retract,
    eps_of,
    newton_schulz_polar,
    orth,
    polar_retract,
    psd_power,
    safe_eigh,
    safe_svd,
    sym,
)

__all__ = [
    "COECOptions", "ValueProjection", "Alignment", "StiefelResult", "coec", "coec_ablation_options",
    "COEC_ABLATION_STAGES", "gcv_rescale", "gcv_curve", "reduced_stiefel_solve", "build_alignment",
    "expand_value_to_query_heads", "coec_objective",
]


# --------------------------------------------------------------------------------------------------
# options


@dataclass(frozen=True)
class COECOptions:
    """COEC hyper-parameters (defaults = COEC App. B / coec.md Sec. 6).

    alpha: Gram tempering exponent (1 = off).
    left_rotation: closed-form left Procrustes rotation on/off.
    rescale: ``'gcv'`` per-mode GCV rescale (paper), ``'global'`` global scale s* only (RCPU-style,
        = GCV at lambda -> inf), ``'none'`` no scaling at all (also freezes the right solver's scale).
    gcv_points, gcv_range: lambda grid ``median(e) * logspace(log10 lo, log10 hi, points)``.
    kappa: dose band, every per-mode value is clamped to ``[s* sigma_i / kappa, kappa s* sigma_i]``.
    max_rounds: alternation rounds after the initial left+rescale block (0 = no right rotation).
    tol, tol_mode: early stop on the change of L (``relative`` per App. B, or ``absolute``).
    right_solver: ``'reduced'`` reduced-Stiefel solve on ``R = V^T Q_r`` (paper), ``'full'`` projected
        gradient on ``Q_r in O(k)`` (the ablation's "converged two-sided rotation"), ``'none'``.
    slice_rows: None = one slice (the whole matrix, a single Q_r; coec.md [A2](i)); an int b solves
        each block of b output rows with its own right frame and scale ([A2](ii), ablation only).
    delta: right-solver stop tolerance on ``||R_{t+1} - R_t||_F / sqrt(b)``.
    max_inner: right-solver iteration cap.
    lambda_align, r_p: alignment weight and rank (used only when a value projection is passed).
    retraction: ``'auto'`` (Cayley for square frames, Newton-Schulz polar for rectangular), or forced.
    ns_dtype: dtype of the Newton-Schulz inverse inside the Cayley retraction (None = working dtype).
    dtype: working dtype of all COEC math (float64 default; float32 halves memory on GPUs).
    keep_best: return the best iterate of L (see module docstring).
    """

    alpha: float = 0.9
    left_rotation: bool = True
    rescale: Literal["gcv", "global", "none"] = "gcv"
    gcv_points: int = 120
    gcv_range: tuple[float, float] = (1e-4, 1e5)
    kappa: float = 10.0
    max_rounds: int = 50
    tol: float = 1e-4
    tol_mode: Literal["relative", "absolute"] = "relative"
    right_solver: Literal["reduced", "full", "none"] = "reduced"
    slice_rows: int | None = None
    delta: float = 7e-4
    max_inner: int = 500
    lambda_align: float = 50.0
    r_p: int = 16
    retraction: Literal["auto", "polar", "cayley"] = "auto"
    ns_dtype: torch.dtype | None = None
    dtype: torch.dtype = torch.float64
    keep_best: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1:
            raise SecateurError(f"COEC alpha must be in (0, 1], got {self.alpha}")
        if self.rescale not in ("gcv", "global", "none"):
            raise SecateurError(f"unknown COEC rescale {self.rescale!r}")
        if self.right_solver not in ("reduced", "full", "none"):
            raise SecateurError(f"unknown COEC right_solver {self.right_solver!r}")
        if self.retraction not in ("auto", "polar", "cayley"):
            raise SecateurError(f"unknown COEC retraction {self.retraction!r}")
        if self.tol_mode not in ("relative", "absolute"):
            raise SecateurError(f"unknown COEC tol_mode {self.tol_mode!r}")
        if self.kappa < 1:
            raise SecateurError(f"COEC kappa must be >= 1, got {self.kappa}")
        if self.max_rounds < 0 or self.max_inner < 0 or self.r_p < 1 or self.lambda_align < 0:
            raise SecateurError("COEC max_rounds/max_inner must be >= 0, r_p >= 1, lambda_align >= 0")
        if self.slice_rows is not None and self.slice_rows < 1:
            raise SecateurError("COEC slice_rows must be a positive int or None")


COEC_ABLATION_STAGES = ("rcpu", "gcv", "two_sided", "reduced_stiefel", "tempering", "align")


def coec_ablation_options(stage: str) -> COECOptions:
    """Cumulative configurations of COEC Table 3 (each row adds one component):

    rcpu            left rotation + global scale (alpha=1, no right rotation, no alignment) = RCPU
    gcv             + GCV per-mode rescale
    two_sided       + converged two-sided rotation (right rotation as plain projected gradient on O(k))
    reduced_stiefel + reduced-Stiefel right solve
    tempering       + Gram tempering alpha = 0.9
    align           + anchored alignment lambda_a = 50 (full COEC; alignment acts only when a value
                      projection is passed, i.e. on o_proj)

    Reading of "two_sided" vs "reduced_stiefel" is ours: the paper does not say how its converged
    two-sided rotation was computed. With one slice the two parameterizations describe the same
    family (coec.md [A2](i)) and differ only in the solver path (identical for full-rank square frames).
    """
    if stage not in COEC_ABLATION_STAGES:
        raise SecateurError(f"unknown COEC ablation stage {stage!r}; choose from {COEC_ABLATION_STAGES}")
    i = COEC_ABLATION_STAGES.index(stage)
    return COECOptions(
        alpha=0.9 if i >= 4 else 1.0,
        rescale="gcv" if i >= 1 else "global",
        max_rounds=50 if i >= 2 else 0,
        right_solver="reduced" if i >= 3 else ("full" if i >= 2 else "none"),
        lambda_align=50.0 if i >= 5 else 0.0,
    )


# --------------------------------------------------------------------------------------------------
# GQA value projection and the alignment penalty (COEC Sec. 4.5, coec.md Sec. 4.6)


def expand_value_to_query_heads(w_v: torch.Tensor, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """Expand a value projection ``[n_kv_heads * m, d]`` to the query-head layout ``[n_heads * m, d]``
    that ``o_proj`` reads (Hugging Face ``repeat_kv``: query head h uses KV head ``h // (n_heads //
    n_kv_heads)``). Row ``h*m + t`` of the result is row ``(h // g)*m + t`` of ``w_v``. Works for any
    trailing shape (a bias ``[n_kv_heads * m]`` too). MHA (``n_heads == n_kv_heads``) returns a copy."""
    if n_kv_heads <= 0 or n_heads % n_kv_heads:
        raise SecateurError(f"n_heads={n_heads} must be a positive multiple of n_kv_heads={n_kv_heads}")
    if w_v.shape[0] % n_kv_heads:
        raise SecateurError(f"value projection has {w_v.shape[0]} rows, not a multiple of {n_kv_heads} heads")
    m = w_v.shape[0] // n_kv_heads
    g = n_heads // n_kv_heads
    idx = ((torch.arange(n_heads) // g)[:, None] * m + torch.arange(m)[None, :]).flatten()
    return w_v[idx.to(w_v.device)]


@dataclass(frozen=True)
class ValueProjection:
    """The dense (unpruned) value projection feeding an ``o_proj``: weight ``[n_kv_heads * m, d_model]``
    (HF ``[out, in]``) and the head counts. Pass it to :func:`coec` for ``o_proj`` to enable the
    anchored alignment penalty; leave it out for ``down_proj`` (lambda_a = 0 on the MLP, COEC Sec. 4.5)."""

    weight: torch.Tensor
    n_heads: int
    n_kv_heads: int

    def in_o_space(self, kept: torch.Tensor) -> torch.Tensor:
        """Effective value map read by the kept o_proj columns: ``expand(W_v)[K]`` (``k x d_model``),
        i.e. ``E W_v,pruned`` of coec.md [A3] for kept whole KV groups."""
        return expand_value_to_query_heads(self.weight, self.n_heads, self.n_kv_heads)[kept.to(self.weight.device)]


@dataclass
class Alignment:
    """Precomputed pieces of ``A(R) = ||U_v^T (R_1^T R_1 - Pi_anchor) U_v||_F^2 / r_p^2`` (COEC Sec. 4.5).

    u_v: ``k x r`` leading left singular vectors of the value map in o_proj input space.
    n_anchor: ``U_v^T Pi_anchor U_v`` (``r x r``).
    r_norm: the ``r_p`` in the normalization (effective rank used, ``<= r_p``).
    """

    u_v: torch.Tensor
    n_anchor: torch.Tensor
    r_norm: int

    @property
    def r(self) -> int:
        return self.u_v.shape[1]

    def value(self, r1: torch.Tensor) -> float:
        m = r1 @ self.u_v
        d = m.mT @ m - self.n_anchor
        return float((d * d).sum()) / self.r_norm**2

    def grad(self, r1: torch.Tensor) -> torch.Tensor:
        """``dA/dR_1 = (4 / r_p^2) R_1 U_v D U_v^T``, ``D = U_v^T (R_1^T R_1 - Pi_anchor) U_v``."""
        m = r1 @ self.u_v
        d = m.mT @ m - self.n_anchor
        return (4.0 / self.r_norm**2) * (m @ d) @ self.u_v.mT

    def of_weight(self, w: torch.Tensor) -> float:
        """A evaluated at the leading right singular frame of a weight (coec.md Sec. 5 line 10)."""
        _, s, vh = safe_svd(w)
        b = int((s > 1e-12 * s[0]).sum()) if s.numel() and s[0] > 0 else 0
        return self.value(vh[: min(self.r, b)])


def build_alignment(w0: torch.Tensor, kept: torch.Tensor, value: ValueProjection, r_p: int = 16,
                    dtype: torch.dtype = torch.float64) -> Alignment:
    """Anchor and value frame of COEC Sec. 4.5.

    ``V_anchor = orth(V_full,r_p[K, :])`` with ``V_full,r_p`` the top-r_p right singular vectors of the
    unpruned ``W0`` (= o_proj); ``U_v`` = top-r_p left singular vectors of the value map expanded to the
    query-head layout and restricted to K (GQA, coec.md [A3]). ``r = min(r_p, k)``.
    """
    w = w0.to(dtype)
    k = kept.numel()
    r = min(r_p, k)
    _, _, vh = safe_svd(w)
    v_anchor = orth(vh[:r].mT[kept])  # k x r_a (r_a <= r)
    wv = value.in_o_space(kept).to(w.device, dtype)
    if wv.shape[0] != k:
        raise SecateurError("value projection rows do not match the o_proj input width")
    u, _, _ = safe_svd(wv)
    u_v = u[:, :r]
    c = v_anchor.mT @ u_v
    return Alignment(u_v=u_v, n_anchor=c.mT @ c, r_norm=r)


# --------------------------------------------------------------------------------------------------
# objective pieces


@dataclass
class _Problem:
    gxx: torch.Tensor
    gyx: torch.Tensor
    ynorm: float
    lmax_gxx: float
    align: Alignment | None
    lam_a: float
    gfull: torch.Tensor | None = None  # full tempered Gram, only for per-slice ||Y_g||^2 constants

    def recon(self, w: torch.Tensor) -> float:
        """Relative reconstruction term in the (tempered) metric."""
        q = float(((w @ self.gxx) * w).sum())
        lin = float((w * self.gyx).sum())
        return (q - 2 * lin + self.ynorm) / self.ynorm

    def objective(self, w: torch.Tensor) -> tuple[float, float, float]:
        rec = self.recon(w)
        al = self.align.of_weight(w) if (self.align is not None and self.lam_a > 0) else 0.0
        return rec + self.lam_a * al, rec, al


def coec_objective(w: torch.Tensor, gyx: torch.Tensor, gxx: torch.Tensor, ynorm: float) -> float:
    """Relative reconstruction ``[tr(W G_xx W^T) - 2 tr(W G_yx^T) + ||Y||^2] / ||Y||^2`` (COEC Sec. 3.1)."""
    return _Problem(gxx, gyx, ynorm, 0.0, None, 0.0).recon(w)


# --------------------------------------------------------------------------------------------------
# GCV per-mode rescale (COEC Sec. 4.3, App. B)


def _modes(w: torch.Tensor, gyx: torch.Tensor, gxx: torch.Tensor):
    u, s, vh = safe_svd(w)
    keep = s > 1e-12 * s[0] if s.numel() and s[0] > 0 else torch.zeros_like(s, dtype=torch.bool)
    u, s, vh = u[:, keep], s[keep], vh[keep]
    v = vh.mT
    rho = (u * (gyx @ v)).sum(0)
    e = (v * (gxx @ v)).sum(0)
    return u, s, vh, rho, e


def gcv_curve(rho: torch.Tensor, e: torch.Tensor, prior: torch.Tensor, lams: torch.Tensor) -> torch.Tensor:
    """``GCV(lambda) = sum_i e_i (s_i(lambda) - rho_i/e_i)^2 / (1 - df(lambda)/M)^2`` with
    ``s_i(lambda) = (rho_i + lambda prior_i) / (e_i + lambda)``, ``df = sum_i e_i / (e_i + lambda)``,
    ``M`` = number of modes (COEC Sec. 4.3). Evaluated in the cancellation-free form
    ``s_i(lambda) - rho_i/e_i = lambda (prior_i - rho_i/e_i) / (e_i + lambda)``; non-finite -> +inf."""
    m = e.numel()
    lam = lams[:, None]
    ls = rho / e
    dev = lam * (prior - ls) / (e + lam)
    num = (e * dev * dev).sum(1)
    den = ((lam / (e + lam)).sum(1) / m) ** 2  # (1 - df/M)^2 written without cancellation
    out = num / den
    return torch.where(torch.isfinite(out), out, torch.full_like(out, float("inf")))


def gcv_rescale(w: torch.Tensor, gyx: torch.Tensor, gxx: torch.Tensor, *, kappa: float = 10.0,
                points: int = 120, grid_range: tuple[float, float] = (1e-4, 1e5), lam: float | None = None,
                info: dict[str, Any] | None = None) -> torch.Tensor:
    """GCV-regularized per-mode singular-value rescale (COEC Sec. 4.3, App. B).

    With ``W = U diag(sigma) V^T`` (modes with ``sigma_i <= 1e-12 sigma_1`` dropped), mode response
    ``rho_i = u_i^T G_yx v_i``, mode energy ``e_i = v_i^T G_xx v_i``, global scale s* of W:
    ``s_i(lambda) = (rho_i + lambda s* sigma_i) / (e_i + lambda)``, lambda chosen by minimizing
    :func:`gcv_curve` over ``median(e) * logspace(lo, hi, points)`` (first minimum = smallest lambda on
    ties) unless ``lam`` is given; each value is clamped to ``[s* sigma_i / kappa, kappa s* sigma_i]``.
    Returns ``U diag(s) V^T``. Safeguards (coec.md [R]): if s* is unavailable (denominator <= 0) the
    weight is returned unchanged; if ``s* <= 0`` it returns ``s* W`` (**[impl]**: coec.md keeps W, which
    would break invariant C5 ``L(GCV(W)) <= L(s* W)``); modes with ``e_i <= 1e-10 max(e)`` take ``s* sigma_i``
    and are left out of the GCV sum. The loss is separable in the mode values, so the result never has a
    larger reconstruction term than ``s* W`` (invariant C5).
    """
    s_star, ok = global_scale(gyx, gxx, w)
    if info is not None:
        info.update(gcv_scale=s_star, gcv_skipped=False)
    if not ok or s_star <= 0:
        # no positive uniform prior to shrink toward (the band would be empty): fall back to the
        # global scale when it exists (the lambda -> inf limit), else leave W as it is
        if info is not None:
            info["gcv_skipped"] = True
        return s_star * w if ok else w
    u, sig, vh, rho, e = _modes(w, gyx, gxx)
    prior = s_star * sig
    active = e > 1e-10 * e.max() if e.numel() else e.bool()
    vals = prior.clone()
    chosen = float("inf")
    if int(active.sum()) > 0:
        ea, ra, pa = e[active], rho[active], prior[active]
        if lam is None:
            lo, hi = grid_range
            grid = float(ea.median()) * torch.logspace(math.log10(lo), math.log10(hi), points,
                                                       dtype=w.dtype, device=w.device)
            curve = gcv_curve(ra, ea, pa, grid)
            chosen = float(grid[int(torch.argmin(curve))]) if bool(torch.isfinite(curve).any()) else float("inf")
        else:
            chosen = float(lam)
        if math.isinf(chosen):
            va = pa
        else:
            va = (ra + chosen * pa) / (ea + chosen)
        vals[active] = va
    clamped = torch.minimum(torch.maximum(vals, prior / kappa), prior * kappa)
    if info is not None:
        info.update(gcv_lambda=chosen, gcv_modes=int(active.sum()),
                    gcv_clamped=int((clamped != vals).sum()),
                    gcv_lambda_rel=chosen / float(e[active].median()) if int(active.sum()) else float("nan"))
    return (u * clamped) @ vh


def _rescale(w: torch.Tensor, prob: _Problem, opts: COECOptions, info: dict[str, Any]) -> torch.Tensor:
    if opts.rescale == "none":
        return w
    if opts.rescale == "global":
        s, ok = global_scale(prob.gyx, prob.gxx, w)
        info["scale"] = s
        return s * w if ok else w
    out = gcv_rescale(w, prob.gyx, prob.gxx, kappa=opts.kappa, points=opts.gcv_points,
                      grid_range=opts.gcv_range, info=info)
    info.setdefault("gcv_lambda_history", []).append(info.get("gcv_lambda") if not info["gcv_skipped"] else None)
    return out


# --------------------------------------------------------------------------------------------------
# right rotation: projected gradient on St(b, k) (COEC Sec. 4.1-4.2, App. B; coec.md Sec. 4.5)


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
                          y_const: float | None = None) -> StiefelResult:
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
    ``R_1 = frame R`` (default: the first r rows).
    """
    b, k = r0.shape
    ata = None if a_sq is not None else a.mT @ a
    atg = a.mT @ gyx
    y_c = ynorm if y_const is None else y_const
    lmax_a = float(a_sq.max()) if a_sq is not None else float(torch.linalg.eigvalsh(sym(ata)).max())
    if lmax_gxx is None:
        lmax_gxx = float(torch.linalg.eigvalsh(sym(gxx)).max())
    eta = ynorm / (2 * lmax_a * lmax_gxx) if lmax_a > 0 and lmax_gxx > 0 else 1.0
    use_align = align is not None and lam_a > 0
    if use_align and frame is None:
        frame = torch.eye(b, dtype=a.dtype, device=a.device)[: min(align.r, b)]

    def apply_ata(r: torch.Tensor) -> torch.Tensor:
        return a_sq[:, None] * r if a_sq is not None else ata @ r

    def terms(r: torch.Tensor, s_prev: float) -> tuple[float, float, torch.Tensor]:
        rg = r @ gxx
        quad = float((apply_ata(r) * rg).sum())
        lin = float((atg * r).sum())
        s = (lin / quad if quad > 0 else s_prev) if update_scale else 1.0
        f = (y_c - 2 * s * lin + s * s * quad) / ynorm
        if use_align:
            f += lam_a * align.value(frame @ r)
        return f, s, rg

    square = b == k
    use_cayley = retraction == "cayley" or (retraction == "auto" and square)
    r = r0
    f0, s, rg = terms(r, 1.0)
    f = f0
    it, stop = 0, "max_iter"
    for it in range(1, max_iter + 1):  # noqa: B007
        egrad = (-2 * s * atg + 2 * s * s * apply_ata(rg)) / ynorm
        if use_align:
            egrad = egrad + lam_a * frame.mT @ align.grad(frame @ r)
        gam = egrad - sym(egrad @ r.mT) @ r
        gn = float(gam.norm())
        if gn == 0 or not math.isfinite(gn):
            stop = "zero_gradient" if gn == 0 else "non_finite"
            break
        tau = eta / (s * s) if s != 0 else float("inf")
        tau = min(tau, 1.0 / gn)
        accepted = False
        for _ in range(30):
            r_new = (cayley_retract(r, gam, tau, ns_dtype=ns_dtype) if use_cayley
                     else polar_retract(r, tau * gam))
            f_new, s_new, rg_new = terms(r_new, s)
            if f_new <= f:
                accepted = True
                break
            tau *= 0.5
        if not accepted:
            stop = "no_descent"
            break
        step = float((r_new - r).norm()) / math.sqrt(b)
        r, s, f, rg = r_new, s_new, f_new, rg_new
        if step < delta:
            stop = "delta"
            break
    # re-orthonormalize when Cayley/Newton-Schulz round-off has accumulated; keep only if not worse
    drift = float((r @ r.mT - torch.eye(b, dtype=r.dtype, device=r.device)).norm())
    if drift > math.sqrt(eps_of(r.dtype)):
        r_c = newton_schulz_polar(r, prescaled=True)
        f_c, s_c, _ = terms(r_c, s)
        if f_c <= f:
            r, s, f = r_c, s_c, f_c
    return StiefelResult(r=r, s=s, objective_before=f0, objective_after=f, iters=it, stop=stop)


def _right_rotate(w: torch.Tensor, w0g: torch.Tensor, prob: _Problem, opts: COECOptions,
                  info: dict[str, Any]) -> torch.Tensor:
    """One ``Q_r -> s`` block (Alg. 1 line 6-7 / coec.md line 7-8): returns ``s W Q_r``."""
    update_scale = opts.rescale != "none"
    common = dict(lmax_gxx=prob.lmax_gxx, align=prob.align, lam_a=prob.lam_a, delta=opts.delta,
                  max_iter=opts.max_inner, update_scale=update_scale, retraction=opts.retraction,
                  ns_dtype=opts.ns_dtype)
    if opts.right_solver == "full":
        k = w.shape[1]
        frame = None
        if prob.align is not None and prob.lam_a > 0:
            _, sg, vh = safe_svd(w)
            b = int((sg > 1e-12 * sg[0]).sum()) if sg.numel() and sg[0] > 0 else 0
            frame = vh[: min(prob.align.r, b)]
        res = reduced_stiefel_solve(w, prob.gyx, prob.gxx, prob.ynorm,
                                    torch.eye(k, dtype=w.dtype, device=w.device), frame=frame, **common)
        info.setdefault("right_iters", []).append(res.iters)
        return res.s * (w @ res.r)
    rows_all = w.shape[0]
    step = rows_all if opts.slice_rows is None else opts.slice_rows
    out = torch.empty_like(w)
    iters = []
    for lo in range(0, rows_all, step):
        sl = slice(lo, min(lo + step, rows_all))
        wg = w[sl]
        u, sg, vh = safe_svd(wg)
        b = int((sg > 1e-12 * sg[0]).sum()) if sg.numel() and sg[0] > 0 else 0
        if b == 0:
            out[sl] = wg
            continue
        u, sg, vh = u[:, :b], sg[:b], vh[:b]
        y_const = None
        if opts.slice_rows is not None and prob.gfull is not None:
            y_const = float(((w0g[sl] @ prob.gfull) * w0g[sl]).sum())
        res = reduced_stiefel_solve(u * sg, prob.gyx[sl], prob.gxx, prob.ynorm, vh, a_sq=sg * sg,
                                    y_const=y_const, **common)
        iters.append(res.iters)
        out[sl] = res.s * ((u * sg) @ res.r)
    info.setdefault("right_iters", []).append(iters[0] if len(iters) == 1 else iters)  # [] if W = 0
    return out


# --------------------------------------------------------------------------------------------------
# the full algorithm (COEC Alg. 1)


def _coec_core(w0: torch.Tensor, kept: torch.Tensor, prob: _Problem, opts: COECOptions,
               info: dict[str, Any]) -> torch.Tensor:
    w_k = w0[:, kept]
    l_slice, rec_slice, al_slice = prob.objective(w_k)
    info.update(objective_before=l_slice, recon_tempered_before=rec_slice, align_before=al_slice)
    w = w_k
    if opts.left_rotation:
        w = procrustes_left(prob.gyx, w, info=info) @ w
    w = _rescale(w, prob, opts, info)
    l_prev = prob.objective(w)[0]
    history = [l_slice, l_prev]
    best_l, best_w = (l_slice, w_k) if l_slice < l_prev else (l_prev, w)
    rounds = 0
    for rounds in range(1, opts.max_rounds + 1):  # noqa: B007
        if opts.right_solver != "none":
            w = _right_rotate(w, w0, prob, opts, info)
            w = _rescale(w, prob, opts, info)
        if opts.left_rotation:
            w = procrustes_left(prob.gyx, w) @ w
            w = _rescale(w, prob, opts, info)
        if not bool(torch.isfinite(w).all()):
            raise FloatingPointError("COEC produced a non-finite weight")
        l_cur = prob.objective(w)[0]
        history.append(l_cur)
        if l_cur < best_l:
            best_l, best_w = l_cur, w
        change = abs(l_cur - l_prev)
        thresh = opts.tol * abs(l_prev) if opts.tol_mode == "relative" else opts.tol
        l_prev = l_cur
        if change < thresh or (opts.tol_mode == "relative" and l_prev == 0):
            break
    info["rounds"] = rounds
    info["history"] = history
    final = best_w if opts.keep_best else w
    l_fin, rec_fin, al_fin = prob.objective(final)
    info.update(objective_after=l_fin, recon_tempered_after=rec_fin, align_after=al_fin,
                returned_best=opts.keep_best and final is not w)
    return final


def coec(w0: torch.Tensor, stats: InputStats | Gram, kept: torch.Tensor | Sequence[int], *,
         bias: torch.Tensor | None = None, value: ValueProjection | None = None,
         options: COECOptions | None = None, **overrides: Any) -> Compensation:
    """COEC compensation of one column-pruned projection (COEC Alg. 1, Eq. 1).

    w0: dense ``o_proj`` / ``down_proj`` weight ``[d_out, d_in]``; stats: its input statistics
    (``E[x x^T]``); kept: kept input columns K; bias: unchanged and not returned (COEC has no additive
    term); value: the dense value projection for ``o_proj`` (enables the alignment penalty with
    ``options.lambda_align``; omit for ``down_proj``); options / overrides: :class:`COECOptions` fields.

    Diagnostics: ``recon_before/after`` (untempered relative error), ``objective_before/after`` (L in
    the tempered metric incl. alignment), ``recon_tempered_before/after``, ``align_before/after``,
    ``rounds``, ``history`` (L per round), ``gcv_lambda`` (last GCV choice; ``inf`` = global scale),
    ``gcv_lambda_rel`` (its ratio to the median mode energy), ``gcv_lambda_history`` (every rescale, None
    when skipped), ``gcv_clamped``, ``right_iters``, ``fallback``.
    """
    opts = options or COECOptions()
    if overrides:
        opts = dataclasses.replace(opts, **overrides)
    st, k = prepare(w0, stats, kept, bias)
    dt = opts.dtype
    w = w0.to(dt)
    info: dict[str, Any] = {"method": "coec", "alpha": opts.alpha, "fallback": None}
    g = psd_power(st.second_moment, opts.alpha, info=info).to(dt)
    gxx = g[k][:, k]
    gyx = w @ g[:, k]
    ynorm = float(output_energy(w, g))
    if not ynorm > 0:
        info["fallback"] = "zero_output_energy"
        return finish(w0, st, k, w0[:, k].to(torch.float64), None, bias, info)
    lmax_gxx = float(safe_eigh(gxx)[0].max())
    align = None
    lam_a = opts.lambda_align if value is not None else 0.0
    if value is not None and lam_a > 0:
        align = build_alignment(w, k, value, opts.r_p, dt)
    info["lambda_align"] = lam_a
    prob = _Problem(gxx=gxx, gyx=gyx, ynorm=ynorm, lmax_gxx=lmax_gxx, align=align, lam_a=lam_a,
                    gfull=g if opts.slice_rows is not None else None)
    del g  # d_in x d_in (f^2 for down_proj): keep only the kept-column blocks alive
    try:
        w_new = _coec_core(w, k, prob, opts, info)
    except (RuntimeError, FloatingPointError, ValueError) as e:
        info["fallback"] = f"rcpu ({type(e).__name__}: {e})"
        try:
            w_new = procrustes_left(gyx, w[:, k]) @ w[:, k]
            s, ok = global_scale(gyx, gxx, w_new)
            w_new = s * w_new if ok else w_new
            if not bool(torch.isfinite(w_new).all()):
                raise FloatingPointError("non-finite RCPU fallback")
        except (RuntimeError, FloatingPointError, ValueError):
            info["fallback"] = "slice"
            w_new = w[:, k]
    return finish(w0, st, k, w_new.to(torch.float64), None, bias, info)
