"""Budgets: turn scores into prune masks (True = pruned). Lower score = pruned first.

Rounding: a group of n weights at sparsity rho loses ``ceil(rho n)`` (default) or ``floor(rho n)``.
Ties: stable ascending sort on the flat (row-major) index, so the lower index is pruned first.
"""

from __future__ import annotations

import math

import torch

from secateur.errors import SecateurError


def count(rho: float, n: int, rounding: str = "ceil") -> int:
    """Number of weights removed from a group of ``n``; the 1e-9 guards float noise such as 0.3 * 10."""
    if not 0.0 <= rho < 1.0:
        raise SecateurError(f"sparsity must be in [0, 1), got {rho}")
    k = math.ceil(rho * n - 1e-9) if rounding == "ceil" else math.floor(rho * n + 1e-9)
    return min(max(k, 0), n)


def prune_mask(scores: torch.Tensor, rho: float, budget: str = "row", rounding: str = "ceil",
               pattern: tuple[int, int] | None = None) -> torch.Tensor:
    """Mask for a 2-D score matrix: ``row`` (per output row), ``matrix`` (one pool), or N:M per row."""
    rows, cols = scores.shape
    mask = torch.zeros_like(scores, dtype=torch.bool)
    if pattern is not None:
        n, m = pattern
        if cols % m:
            raise SecateurError(f"N:M pattern {n}:{m} does not divide the input width {cols}")
        g = scores.reshape(rows, cols // m, m)
        idx = torch.argsort(g, dim=-1, stable=True)[..., : m - n]
        return mask.reshape(rows, cols // m, m).scatter_(-1, idx, True).reshape(rows, cols)
    if budget == "row":
        k = count(rho, cols, rounding)
        idx = torch.argsort(scores, dim=1, stable=True)[:, :k]
        return mask.scatter_(1, idx, True)
    if budget == "matrix":
        k = count(rho, scores.numel(), rounding)
        flat = mask.view(-1)
        flat[torch.argsort(scores.reshape(-1), stable=True)[:k]] = True
        return mask
    raise SecateurError(f"unknown budget {budget!r}")
