"""QK-Wanda: exact single-deletion costs of query/key weights under a QK-product reconstruction loss.

Paper: Ilin & Richtárik, "QK-Wanda: Coupling Queries and Keys for Unstructured Pruning" (seed 003).

Setting (Eqs. 2/11): for calibration sequence ``s`` with input ``X^(s)`` (``d x T_s``, the shared input of
q_proj/k_proj), ``Q^(h,s) = W^{Q(h)} X + b^{Q(h)} 1^T`` and ``K^(g,s) = W^{K(g)} X + b^{K(g)} 1^T``
(pre-RoPE, ``m x T``). Query head ``h`` reads key head ``g = h // (H_Q/H_K)`` (HF ``repeat_kv`` layout); the
group ``H_g`` is the set of query heads of key head ``g``. Sequences are independent: products are formed
within a sequence and the per-sequence costs are averaged with weight ``1/N`` (never a product of
averages). The ``1/sqrt(m)`` attention scale is omitted (a common factor; the public code multiplies
all scores by ``1/m``; rankings are identical). Every score is ``S_ij = W_ij^2 * G_ij``, where the
*interaction factor* ``G`` depends on the data and on the *opposite* projection (weights and bias) only.

Base (unmasked, pre-RoPE; Eqs. 31-32, = Eq. 7 for one sequence)::

    S^{Q(h)}_ij = W^2 (1/N) sum_s ||X_j:||^2 ||K^(g)_i:||^2
    S^{K(g)}_ij = W^2 (1/N) sum_s ||X_j:||^2 sum_{h in H_g} ||Q^(h)_i:||^2

Switches (App. B, C, O, P), all combinable:

* **M** causal pairs ``u <= t`` (Eqs. 14-15 via the prefix/suffix accumulators of Eqs. 23-26)::

    S^Q = W^2 (1/N) sum_s sum_t X_jt^2 sum_{u<=t} K_iu^2,   S^K = W^2 (1/N) sum_s sum_u X_ju^2 sum_h sum_{t>=u} Q_it^2

* **R** post-RoPE products with the model's rotary maps (Eqs. 37-38 via the 2x2 pair moments of
  Eqs. 42-45 and the diagonal of ``R^T V R``, Eqs. 47-48); without M the pair mask is all ones (App. P).
* **C** row centering (App. O): the error of every query row is centered over its eligible keys.
  Pre-RoPE Eqs. 62-63 with ``nu_t(v) = sum_{u<=t} v_u^2 - (sum_{u<=t} v_u)^2 / t``; post-RoPE Eqs. 67-68
  with 2x2 prefix covariances. Without M the prefixes become full sequences (App. P). Safeguard (App. O):
  the first element is subtracted before prefix sums and negative residuals are clamped to 0.

Design (the accumulator is :class:`secateur.calib.qk.QKStats`): the factors are not functions of
weight-independent moments of X (the per-sequence product
``sum_s e_X^(s) (w^T G^(s) w)`` would need a d x d x d tensor), so :class:`QKStats` takes the block's
current ``W_q, W_k, b_q, b_k`` at construction (the dense weights of the block being calibrated, as in
Alg. 1), computes Q/K from each input chunk itself, and keeps only ``[H_K*m, d]`` float64 factors per
variant. No ``T x T`` matrix is ever formed.

Limits: q/k norms (Qwen3) make the projections non-affine, so the scores are not exact and
:class:`QKStats` refuses them (paper §5: "models with additional nonlinear QK transformations require
separate treatment"). Only the contiguous HF head grouping is supported ([A3]).

API
---
``QKVariant.parse(v) -> QKVariant``; ``VARIANTS = ("base", "M", "R", "C", "MR", "MC", "RC", "MRC")``
``QKStats(Wq, Wk, bq, bk, geometry, variants="base", rope=None, *, dtype=torch.float64, device=None,
chunk_elems=2**16)`` -- accumulator: ``update(x[B,T,d], rope=None)``, ``merge(other)``,
``factors(variant=None) -> (Gq [H_Q*m, d], Gk [H_K*m, d])``, ``scores(variant=None) -> (Sq, Sk)``.
``qk_wanda_scores(Wq, Wk, bq, bk, stats, geometry=None, variant=None) -> (Sq [H_Q*m, d], Sk [H_K*m, d])``
``rope_tables(head_dim, length, theta)``, ``model_rope_tables(model, length)`` (:mod:`secateur.calib.rope`)
``segment_sequences(x, length)`` (:mod:`.qk_segments`)
Budgets (row / matrix / shared Q+K pool / N:M) live in :mod:`secateur.budgets.masks`.
"""

from __future__ import annotations

from typing import Any

import torch

from secateur.calib.qk import VARIANTS, QKStats, QKVariant, check_qk_geometry, same_bias
from secateur.errors import SecateurError

__all__ = ["VARIANTS", "QKStats", "QKVariant", "qk_wanda_scores"]  # the statistics live in secateur.calib.qk


def qk_wanda_scores(Wq: torch.Tensor, Wk: torch.Tensor, bq: torch.Tensor | None, bk: torch.Tensor | None,
                    stats: QKStats, geometry: Any = None,
                    variant: str | QKVariant | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-weight QK-Wanda scores ``(S_Q [H_Q*m, d], S_K [H_K*m, d])`` (lower = prune first), float64.

    ``S = W^2 * G`` with the factors of ``stats`` (see the module docstring for every variant's formula).
    The weights and biases must be the ones ``stats`` was collected with (the scores are exact
    single-deletion costs only then); ``geometry``, when given, must match too.
    """
    if geometry is not None and check_qk_geometry(geometry) != (stats.n_heads, stats.n_kv_heads, stats.head_dim):
        raise SecateurError("geometry does not match the one the QK statistics were collected with")
    conv = dict(dtype=stats.dtype, device=stats.device)
    if (Wq.shape != stats.Wq.shape or Wk.shape != stats.Wk.shape
            or not torch.equal(Wq.detach().to(**conv), stats.Wq) or not torch.equal(Wk.detach().to(**conv), stats.Wk)
            or not same_bias(None if bq is None else bq.detach().to(**conv), stats.bq)
            or not same_bias(None if bk is None else bk.detach().to(**conv), stats.bk)):
        raise SecateurError("the q/k weights or biases differ from those the QK statistics were collected with")
    return stats.scores(variant)
