"""Numerical building blocks shared by the compensators (COEC, RCPU, LS/ridge, CORP).

Everything here is a pure function of tensors and returns tensors on the input's device. Each
function that can fail on degenerate input has a fallback chain and can report what it did through
an optional ``info`` dict (so callers can put it in their diagnostics).

* :func:`safe_svd` - SVD with the fallback chain of COEC App. B ("SVD watchdog"): default driver
  (gesdd-like) -> ``gesvd`` (CUDA only) -> float64 on CPU -> eigendecomposition of the Gram.
* :func:`polar` - orthogonal polar factor ``U V^T`` from the SVD (Procrustes, COEC Sec. 4.1).
* :func:`newton_schulz_polar`, :func:`newton_schulz_inverse` - matrix-multiply-only iterations used
  by the Stiefel retractions (COEC App. B).
* :func:`polar_retract`, :func:`cayley_retract` - retractions of a row-orthonormal frame
  ``R`` (``R R^T = I``) along a tangent direction.
* :func:`psd_power` - ``G^alpha = E diag(max(mu,0)^alpha) E^T`` (COEC Sec. 4.4, Gram tempering).
* :func:`solve_spd` - ``X A = B`` for symmetric positive (semi)definite ``A``: Cholesky, Cholesky with
  growing jitter, then least squares (CORP / LS ridge solves).
* :func:`chol_inverse_upper` - the upper Cholesky factor of ``H^-1`` from one Cholesky of ``H`` and one
  triangular inverse (SparseGPT's ``U``), without forming ``H^-1``; on one thread.
* :func:`one_thread` / :func:`pinned` - run LAPACK on one thread: MKL's factorizations (Cholesky, QR, SVD,
  eigh, solves) split their work by the thread count and their last bits change with it, which flips
  downstream pruning decisions (docs/protocols.md, "Determinism across threads"). Every factorization
  here runs pinned; GEMMs and row reductions are thread-count-invariant and keep every thread.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

__all__ = [
    "sym", "safe_svd", "safe_eigh", "polar", "orth", "newton_schulz_polar", "newton_schulz_inverse",
    "polar_retract", "cayley_retract", "psd_power", "solve_spd", "eps_of", "all_finite",
    "one_thread", "pinned", "det_sum", "det_norm",
]

F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def one_thread() -> Iterator[None]:
    """Intra-op threads set to 1 inside the block (restored after; a no-op when already 1).

    MKL's LAPACK (and torch's whole-tensor reductions) split work by the thread count, so a Cholesky of the
    same matrix differs in the last bits between 1 and 2 threads; GEMMs do not (measured: bench/checks/thread_check.py).
    The factorizations are d x d with d <= a few thousand, so one thread costs little next to the capture."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def pinned(fn: F) -> F:
    """Decorator: run ``fn`` under :func:`one_thread`."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with one_thread():
            return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]


TRI_LEAF = 128  # below this width the triangular inverse is one LAPACK solve; above, two halves and two solves


@pinned
def chol_inverse_upper(h: torch.Tensor) -> torch.Tensor:
    """Upper-triangular ``U`` with positive diagonal and ``U^T U = H^-1``, for symmetric positive definite ``H``.

    With ``J`` the order-reversing permutation and ``L = chol(J H J)`` (lower), ``R = J L J`` is upper triangular and
    ``H = R R^T``; so ``H^-1 = R^-T R^-1`` and ``U = R^-1`` (upper, positive diagonal: Cholesky's factor is unique).
    Cost: one Cholesky (d^3/3) and one triangular inverse (recursive halves whose off-diagonal block
    ``-A^-1 B C^-1`` is two triangular solves, d^3/4 at the top level), against 4d^3/3 for
    ``chol(cholesky_inverse(chol(H)))``, and ``H^-1`` is never formed. Both are backward stable: they agree to about
    ``d eps kappa(H)`` relative (tested). Everything runs on one thread (LAPACK's and BLAS's triangular kernels split
    their work by the thread count, and SparseGPT solves on one thread anyway); raises
    ``torch.linalg.LinAlgError`` when ``H`` is not positive definite, as ``torch.linalg.cholesky`` does."""
    r = torch.linalg.cholesky(h.flip(0, 1)).flip(0, 1)
    return _tri_inv_upper(r)


def _tri_inv_upper(r: torch.Tensor) -> torch.Tensor:
    """``R^-1`` of an upper-triangular ``R``: ``[[A, B], [0, C]]^-1 = [[A^-1, -A^-1 B C^-1], [0, C^-1]]``, the
    off-diagonal block by two triangular solves (half the arithmetic of two products with the inverted halves)."""
    d = r.shape[0]
    if d <= TRI_LEAF:
        return torch.linalg.solve_triangular(r, torch.eye(d, dtype=r.dtype, device=r.device), upper=True)
    h = d // 2
    out = torch.zeros_like(r)
    out[:h, :h], out[h:, h:] = _tri_inv_upper(r[:h, :h]), _tri_inv_upper(r[h:, h:])
    y = torch.linalg.solve_triangular(r[h:, h:], r[:h, h:], upper=True, left=False)  # B C^-1
    out[:h, h:] = -torch.linalg.solve_triangular(r[:h, :h], y, upper=True)           # -A^-1 (B C^-1)
    return out


def eps_of(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def det_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of every entry in an order that does not depend on the thread count: torch splits a whole-tensor
    reduction by thread, but reduces each row of a 2-D view within one thread; the row sums are then few."""
    return t.reshape(t.shape[0], -1).sum(1).sum() if t.dim() > 1 else t.sum()


def det_norm(t: torch.Tensor) -> torch.Tensor:
    """Frobenius norm with :func:`det_sum`'s fixed order."""
    return det_sum(t * t).sqrt()


def sym(a: torch.Tensor) -> torch.Tensor:
    """Symmetric part ``(A + A^T)/2`` of a square matrix."""
    return 0.5 * (a + a.mT)


def all_finite(*ts: torch.Tensor) -> bool:
    """All entries of every tensor finite. A NaN/Inf entry makes the sum non-finite, so a finite sum settles it with one
    reduction; only a non-finite sum (a bad entry, or overflow of finite ones) needs the elementwise test."""
    return all(bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all()) for t in ts)


