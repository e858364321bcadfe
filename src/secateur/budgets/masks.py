"""Pruning budgets: turn score tensors (lower = prune first) into boolean masks (``True`` = pruned).

Generic (Wanda, magnitude, QK-Wanda, ...). Budgets (QK-Wanda paper §3.3, App. E.5):

``row``      each output row of a ``[out, in]`` matrix loses ``round(rho * in)`` weights (Wanda's group)
``matrix``   one pool per matrix (``separate`` in QK-Wanda): ``round(rho * numel)``
``shared``   one pool over several matrices (QK-Wanda: W_Q and W_K of a block): ``round(rho * sum numel)``
``N:M``      per row, in every group of ``M`` consecutive inputs, the ``M - N`` lowest are pruned (``N`` kept)

Counts: ``round`` is ``ceil`` by default (the QK-Wanda paper's convention, App. E.5) or ``floor`` (the
original Wanda code). ``rho * n`` is evaluated exactly in decimal on the shortest representation of
``rho`` (``repr``), so ``ceil(0.3 * 10) = 3`` -- naive float arithmetic gives 4 (0.3*10 = 3.0000000000000004).

Ties (App. E.5, exactly): scores are sorted ascending with a *stable* sort over the pool's flat order,
so among equal scores the one earlier in that order is pruned first: within a row by increasing column;
in a matrix pool in row-major order; in a shared pool the matrices in the order given (QK-Wanda passes
``[S_Q, S_K]``: all Q entries, row-major, before all K entries); in an N:M group by increasing column.
No per-matrix or per-head normalization or quota is applied to pooled scores.

API: ``deletion_count(n, rho, rounding)`` (alias ``count(rho, n, rounding)``), ``row_mask``,
``matrix_mask``, ``shared_mask``, ``nm_mask``, ``prune_mask(scores, rho, budget, rounding, pattern)`` (one matrix) and
``prune_masks(scores_list, rho, budget, rounding, pattern)`` (several; ``shared`` pools them);
``budget_counts(shapes, rho, budget, rounding)`` and ``lowest_k_masks(scores, budget, k)``: the same
selection for given per-pool counts (QK-Wanda's progressive re-scoring).
``rho`` must lie in ``[0, 1)``; violations raise :class:`SecateurError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

import torch

from secateur.errors import SecateurError, check_fraction

BUDGETS = ("row", "matrix", "separate", "shared")
ROUNDINGS = ("ceil", "floor")


def deletion_count(n: int, rho: float, rounding: str = "ceil") -> int:
    """Weights to delete from a pool of ``n``: ``ceil(rho n)`` or ``floor(rho n)``, exact in decimal."""
    r = check_fraction(rho)  # [0, 1): a pool is never emptied
    if rounding not in ROUNDINGS:
        raise SecateurError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")
    exact = Decimal(repr(r)) * int(n)
    k = int(exact.to_integral_value(rounding=ROUND_CEILING if rounding == "ceil" else ROUND_FLOOR))
    return min(int(n), max(0, k))


def count(rho: float, n: int, rounding: str = "ceil") -> int:
    """``deletion_count`` with the argument order used by :mod:`secateur.methods.unstructured` callers."""
    return deletion_count(n, rho, rounding)


def _check_scores(s: torch.Tensor, what: str) -> None:
    if not torch.is_tensor(s):
        raise SecateurError(f"{what} must be a tensor")
    if s.is_floating_point() and bool(torch.isnan(s).any()):
        raise SecateurError(f"{what} contain NaN; cannot rank them")


#: entries of a row-budget selection handled at once (:func:`lowest_k_rows`); any value gives the same masks
ROW_CHUNK_ELEMENTS = 1 << 22


def lowest_k_rows(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the ``k`` lowest entries of every row of ``scores [r, n]``, ties to the lower index.

    Exactly the first ``k`` of a stable ascending sort, without sorting: the k-th smallest value ``v``
    (selection, O(n)) takes every entry ``< v``, then the first ``k - #(< v)`` entries ``== v`` in index
    order. About 2x faster than a stable argsort on a CPU. Scores must not contain NaN (checked by callers).

    Rows are selected :data:`ROW_CHUNK_ELEMENTS` entries at a time: each row's mask depends on that row alone, so
    the result is the same, and the transients (kthvalue's copy of the values and its int64 indices, the int64
    tie count: 16 bytes per entry) stay a few MiB instead of twice the scores (0.7 GiB at 7B widths). A single
    row (:func:`lowest_k_flat`) is one chunk whatever its length.
    """
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if k <= 0:
        return mask
    if k >= scores.shape[1]:
        return mask.fill_(True)
    step = max(1, ROW_CHUNK_ELEMENTS // scores.shape[1])
    for r0 in range(0, scores.shape[0], step):
        s = scores[r0:r0 + step]
        v = torch.kthvalue(s, k, dim=1, keepdim=True).values
        less = s < v
        eq = s == v
        need = k - less.sum(1, keepdim=True)
        mask[r0:r0 + step] = less | (eq & (eq.cumsum(1) <= need))
    return mask


def lowest_k_flat(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the ``k`` lowest entries of a 1-D tensor, ties to the lower index."""
    return lowest_k_rows(flat.reshape(1, -1), k).reshape(flat.shape)


def row_mask(scores: torch.Tensor, rho: float, rounding: str = "ceil") -> torch.Tensor:
    """Every row of ``scores [out, in]`` loses its ``deletion_count(in, rho)`` lowest entries."""
    _check_scores(scores, "scores")
    if scores.dim() != 2:
        raise SecateurError(f"row budgets need [out, in] scores, got shape {tuple(scores.shape)}")
    return lowest_k_rows(scores, deletion_count(scores.shape[1], rho, rounding))


def matrix_mask(scores: torch.Tensor, rho: float, rounding: str = "ceil") -> torch.Tensor:
    """One pool over the whole tensor (row-major order): its ``deletion_count(numel, rho)`` lowest."""
    _check_scores(scores, "scores")
    k = deletion_count(scores.numel(), rho, rounding)
    return lowest_k_flat(scores.reshape(-1), k).reshape(scores.shape)


def shared_mask(scores: Sequence[torch.Tensor], rho: float, rounding: str = "ceil") -> list[torch.Tensor]:
    """One pool over several tensors, concatenated row-major in the given order (QK-Wanda: ``[S_Q, S_K]``);
    deletes ``deletion_count(sum numel, rho)`` entries in total. No per-tensor quota."""
    if len(scores) == 0:
        raise SecateurError("a shared budget needs at least one score tensor")
    for i, s in enumerate(scores):
        _check_scores(s, f"scores[{i}]")  # before the cast (an integer score tensor is checked as such)
    dev = scores[0].device
    dtypes = {s.dtype for s in scores}
    dt = torch.float64 if len(dtypes) > 1 else scores[0].dtype
    same = [s.to(device=dev, dtype=dt) for s in scores]
    pooled = lowest_k_masks(same, "shared", deletion_count(sum(s.numel() for s in same), rho, rounding))
    return [m.to(s.device) for m, s in zip(pooled, scores)]


def nm_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """N:M: in every row, each group of ``m`` consecutive inputs keeps ``n`` and loses its ``m - n`` lowest."""
    _check_scores(scores, "scores")
    if scores.dim() != 2:
        raise SecateurError(f"N:M patterns need [out, in] scores, got shape {tuple(scores.shape)}")
    if not (isinstance(n, int) and isinstance(m, int)) or not 0 < n < m:
        raise SecateurError(f"N:M pattern {n}:{m} needs integers 0 < N < M")
    rows, cols = scores.shape
    if cols % m:
        raise SecateurError(f"N:M pattern {n}:{m} does not divide the input width {cols}")
    groups = scores.reshape(rows, cols // m, m)
    mask = torch.zeros(groups.shape, dtype=torch.bool, device=scores.device)
    step = max(1, ROW_CHUNK_ELEMENTS // cols)  # rows at a time, as lowest_k_rows: the argsort's int64 stays small
    for r0 in range(0, rows, step):
        mask[r0:r0 + step].scatter_(2, torch.argsort(groups[r0:r0 + step], dim=2, stable=True)[..., : m - n], True)
    return mask.reshape(rows, cols)


def prune_mask(scores: torch.Tensor, rho: float, budget: str = "row", rounding: str = "ceil",
               pattern: tuple[int, int] | None = None) -> torch.Tensor:
    """Mask of one matrix: an N:M ``pattern`` (``rho``/``budget`` ignored), else a ``row`` or ``matrix``
    (= ``separate``) budget."""
    if pattern is not None:
        return nm_mask(scores, *pattern)
    if budget == "row":
        return row_mask(scores, rho, rounding)
    if budget in ("matrix", "separate"):
        return matrix_mask(scores, rho, rounding)
    raise SecateurError(f"budget for one matrix must be row or matrix, got {budget!r}")


def prune_masks(scores: Sequence[torch.Tensor], rho: float, budget: str = "row", rounding: str = "ceil",
                pattern: tuple[int, int] | None = None) -> list[torch.Tensor]:
    """Masks of several matrices: ``shared`` pools them (in the given order), every other budget
    treats them one by one."""
    if budget not in BUDGETS:
        raise SecateurError(f"unknown budget {budget!r}; choose from {', '.join(BUDGETS)}")
    if budget == "shared" and pattern is None:
        return shared_mask(scores, rho, rounding)
    if budget == "shared":
        raise SecateurError("a shared budget cannot be combined with an N:M pattern")
    return [prune_mask(s, rho, budget, rounding, pattern) for s in scores]


def lowest_k_masks(scores: list[torch.Tensor], budget: str, k: int | list[int]) -> list[torch.Tensor]:
    """Masks of the ``k`` lowest scores per pool with the budgets' tie order (as a stable ascending sort):
    the count-driven form of :func:`prune_masks` (QK-Wanda's progressive re-scoring, App. K).

    ``row``: ``k`` per row of every matrix (increasing column on ties); ``separate``/``matrix``: ``k[i]`` in
    matrix ``i`` (row-major); ``shared``: ``k`` over all matrices concatenated row-major in the given order
    (QK-Wanda: all Q entries before all K entries)."""
    for i, s in enumerate(scores):
        _check_scores(s, f"scores[{i}]")
    if budget == "row":
        return [lowest_k_rows(s, k) for s in scores]
    if budget in ("matrix", "separate"):
        return [lowest_k_flat(s.reshape(-1), ki).reshape(s.shape) for s, ki in zip(scores, k)]
    m = lowest_k_flat(torch.cat([s.reshape(-1) for s in scores]), k)
    out, start = [], 0
    for s in scores:
        out.append(m[start:start + s.numel()].reshape(s.shape))
        start += s.numel()
    return out


def budget_counts(shapes: list[torch.Size], rho: float, budget: str, rounding: str) -> int | list[int]:
    """Per-pool deletion counts ``M`` of a budget (row: per row; separate: per matrix; shared: total)."""
    if budget == "row":
        return deletion_count(shapes[0][1], rho, rounding)
    if budget in ("matrix", "separate"):
        return [deletion_count(s.numel(), rho, rounding) for s in shapes]
    return deletion_count(sum(s.numel() for s in shapes), rho, rounding)


def allocation_summary(blocks: list[dict]) -> dict:
    """Per-block Q/K removal fractions (QK-Wanda paper Fig. 3) and their means, from per-block records
    ``{"block", "q_removed", "k_removed", "q_total", "k_total", "rho_q", "rho_k"}``."""
    blocks = sorted(blocks, key=lambda b: b["block"])
    n = max(len(blocks), 1)
    return {"per_block": blocks,
            "mean_rho_q": sum(b["rho_q"] for b in blocks) / n, "mean_rho_k": sum(b["rho_k"] for b in blocks) / n,
            "qk_removed": sum(b["q_removed"] + b["k_removed"] for b in blocks),
            "qk_total": sum(b["q_total"] + b["k_total"] for b in blocks)}
