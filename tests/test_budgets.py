"""Budgets: exact counts, lowest-score selection, the App. E.5 tie order, N:M, validation."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from secateur.budgets.masks import (
    count,
    deletion_count,
    matrix_mask,
    nm_mask,
    prune_mask,
    prune_masks,
    row_mask,
    shared_mask,
)
from secateur.errors import SecateurError


def rand(*shape, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("n,rho,ceil,floor", [
    (10, 0.3, 3, 3),  # exact in decimal: float noise (0.3*10 = 3.0000000000000004) must not give 4
    (7, 0.5, 4, 3),
    (4096, 0.7, 2868, 2867),
    (4096, 0.5, 2048, 2048),
    (13, 0.0, 0, 0),
    (0, 0.9, 0, 0),
    (3, 0.99, 3, 2),
])
def test_deletion_count(n, rho, ceil, floor):
    assert deletion_count(n, rho) == deletion_count(n, rho, "ceil") == ceil
    assert deletion_count(n, rho, "floor") == floor
    assert count(rho, n, "floor") == floor  # argument order of the older helper


@pytest.mark.parametrize("rho", [-0.1, 1.0, 1.5, float("nan"), True, "half", None])
def test_fraction_validation(rho):
    with pytest.raises(SecateurError, match="sparsity"):
        deletion_count(10, rho)
    with pytest.raises(SecateurError, match="sparsity"):
        row_mask(rand(2, 4), rho)


def test_rounding_validation_and_nan_scores():
    with pytest.raises(SecateurError, match="rounding"):
        deletion_count(10, 0.5, "round")
    bad = rand(2, 4)
    bad[1, 2] = float("nan")
    for fn in (lambda: row_mask(bad, 0.5), lambda: matrix_mask(bad, 0.5), lambda: shared_mask([bad], 0.5),
               lambda: nm_mask(bad, 2, 4)):
        with pytest.raises(SecateurError, match="NaN"):
            fn()


@pytest.mark.parametrize("rounding", ["ceil", "floor"])
def test_row_mask_counts_and_lowest(rounding):
    S = rand(5, 13, seed=1)
    mask = row_mask(S, 0.4, rounding)
    k = math.ceil(0.4 * 13) if rounding == "ceil" else math.floor(0.4 * 13)
    assert (mask.sum(1) == k).all()
    for i in range(5):
        assert S[i][mask[i]].max() < S[i][~mask[i]].min()


def test_row_ties_prune_lower_column_first():
    S = torch.tensor([[1.0, 0.0, 1.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    assert row_mask(S, 0.6).tolist() == [[True, True, False, True, False], [True, True, True, False, False]]


def test_matrix_mask_counts_lowest_and_row_major_ties():
    S = rand(6, 7, seed=2)
    mask = matrix_mask(S, 0.3)
    assert mask.sum() == math.ceil(0.3 * 42)
    assert S[mask].max() < S[~mask].min()
    assert mask.sum(1).unique().numel() > 1  # no per-row quota
    tied = matrix_mask(torch.ones(3, 4), 0.5)
    assert tied.reshape(-1).tolist() == [True] * 6 + [False] * 6


def test_shared_mask_pool_counts_and_q_before_k_ties():
    """I7: exactly ceil(rho (n_Q + n_K)) deletions over the union, realized rho_Q n_Q + rho_K n_K == it."""
    Sq, Sk = rand(8, 6, seed=3), rand(4, 6, seed=4) * 0.5  # K scores smaller: K loses more
    for rho in (0.1, 0.5, 0.8):
        mq, mk = shared_mask([Sq, Sk], rho)
        k = deletion_count(Sq.numel() + Sk.numel(), rho)
        assert int(mq.sum()) + int(mk.sum()) == k
        rho_q, rho_k = mq.float().mean().item(), mk.float().mean().item()
        assert round(rho_q * Sq.numel() + rho_k * Sk.numel()) == k
        pruned = torch.cat([Sq[mq], Sk[mk]])
        kept = torch.cat([Sq[~mq], Sk[~mk]])
        assert pruned.max() < kept.min()
    mq, mk = shared_mask([Sq, Sk], 0.5)
    assert mk.float().mean() > mq.float().mean()
    # ties: all Q entries (row-major) before all K entries
    tq, tk = shared_mask([torch.ones(4, 3), torch.ones(2, 3)], 0.5)
    assert tq.reshape(-1).tolist() == [True] * 9 + [False] * 3 and not tk.any()
    tq, tk = shared_mask([torch.ones(2, 3), torch.ones(4, 3)], 0.5)
    assert tq.all() and tk.reshape(-1).tolist() == [True] * 3 + [False] * 9


def test_shared_mask_uses_a_common_scale():
    """Rescaling both pools by one positive factor keeps the mask; rescaling one pool moves the split
    (the reason Wanda scores must not be pooled)."""
    Sq, Sk = rand(8, 6, seed=5), rand(4, 6, seed=6)
    ref = shared_mask([Sq, Sk], 0.5)
    same = shared_mask([Sq / 64, Sk / 64], 0.5)
    moved = shared_mask([Sq, Sk * 10], 0.5)
    assert all(torch.equal(a, b) for a, b in zip(ref, same))
    assert int(moved[1].sum()) < int(ref[1].sum())


def test_shared_mask_mixed_dtypes():
    Sq, Sk = rand(3, 4, seed=7).float(), rand(2, 4, seed=8)
    mq, mk = shared_mask([Sq, Sk], 0.5)
    assert mq.shape == Sq.shape and mk.shape == Sk.shape and int(mq.sum() + mk.sum()) == 10


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8)])
def test_nm_mask(n, m):
    S = rand(5, 16, seed=9)
    mask = nm_mask(S, n, m)
    groups, sg = mask.view(5, -1, m), S.view(5, -1, m)
    assert (groups.sum(-1) == m - n).all()
    kept_min = torch.where(groups, torch.inf, sg).min(-1).values
    pruned_max = torch.where(groups, sg, -torch.inf).max(-1).values
    assert (pruned_max < kept_min).all()
    assert torch.equal(prune_mask(S, 0.0, pattern=(n, m)), mask)


def test_nm_ties_and_validation():
    assert nm_mask(torch.ones(1, 8), 2, 4).tolist() == [[True, True, False, False] * 2]
    with pytest.raises(SecateurError, match="does not divide"):
        nm_mask(rand(2, 10), 2, 4)
    for n, m in ((0, 4), (4, 4), (5, 4)):
        with pytest.raises(SecateurError, match="0 < N < M"):
            nm_mask(rand(2, 8), n, m)


def test_dispatch():
    S = [rand(4, 6, seed=10), rand(2, 6, seed=11)]
    assert torch.equal(prune_mask(S[0], 0.5, "separate"), matrix_mask(S[0], 0.5))
    assert torch.equal(prune_mask(S[0], 0.5, "row"), row_mask(S[0], 0.5))
    assert all(torch.equal(a, b) for a, b in zip(prune_masks(S, 0.5, "shared"), shared_mask(S, 0.5)))
    assert all(torch.equal(a, matrix_mask(s, 0.5)) for a, s in zip(prune_masks(S, 0.5, "matrix"), S))
    assert all(torch.equal(a, nm_mask(s, 2, 3)) for a, s in zip(prune_masks(S, 0.0, "row", pattern=(2, 3)), S))
    with pytest.raises(SecateurError, match="budget"):
        prune_masks(S, 0.5, "global")
    with pytest.raises(SecateurError, match="budget"):
        prune_mask(S[0], 0.5, "shared")
    with pytest.raises(SecateurError, match="N:M"):
        prune_masks(S, 0.5, "shared", pattern=(2, 3))
    with pytest.raises(SecateurError, match="row budgets"):
        row_mask(torch.ones(2, 2, 2), 0.5)


def test_thresholding_minimizes_additive_surrogate_exhaustively():
    """I12 (Eq. 8): the M lowest scores minimize sum_p S_p z_p over all masks with sum z = M; among the
    optimal masks the stable order picks the lowest indices for tied scores."""
    g = torch.Generator().manual_seed(12)
    for trial in range(6):
        n = 12 if trial % 2 else 9
        S = torch.randint(0, 4, (n,), generator=g).double()  # many ties
        for rho in (0.1, 0.25, 0.5, 0.75, 0.9):
            mask = matrix_mask(S, rho)
            k = int(mask.sum())
            best = min(sum(S[list(c)].tolist()) for c in itertools.combinations(range(n), k))
            assert S[mask].sum().item() == best
            order = sorted(range(n), key=lambda i: (S[i].item(), i))
            assert sorted(torch.nonzero(mask).flatten().tolist()) == sorted(order[:k])


@pytest.mark.parametrize("k", [0, 1, 5, 11, 12])
def test_lowest_k_rows_equals_stable_sort_with_ties(k):
    """The selection path (kthvalue + index-ordered ties) is exactly the first k of a stable argsort."""
    from secateur.budgets.masks import lowest_k_rows

    g = torch.Generator().manual_seed(k)
    scores = torch.randint(0, 4, (9, 12), generator=g).float()  # many ties per row
    scores[0] = 1.0  # a row of one repeated value
    scores[1, 3] = float("-inf")
    ref = torch.zeros_like(scores, dtype=torch.bool)
    ref.scatter_(1, torch.argsort(scores, dim=1, stable=True)[:, :k], True)
    assert torch.equal(lowest_k_rows(scores, k), ref)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 16), chunk=st.integers(1, 40), rho=st.floats(0.0, 0.95),
       levels=st.integers(1, 5), seed=st.integers(0, 2**16), nm=st.sampled_from([None, (1, 2), (2, 4)]))
def test_row_chunking_changes_no_mask(monkeypatch, rows, cols, chunk, rho, levels, seed, nm):
    """Row budgets and N:M select a few rows at a time (``ROW_CHUNK_ELEMENTS``, to bound the transients): any chunk
    gives the masks of one whole-matrix stable sort, ties (few score levels) included."""
    import secateur.budgets.masks as masks

    if nm is not None:
        cols = max(cols - cols % nm[1], nm[1])
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (rows, cols), generator=g).double()
    if nm is None:
        k = deletion_count(cols, rho)
        ref = torch.zeros_like(scores, dtype=torch.bool)
        ref.scatter_(1, torch.argsort(scores, dim=1, stable=True)[:, :k], True)
    else:
        n, m = nm
        groups = scores.reshape(rows, cols // m, m)
        ref = torch.zeros(groups.shape, dtype=torch.bool)
        ref = ref.scatter_(2, torch.argsort(groups, dim=2, stable=True)[..., : m - n], True).reshape(rows, cols)
    monkeypatch.setattr(masks, "ROW_CHUNK_ELEMENTS", chunk)  # chunk < cols: one row at a time
    got = masks.row_mask(scores, rho) if nm is None else masks.nm_mask(scores, *nm)
    assert torch.equal(got, ref)