_finite = all_finite


def _run_with_timeout(fn, timeout_s: float | None):
    """Run ``fn()``; with a timeout, in a worker thread. A hung call is abandoned (it cannot be killed),
    which is what turns a cuSOLVER hang into a recoverable failure."""
    if timeout_s is None:
        return fn()
    ex = cf.ThreadPoolExecutor(max_workers=1)
    try:
        return ex.submit(fn).result(timeout=timeout_s)
    finally:
        ex.shutdown(wait=False)


def _svd_via_eigh(a: torch.Tensor, full_matrices: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Last-resort SVD from the eigendecomposition of the smaller Gram (float64). Loses accuracy in the
    small singular values (squared condition number) but never raises on finite input."""
    a = a.to(torch.float64)
    m, n = a.shape
    if m >= n:
        w, v = torch.linalg.eigh(sym(a.mT @ a))
        w, v = w.flip(-1).clamp_min(0), v.flip(-1)
        s = w.sqrt()
        safe = torch.where(s > 0, s, torch.ones_like(s))
        u = (a @ v) / safe
        u = torch.where(s > 0, u, torch.zeros_like(u))
        u = orth_complete(u, s > 0, m if full_matrices else n)
        return u, s, v.mT
    u, s, vh = _svd_via_eigh(a.mT, full_matrices)
    return vh.mT, s, u.mT


@pinned
def orth_complete(u: torch.Tensor, valid: torch.Tensor, ncols: int) -> torch.Tensor:
    """Replace the invalid columns of ``u`` (and append columns up to ``ncols``) with an orthonormal
    completion of the valid ones (QR of the valid block padded with a fixed deterministic basis)."""
    m = u.shape[0]
    good = u[:, valid]
    pad = torch.eye(m, dtype=u.dtype, device=u.device)
    q, _ = torch.linalg.qr(torch.cat([good, pad], dim=1))
    q = q[:, :ncols].clone()
    # keep the valid columns themselves (QR may flip their signs); they lead because singular values
    # are sorted descending
    q[:, : good.shape[1]] = good
    return q


@pinned
def safe_svd(a: torch.Tensor, full_matrices: bool = False, *, info: dict[str, Any] | None = None,
             timeout_s: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``A = U diag(S) Vh`` with singular values descending, robust to solver failures.

    Chain (COEC App. B, "timed fallback chain from gesdd to gesvd to CPU double precision"):
    1. ``torch.linalg.svd`` with the default driver (gesdd-like / cuSOLVER auto);
    2. CUDA only: ``driver='gesvd'``;
    3. float64 on the CPU (LAPACK gesdd);
    4. eigendecomposition of the smaller Gram in float64.
    A step counts as failed when it raises, returns non-finite values, or exceeds ``timeout_s``.
    The input copy for step 3 is taken before the GPU attempts, so a hung GPU stream does not block
    it (moving the result back to the GPU may still wait on that stream). Results are returned in
    ``a``'s dtype and device; ``info['svd_driver']`` records which step succeeded.
    """
    if not _finite(a):
        raise ValueError("safe_svd: input contains NaN/Inf")
    a_cpu64 = a.detach().to("cpu", torch.float64) if a.is_cuda else None
    attempts: list[tuple[str, Any]] = [("default", lambda: torch.linalg.svd(a, full_matrices=full_matrices))]
    if a.is_cuda:
        attempts.append(("gesvd", lambda: torch.linalg.svd(a, full_matrices=full_matrices, driver="gesvd")))
    src = a_cpu64 if a_cpu64 is not None else a.detach().to(torch.float64)
    attempts.append(("cpu_float64", lambda: torch.linalg.svd(src, full_matrices=full_matrices)))
    attempts.append(("eigh_float64", lambda: _svd_via_eigh(src, full_matrices)))
    errors: list[str] = []
    for name, fn in attempts:
        try:
            u, s, vh = _run_with_timeout(fn, timeout_s if name in ("default", "gesvd") else None)
        except (RuntimeError, cf.TimeoutError, torch.linalg.LinAlgError) as e:
            errors.append(f"{name}: {type(e).__name__}")
            continue
        if not _finite(u, s, vh):
            errors.append(f"{name}: non-finite")
            continue
        if info is not None:
            info["svd_driver"] = name
            if errors:
                info["svd_errors"] = errors
        return u.to(a.device, a.dtype), s.to(a.device, a.dtype), vh.to(a.device, a.dtype)
    raise RuntimeError("safe_svd: every SVD fallback failed (" + "; ".join(errors) + ")")


@pinned
def safe_eigh(a: torch.Tensor, *, info: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigendecomposition of the symmetric part of ``a`` (ascending eigenvalues), float64 internally,
    falling back to CPU and then to the SVD chain (for PSD input the SVD is the eigendecomposition)."""
    a64 = sym(a.to(torch.float64))
    for name, src in (("default", a64), ("cpu", a64.cpu())):
        try:
            w, v = torch.linalg.eigh(src)
        except (RuntimeError, torch.linalg.LinAlgError):
            continue
        if _finite(w, v):
            if info is not None:
                info["eigh_driver"] = name
            return w.to(a.device), v.to(a.device)
    u, s, _ = safe_svd(a64, info=info)
    # PSD assumption: eigenvalues = singular values; ascending order like eigh
    if info is not None:
        info["eigh_driver"] = "svd"
    return s.flip(-1), u.flip(-1)


def polar(a: torch.Tensor, *, info: dict[str, Any] | None = None) -> torch.Tensor:
    """Orthogonal polar factor ``U_A V_A^T`` of ``A = U_A S_A V_A^T`` (full SVD, so it is square
    orthogonal for square A even when A is rank deficient; any completion gives the same Procrustes
    loss). This is the orthogonal Procrustes maximizer of ``tr(Q^T A)``."""
    u, _, vh = safe_svd(a, full_matrices=True, info=info)
    k = min(a.shape)
    return u[:, :k] @ vh[:k, :]


def orth(a: torch.Tensor, tol: float | None = None) -> torch.Tensor:
    """Orthonormal basis of the column space of ``a`` (thin SVD, columns with
    ``s > tol * s_max`` kept; tol defaults to ``max(m, n) * eps``)."""
    if a.numel() == 0:
        return a
    u, s, _ = safe_svd(a)
    if tol is None:
        tol = max(a.shape) * eps_of(a.dtype)
    r = int((s > tol * s[0]).sum()) if s.numel() and s[0] > 0 else 0
    return u[:, :r]


def newton_schulz_polar(z: torch.Tensor, *, tol: float | None = None, max_iter: int = 100,
                        prescaled: bool = False, info: dict[str, Any] | None = None) -> torch.Tensor:
    """Polar factor of a full-row-rank ``Z`` (``b x k``, ``b <= k``) by the cubic Newton-Schulz
    iteration ``Z <- 1.5 Z - 0.5 Z Z^T Z`` (Higham 2008), matrix products only.

    Converges for singular values in ``(0, sqrt(3))``. Unless ``prescaled`` (caller guarantees
    ``sigma_max < sqrt(3)``), Z is first divided by its Frobenius norm. Iterates until
    ``||Z Z^T - I||_F <= tol`` (default ``sqrt(b) * 100 eps``) or ``max_iter``.
    """
    transpose = z.shape[0] > z.shape[1]
    if transpose:
        z = z.mT
    if not prescaled:
        z = z / det_norm(z)
    b = z.shape[0]
    eye = torch.eye(b, dtype=z.dtype, device=z.device)
    if tol is None:
        tol = (b ** 0.5) * 100 * eps_of(z.dtype)
    it = 0
    err = float("inf")
    for it in range(1, max_iter + 1):  # noqa: B007
        zzt = z @ z.mT
        err = float(det_norm(zzt - eye))
        if err <= tol:
            it -= 1
            break
        z = 1.5 * z - 0.5 * (zzt @ z)
    if info is not None:
        info["ns_polar_iters"] = it
        info["ns_polar_err"] = err  # = ||Z Z^T - I||_F of the returned Z when converged (Z^T Z if transposed)
        info["ns_polar_converged"] = err <= tol and not transpose
    return z.mT if transpose else z


def newton_schulz_inverse(b: torch.Tensor, *, tol: float | None = None, max_iter: int = 100,
                          dtype: torch.dtype | None = None, sigma_max_sq: float | None = None,
                          info: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse of a nonsingular square ``B`` by Newton-Schulz ``X <- X (2I - B X)`` from
    ``X0 = B^T / c`` with ``c >= sigma_max(B)^2`` (then ``I - B X0`` has eigenvalues in ``[0, 1)`` and the
    iteration converges quadratically). ``c`` is ``sigma_max_sq`` when the caller knows a bound (the
    Cayley retraction does), else ``||B||_1 ||B||_inf``. ``dtype`` lets the iteration run in lower
    precision (COEC App. B runs it "in low precision on the GPU"); the result is returned in B's dtype.
    If it has not converged after ``max_iter`` iterations, falls back to ``torch.linalg.inv``."""
    work = b.to(dtype) if dtype is not None else b
    n = work.shape[0]
    eye = torch.eye(n, dtype=work.dtype, device=work.device)
    if tol is None:
        tol = (n ** 0.5) * 100 * eps_of(work.dtype)
    c = sigma_max_sq if sigma_max_sq is not None else (
        torch.linalg.matrix_norm(work, 1) * torch.linalg.matrix_norm(work, float("inf")))
    x = work.mT / c
    err = float("inf")
    it = 0
    for it in range(1, max_iter + 1):  # noqa: B007
        resid = eye - work @ x
        err = float(det_norm(resid))
        if err <= tol:
            break
        x = x + x @ resid  # = X (2I - B X)
    fallback = not (err <= tol * 10) or not _finite(x)
    if fallback:
        with one_thread():
            x = torch.linalg.inv(b)
    if info is not None:
        info["ns_inv_iters"] = it
        info["ns_inv_fallback"] = fallback
    return x.to(b.dtype)


def gram_polar(z: torch.Tensor, *, info: dict[str, Any] | None = None) -> torch.Tensor:
    """Polar factor ``(Z Z^T)^(-1/2) Z`` of a well-conditioned full-row-rank ``Z`` (``b x k``, ``b <= k``; the
    transpose otherwise) from the eigendecomposition of its ``b x b`` Gram ``Z Z^T = E diag(l) E^T``.

    Cost: two ``b x b x k`` products and one ``b x b`` eigh (pinned), against two products per Newton-Schulz
    iteration (:func:`newton_schulz_polar`, 4-8 iterations from singular values in ``[1, sqrt 2]``). Forming the
    Gram squares the condition number, so this is for ``Z`` whose singular values lie in a narrow band, such as
    a retraction step ``R - step`` (:func:`polar_retract`: ``l`` in ``[1, 2]``): a backward-stable eigh then gives
    ``||Q Q^T - I||_F`` of order ``sqrt(b) eps max(l) / min(l)``. Records that number in ``info['polar_err']``
    only when asked (it costs one more product)."""
    transpose = z.shape[0] > z.shape[1]
    if transpose:
        z = z.mT
    with one_thread():  # LAPACK's last bits depend on the thread count
        lam, e = torch.linalg.eigh(sym(z @ z.mT))
    q = ((e * lam.rsqrt()) @ e.mT) @ z
    if info is not None:
        info["polar_err"] = float(det_norm(q @ q.mT - torch.eye(q.shape[0], dtype=q.dtype, device=q.device)))
        info["polar_cond"] = float(lam.max() / lam.min())
    return q.mT if transpose else q


def polar_retract(r: torch.Tensor, step: torch.Tensor, *, info: dict[str, Any] | None = None) -> torch.Tensor:
    """Polar retraction of a row-orthonormal ``R`` (``b x k``) along ``-step``: ``polar(R - step)``.

    For a tangent ``step`` (``step R^T`` skew), ``(R - step)(R - step)^T = I + step step^T`` so the
    singular values lie in ``[1, sqrt(1 + ||step||_2^2)]``; with ``||step||_F <= 1`` (the COEC step cap)
    they are in ``[1, sqrt 2]`` and the polar factor comes from the Gram's eigendecomposition
    (:func:`gram_polar`, condition number <= 2). A longer step (never taken by COEC) falls back to
    Newton-Schulz after Frobenius scaling."""
    z = r - step
    if float(det_norm(step)) < 1.0 + 1e-6:
        return gram_polar(z)
    return newton_schulz_polar(z, prescaled=False, info=info)


def cayley_retract(r: torch.Tensor, direction: torch.Tensor, tau: float, *, ns_dtype: torch.dtype | None = None,
                   info: dict[str, Any] | None = None) -> torch.Tensor:
    """Cayley retraction (Wen & Yin 2012) of a row-orthonormal ``R`` along the tangent ``-direction``.

    Square ``R`` (``k x k``): ``A = (Gamma R^T - R Gamma^T)/2`` (skew, ``b x b``),
    ``R <- (I + tau/2 A)^{-1} (I - tau/2 A) R``. The factor 1/2 makes the first-order move exactly
    ``-tau Gamma`` for tangent Gamma, the same as the polar retraction.
    Rectangular ``R`` (``b < k``): the right-acting form ``W = (R^T Gamma - Gamma^T R)/2``
    (``k x k``), ``R <- R (I + tau/2 W)^{-1} (I - tau/2 W)``.
    The inverse is computed by :func:`newton_schulz_inverse` (in ``ns_dtype`` if given).
    """
    b, k = r.shape
    # I + (tau/2) A with A skew has sigma^2 = 1 + (tau/2)^2 theta^2 <= 1 + (tau/2)^2 ||A||_F^2: a tight
    # Newton-Schulz start, so a handful of iterations reach working precision
    if b == k:
        a = 0.5 * (direction @ r.mT - r @ direction.mT)
        eye = torch.eye(b, dtype=r.dtype, device=r.device)
        bound = 1.0 + (0.5 * tau) ** 2 * float(det_norm(a)) ** 2
        inv = newton_schulz_inverse(eye + 0.5 * tau * a, dtype=ns_dtype, sigma_max_sq=bound, info=info)
        return inv @ ((eye - 0.5 * tau * a) @ r)
    w = 0.5 * (r.mT @ direction - direction.mT @ r)
    eye = torch.eye(k, dtype=r.dtype, device=r.device)
    bound = 1.0 + (0.5 * tau) ** 2 * float(det_norm(w)) ** 2
    inv = newton_schulz_inverse(eye + 0.5 * tau * w, dtype=ns_dtype, sigma_max_sq=bound, info=info)
    return (r @ inv) @ (eye - 0.5 * tau * w)


@pinned
def psd_power(g: torch.Tensor, alpha: float, *, info: dict[str, Any] | None = None) -> torch.Tensor:
    """Spectral power of a symmetric PSD matrix (COEC Sec. 4.4, Gram tempering):
    ``G^alpha = E diag(max(mu_i, 0)^alpha) E^T`` with ``G = E diag(mu) E^T``.

    The input is symmetrized and decomposed in float64; negative eigenvalues (round-off of a PSD
    Gram, or a genuinely indefinite one) are clamped to 0 first. ``alpha == 1`` returns the
    symmetrized input unchanged. Returned in float64."""
    g64 = sym(g.to(torch.float64))
    if alpha == 1.0:
        return g64
    mu, e = safe_eigh(g64, info=info)
    if info is not None:
        info["psd_power_clamped"] = int((mu < 0).sum())
    mu = mu.clamp_min(0) ** alpha
    return sym((e * mu) @ e.mT)


def _plus_diag(a: torch.Tensor, j: float) -> torch.Tensor:
    """``A + j I`` without an identity matrix (one n x n copy, not two)."""
    out = a.clone()
    out.diagonal().add_(j)
    return out


@pinned
def solve_spd(a: torch.Tensor, rhs: torch.Tensor, *, side: str = "right", max_jitter_tries: int = 6,
              info: dict[str, Any] | None = None) -> torch.Tensor:
    """Solve with a symmetric positive (semi)definite ``A``: ``X A = rhs`` (``side='right'``, rhs is
    ``m x n``) or ``A X = rhs`` (``side='left'``). float64 internally, result in rhs's dtype.

    Chain: Cholesky -> Cholesky of ``A + j I`` with ``j = 1e-12 * mean(diag A) * 100^t`` for
    ``t = 0..max_jitter_tries-1`` -> minimum-norm least squares (``lstsq`` with gelsd on CPU).
    ``info`` records the method, the jitter and the condition estimate ``max/min`` of diag(L)^2.
    """
    a64 = sym(a.to(torch.float64))
    b64 = rhs.to(torch.float64)
    if side == "right":
        b64 = b64.mT
    elif side != "left":
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    n = a64.shape[0]
    if n == 0:
        x = torch.zeros_like(b64)
        return (x.mT if side == "right" else x).to(rhs.dtype)
    scale = float(a64.diagonal().abs().mean()) or 1.0
    method, jitter, x = None, 0.0, None
    for t in range(-1, max_jitter_tries):
        jitter = 0.0 if t < 0 else 1e-12 * scale * (100.0 ** t)
        chol, err = torch.linalg.cholesky_ex(_plus_diag(a64, jitter) if jitter else a64)
        if int(err) == 0 and _finite(chol):
            x = torch.cholesky_solve(b64, chol)
            if _finite(x):
                method = "cholesky" if jitter == 0 else "cholesky_jitter"
                if info is not None:
                    d = chol.diagonal() ** 2
                    info["cond_est"] = float(d.max() / d.min()) if float(d.min()) > 0 else float("inf")
                break
            x = None
    if x is None:
        a_cpu, b_cpu = a64.cpu(), b64.cpu()
        x = torch.linalg.lstsq(a_cpu, b_cpu, driver="gelsd").solution.to(a64.device)
        method, jitter = "lstsq", 0.0
    if info is not None:
        info["solve_method"] = method
        info["solve_jitter"] = jitter
    x = x.mT if side == "right" else x
    return x.to(rhs.dtype)
