"""Wanda's per-weight score (Sun et al. 2024, Eq. 1): ``S_ij = |W_ij| * ||X_j||_2``, lower = pruned first.

``||X_j||_2`` is the input feature's norm over every calibration token, read from a
:class:`secateur.calib.stats.SumSq` of the projection's input (the calibration engine's group accumulator).
Masks from the scores: :mod:`secateur.budgets.masks`.
"""

from __future__ import annotations

import torch

from secateur.calib.stats import SumSq


def wanda_scores(W: torch.Tensor, sumsq: SumSq) -> torch.Tensor:
    """``S_ij = |W_ij| * ||X_j||_2`` (Wanda Eq. 1), float64."""
    # in place on the float64 copy: 8 bytes per weight held at once, not 16
    return W.detach().abs().to(torch.float64).mul_(sumsq.sumsq.sqrt().to(W.device).unsqueeze(0))
