"""SparseGPT (Frantar & Alistarh, 2023): OBS-style pruning with weight reconstruction.

For a layer ``W [out, in]`` with input Hessian proxy ``H = X X^T`` (``secateur.calib.stats.Gram``):

* damp: ``H += percdamp * mean(diag H) * I``; dead inputs (``H_jj = 0``) get ``H_jj = 1``, ``W[:, j] = 0``;
* ``U = chol(H^-1)^T`` (upper Cholesky factor of the inverse; :func:`secateur.linalg.chol_inverse_upper`: one
  Cholesky of the reversed ``H`` and a triangular inverse, half the arithmetic of inverting then factorizing);
* columns in blocks of ``B = 128``; at the start of each block the mask is chosen by the OBS saliency
  ``w_ij^2 / U_jj^2`` - unstructured: the ``k`` lowest entries of the whole ``out x B`` block, ``k`` =
  ``deletions(out * B)``, the count the method gives (its budget rule: ``budgets.masks.deletion_count``,
  ``ceil``/``floor`` of ``rho * out * B``); N:M: per row, the ``M - N`` lowest of each group of ``M`` columns;
* per column: ``err = (w_j - q_j) / U_jj``, ``W[:, j+1:] -= err U[j, j+1:]`` (OBS update, paper Eq. 3-5),
  with the lazy batched update of later blocks; inside a block the same update is applied in sub-blocks of
  ``SUB = 16`` columns (rank-1 updates within the sub-block, one matrix product ``E_sub U[sub, rest]`` for the rest
  of the block): the same sums in another order, so the result differs from the column-by-column loop only by
  rounding (tested in float64: ~1e-14 relative), about twice as fast on the widths of small models.

Threads: the whole solve runs on one thread (``@pinned``). Its thousands of small per-column kernels lose more to a
second thread's synchronization than they gain, and much more when another process holds a core: measured beside
one busy core, a 896 x 4864 solve took 17.9 s at 2 threads and 2.9 s at 1. The process's threads are used instead
by solving a group's projections side by side (q/k/v, gate/up: ``calib.dist.owned_map(workers=...)``), each solve
on its own thread, so the result is the same at any thread count.

Precision: the factorization and the loop run in float32 (as the reference implementation and llm-compressor do;
2-3x the float64 rate on a CPU), the damping and dead-input rule in float64 first. The float32 ``U`` is accepted
only when its Cholesky succeeds and a probe of ``E = U H U^T - I`` on 4 fixed random vectors (float64, O(d^2)) stays
within ``PROBE_TOL = 1e-2``; otherwise the whole solve runs in float64 (``info['precision']``, the report's
``details.solver_precision``). Why that suffices: with a fixed mask the OBS sequence is the exact least-squares
compensation, so an update error ``e`` raises the layer objective ``tr(dW H dW^T)`` by ``e H e^T`` only - second order,
about ``PROBE_TOL^2`` relative; masks can differ only where two saliencies agree to within the float32 error
(tests/test_sparsegpt_precision.py; generated layers: objectives within 2e-6 relative, no mask flips). Where the
saliencies are dense with near-ties - Qwen2.5-0.5B calibrated on 4096 tokens, fewer than down_proj's 4864 inputs -
1.9% of block 0's mask entries differ from the float64 solve's, at equal perplexity (results/speed/solver-speed.md).

Removing a single weight ``w_j`` with the optimal compensation raises ``tr(dW H dW^T)`` by exactly
``w_j^2 / [H^-1]_jj`` (the OBS closed form) - tested.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from secateur.budgets.masks import lowest_k_flat
from secateur.errors import SecateurError
from secateur.linalg import chol_inverse_upper, one_thread, pinned


@pinned
def sparsegpt_prune(W: torch.Tensor, H: torch.Tensor, deletions: Callable[[int], int] | None, n: int = 0,
                    m: int = 0, blocksize: int = 128, percdamp: float = 0.01, dtype: torch.dtype = torch.float32,
                    info: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(W_new, mask)`` with ``mask`` True where pruned. ``deletions(size)``: how many of a block's
    ``size`` weights to delete (unstructured; None with an N:M pattern); ``n:m`` = keep n of every m (0:0 =
    off). The solver decides which weights and how the rest compensate; how many is the method's. ``dtype``: the
    factorization's and the OBS loop's precision (float32 falls back to float64 where it is not accurate enough:
    :func:`_factor`); ``info`` receives ``precision`` and the float32 factor's ``probe_residual``."""
    if not m and deletions is None:
        raise SecateurError("sparsegpt_prune needs a deletion count (unstructured) or an n:m pattern")
    rows, cols = W.shape
    if m and cols % m:
        raise SecateurError(f"N:M pattern {n}:{m} does not divide the input width {cols}")
    H = H.detach().to(W.device, torch.float64).clone()  # statistics live on the CPU, W where its block is
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    H.diagonal().add_(percdamp * torch.mean(torch.diag(H)))
    U, dtype = _factor(H, dtype, info)
    W = W.detach().to(dtype).clone()
    W[:, dead] = 0.0
    mask = torch.zeros_like(W, dtype=torch.bool)
    sub = _sub_block(blocksize, m)
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        E1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        d = torch.diag(U1)
        if not m:
            sal = (W1**2 / d**2).flatten()
            m1 = lowest_k_flat(sal, deletions(sal.numel())).view_as(W1)  # = a stable argsort's first k
        else:
            m1 = torch.zeros_like(W1, dtype=torch.bool)
        for s0 in range(0, i2 - i1, sub):  # the OBS loop in sub-blocks: rank-1 updates stay inside one
            s1 = min(s0 + sub, i2 - i1)     # sub-block, the rest of the block gets one product per sub-block
            for i in range(s0, s1):
                if m and i % m == 0:
                    sal = W1[:, i:i + m] ** 2 / d[i:i + m] ** 2
                    idx = torch.argsort(sal, dim=1, stable=True)[:, : m - n]
                    m1.scatter_(1, i + idx, True)
                w = W1[:, i]
                q = torch.where(m1[:, i], torch.zeros_like(w), w)
                Q1[:, i] = q
                err = (w - q) / d[i]
                W1[:, i:s1] -= err.unsqueeze(1) * U1[i, i:s1].unsqueeze(0)
                E1[:, i] = err
            if s1 < i2 - i1:
                W1[:, s1:] -= E1[:, s0:s1] @ U1[s0:s1, s1:]
        W[:, i1:i2] = Q1
        mask[:, i1:i2] = m1
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    return W, mask


