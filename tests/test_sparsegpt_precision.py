"""SparseGPT in float32 (issue 29): the same masks and layer objective as float64 within the bound the runtime probe
guarantees, and the float64 fallback where float32 is not accurate enough.

Error argument. With a fixed mask, SparseGPT's sequence of OBS updates is the exact least-squares compensation, i.e.
the minimizer of ``f(dW) = tr(dW H dW^T)`` over the unmasked entries; the float32 result is a feasible point (its
masked entries are exact zeros) whose update differs from the minimizer by ``e``, so ``f`` exceeds the minimum by
``e H e^T`` only: quadratic in the relative error. The probe accepts a float32 ``U`` when ``||U H U^T - I|| <=
PROBE_TOL`` (1e-2) on its vectors, so the update's relative error in the H-norm is ``O(PROBE_TOL)`` and the objective
moves by ``O(PROBE_TOL^2) = 1e-4`` relative. A mask can differ only where two saliencies agree to within their
relative error: each such swap moves the objective by at most that share of the swapped saliency, so with flips the
bound is first order, ``PROBE_TOL``.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from secateur.budgets.masks import deletion_count
from secateur.compensate import sparsegpt
from secateur.compensate.sparsegpt import sparsegpt_prune
from secateur.methods.unstructured import UnstructuredConfig, prune_unstructured
from secateur.models.adapters import get_adapter
from secateur.testing import random_ids, tiny_model


def _problem(seed: int, rows: int, cols: int, outlier: float, tokens: int):
    """A layer with correlated inputs and a few outlier features (the heavy-tailed activations of real LLMs)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(tokens, cols, generator=g, dtype=torch.float64)
    X = X + 0.5 * torch.randn(tokens, 1, generator=g, dtype=torch.float64)
    X[:, : max(1, cols // 64)] *= outlier
    return torch.randn(rows, cols, generator=g, dtype=torch.float64) * 0.02, (X.T @ X).to(torch.float32)


def _objective(new: torch.Tensor, W: torch.Tensor, H: torch.Tensor) -> float:
    dW = new.to(torch.float64) - W
    return float(torch.trace(dW @ H.to(torch.float64) @ dW.T))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 48), cols_blocks=st.integers(1, 6),
       outlier=st.sampled_from([1.0, 10.0, 100.0]), pattern=st.sampled_from([None, (2, 4), (4, 8)]),
       under=st.booleans())
def test_float32_solve_matches_float64_within_the_probe_bound(seed, rows, cols_blocks, outlier, pattern, under):
    cols = 32 * cols_blocks
    W, H = _problem(seed, rows, cols, outlier, tokens=cols // 2 if under else 3 * cols)  # under: a singular Gram
    n, m = pattern or (0, 0)
    count = None if m else (lambda k: deletion_count(k, 0.5))
    info32: dict = {}
    new32, mask32 = sparsegpt_prune(W, H, count, n, m, blocksize=64, dtype=torch.float32, info=info32)
    new64, mask64 = sparsegpt_prune(W, H, count, n, m, blocksize=64, dtype=torch.float64)
    assert not new32[mask32].any() and not new64[mask64].any()
    if info32["precision"] == "float64":  # the fallback is the float64 solve itself
        assert torch.equal(new32, new64) and torch.equal(mask32, mask64)
        return
    assert new32.dtype == torch.float32 and info32["probe_residual"] <= sparsegpt.PROBE_TOL
    f32, f64 = _objective(new32, W, H), _objective(new64, W, H)
    flips = int((mask32 != mask64).sum())
    tol = sparsegpt.PROBE_TOL if flips else sparsegpt.PROBE_TOL ** 2
    assert abs(f32 - f64) <= tol * f64 + 1e-12, (f32, f64, flips)


def test_an_inaccurate_float32_factor_falls_back_to_float64():
    """A Gram conditioned beyond float32 (1e10, no damping): the probe rejects the float32 factor (or its Cholesky
    fails) and the result is bit for bit the float64 solve."""
    g = torch.Generator().manual_seed(1)
    Q, _ = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=torch.float64))
    H = (Q * torch.logspace(0, 10, 64, dtype=torch.float64)) @ Q.T
    W = torch.randn(8, 64, generator=g, dtype=torch.float64)
    info: dict = {}
    new, mask = sparsegpt_prune(W, H, lambda k: deletion_count(k, 0.5), percdamp=0.0, info=info)
    assert info["precision"] == "float64"
    ref, ref_mask = sparsegpt_prune(W, H, lambda k: deletion_count(k, 0.5), percdamp=0.0, dtype=torch.float64)
    assert torch.equal(new, ref) and torch.equal(mask, ref_mask)


def test_the_run_reports_each_solves_precision():
    torch.manual_seed(0)
    m = tiny_model("llama")
    res = prune_unstructured(m, get_adapter(m), random_ids(2, 16, seed=0),
                             UnstructuredConfig(method="sparsegpt", sparsity=0.5), progress=False)
    prec = res.details["solver_precision"]
    assert prec["float32"] + len(prec["float64"]) == len(res.masks)
