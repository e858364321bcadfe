"""CORP's ranking scores (seed 002, Sec. 3.3; spec corp.md Sec. 2): pure functions of weights and statistics.

The compensation (ridge solves and folds) lives in :mod:`secateur.compensate.corp`; the per-sequence Q/K Grams
these scores read are :class:`secateur.calib.stats.PerSampleGram`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from secateur.errors import SecateurError, check_fraction


def corp_mlp_scores(w_down: torch.Tensor, energy: torch.Tensor, *,
                    weight_factor: Literal["out_col", "in_row_out_col", "activation", "magnitude"] = "out_col",
                    w_in: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """CORP MLP channel score (CORP Sec. 3.3, "combined", the paper's default):
    ``score_i = E[h_i^2] * ||W2[:, i]||_2``. ``energy`` = ``E[h_i^2]`` (diag of the hidden second
    moment). ``weight_factor='in_row_out_col'`` is the public code's variant (corp.md [A1]):
    ``E[h_i^2] * (sum over w_in of ||W_in[i, :]||_2) * ||W2[:, i]||_2`` (w_in = [fc1] or [gate, up]).
    Fig. 5's ablations: ``'activation'`` ``E[h_i^2]`` alone, ``'magnitude'`` ``||W2[:, i]||_2`` alone."""
    e = energy.to(torch.float64)
    col = w_down.to(torch.float64).norm(dim=0)
    if e.shape != col.shape:
        raise SecateurError(f"energy has {e.numel()} channels but down_proj has {col.numel()} columns")
    if weight_factor == "out_col":
        return e * col
    if weight_factor == "activation":
        return e
    if weight_factor == "magnitude":
        return col
    if weight_factor == "in_row_out_col":
        if not w_in:
            raise SecateurError("weight_factor='in_row_out_col' needs the MLP input projections (w_in=)")
        rows = sum(w.to(torch.float64).norm(dim=1) for w in w_in)
        return e * rows * col
    raise SecateurError(f"unknown weight_factor {weight_factor!r}")


def corp_qk_scores(q_grams: torch.Tensor, k_grams: torch.Tensor) -> torch.Tensor:
    """CORP Q/K dim score (CORP Sec. 3.3; corp.md [A2] reading (a)):
    ``s_j = mean_b ||Q_b[:, j]||^2 ||K_b[:, j]||^2 = mean_b A_b[j, j] C_b[j, j]`` - the energy of the
    removed rank-1 logit term ``Q_b[:, j] K_b[:, j]^T``. Inputs ``[N, d_h, d_h]``."""
    return (q_grams.diagonal(dim1=-2, dim2=-1) * k_grams.diagonal(dim1=-2, dim2=-1)).mean(0)


def corp_keep(scores: torch.Tensor, ratio: float, *, min_keep: int = 0) -> torch.Tensor:
    """Kept indices (ascending) after pruning ``floor(ratio * n)`` lowest scores (corp.md Sec. 2 [C]),
    never keeping fewer than ``min(min_keep, n)`` (CORP guards: 64 MLP channels, 8 Q/K dims).
    Ties: among equal scores the lower index is kept (stable descending sort)."""
    check_fraction(ratio, "pruning ratio", unit="units")  # [0, 1): a pool is never emptied
    n = scores.numel()
    n_keep = max(n - int(ratio * n), min(min_keep, n))
    order = torch.argsort(scores.flatten(), descending=True, stable=True)
    return torch.sort(order[:n_keep]).values


def corp_qk_kept(q_stats, k_stats, n_heads: int, n_kv_heads: int, ratio: float, min_qk_dim: int = 8
                 ) -> torch.Tensor:
    """Kept Q/K dims per KV head ``[n_kv_heads, d_s]`` (CORP Sec. 3.3; corp.md Sec. 2): a KV head's dims are shared
    by its query heads, scored by the sum of their :func:`corp_qk_scores`, ``d_s = d_h - floor(ratio d_h)`` kept
    (at least ``min_qk_dim``; :func:`corp_keep`). ``q_stats`` / ``k_stats``: the projections' per-head output
    Grams (:class:`secateur.calib.stats.PerSampleGram`)."""
    g = n_heads // n_kv_heads
    rows = []
    for kv in range(n_kv_heads):
        score = sum(corp_qk_scores(q_stats.head(h), k_stats.head(kv)) for h in range(kv * g, (kv + 1) * g))
        rows.append(corp_keep(score, ratio, min_keep=min_qk_dim))
    return torch.stack(rows)