PROBE_TOL = 1e-2  # float32 U accepted when ||U H U^T v - v|| <= PROBE_TOL ||v|| on every probe (module docstring)
PROBES = 4


def _factor(H: torch.Tensor, dtype: torch.dtype, info: dict | None) -> tuple[torch.Tensor, torch.dtype]:
    """``U`` in ``dtype`` when it is accurate: for float32, the Cholesky must succeed and ``E = U H U^T - I``
    (measured in float64 on ``PROBES`` fixed random vectors, O(d^2) each) must stay within ``PROBE_TOL``; else the
    float64 factor. Returns ``(U, the dtype the loop runs in)``."""
    if dtype == torch.float32:
        try:
            U = chol_inverse_upper(H.to(torch.float32))
        except torch.linalg.LinAlgError:
            U = None
        if U is not None and (res := _probe_residual(U, H)) <= PROBE_TOL:
            if info is not None:
                info.update(precision="float32", probe_residual=res)
            return U, torch.float32
        if info is not None:
            info.update(precision="float64", probe_residual=None if U is None else res)
    elif dtype != torch.float64:
        raise SecateurError(f"sparsegpt_prune runs in float32 or float64, not {dtype}")
    elif info is not None:
        info.update(precision="float64")
    # pinned to one thread inside: LAPACK's result depends on it; the OBS loop's GEMMs do not
    return chol_inverse_upper(H), torch.float64


def _probe_residual(U: torch.Tensor, H: torch.Tensor) -> float:
    """``max_v ||U H U^T v - v|| / ||v||`` over ``PROBES`` fixed Gaussian ``v`` (float64; seeded: the same on
    every machine and process), an estimate of ``||U H U^T - I||_2`` from below within a small factor."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(H.shape[0], PROBES, generator=g, dtype=torch.float64).to(H.device)
    U64 = U.to(torch.float64)
    with one_thread():  # a decision (float32 or not) must not depend on the thread count's last bits
        r = U64 @ (H @ (U64.T @ v)) - v
    return float((r.norm(dim=0) / v.norm(dim=0)).max())


SUB = 16  # columns per sub-block of the OBS loop (a multiple of every N:M group size in use: 2:4, 4:8, 8:16)


def _sub_block(blocksize: int, m: int) -> int:
    """Sub-block width: ``SUB``, widened to a multiple of the N:M group ``m`` (a group's mask is chosen from its
    columns fully updated, so a group must not straddle two sub-blocks)."""
    sub = min(SUB, blocksize)
    return sub if not m or sub % m == 0 else m * max(1, sub // m)
