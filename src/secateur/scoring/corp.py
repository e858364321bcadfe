"""CORP's ranking scores (seed 002, Sec. 3.3; spec corp.md Sec. 2): pure functions of weights and statistics.

The compensation (ridge solves and folds) lives in :mod:`secateur.compensate.corp`; the per-sequence Q/K Grams
these scores read are :class:`secateur.calib.stats.PerSampleGram`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from secateur.errors import SecateurError


def corp_mlp_scores(w_down: torch.Tensor, energy: torch.Tensor, *,
                    weight_factor: Literal["out_col", "in_row_out_col"] = "out_col",
                    w_in: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """CORP MLP channel score (CORP Sec. 3.3, "combined", the paper's default):
    ``score_i = E[h_i^2] * ||W2[:, i]||_2``. ``energy`` = ``E[h_i^2]`` (diag of the hidden second
    moment). ``weight_factor='in_row_out_col'`` is the public code's variant (corp.md [A1]):
    ``E[h_i^2] * (sum over w_in of ||W_in[i, :]||_2) * ||W2[:, i]||_2`` (w_in = [fc1] or [gate, up])."""
    e = energy.to(torch.float64)
    col = w_down.to(torch.float64).norm(dim=0)
    if e.shape != col.shape:
        raise SecateurError(f"energy has {e.numel()} channels but down_proj has {col.numel()} columns")
    if weight_factor == "out_col":
        return e * col
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
