"""Magnitude, Wanda, SparseGPT and N:M: exact invariants on tiny models and layers."""

import math

import pytest
import torch

from secateur.budgets.masks import count, deletion_count, prune_mask
from secateur.calib.stats import SumSq
from secateur.compensate.sparsegpt import sparsegpt_prune
from secateur.methods.unstructured import UnstructuredConfig, prune_unstructured
from secateur.models.adapters import get_adapter
from secateur.scoring.wanda import wanda_scores
from secateur.testing import FAMILIES, random_ids, tiny_model


def test_count_rounding():
    assert count(0.5, 7, "ceil") == 4 and count(0.5, 7, "floor") == 3
    assert count(0.3, 10, "ceil") == 3  # no float noise: 0.3 * 10 = 3.0000000000000004


def test_wanda_row_ranking_exact():
    torch.manual_seed(0)
    W = torch.randn(6, 10)
    acc = SumSq(10)
    acc.update(torch.randn(3, 7, 10) * torch.linspace(0.1, 3, 10))
    S = wanda_scores(W, acc)
    mask = prune_mask(S, 0.4, "row")
    assert (mask.sum(1) == 4).all()
    for i in range(6):  # the pruned set is exactly the 4 smallest |W_ij| * ||X_j|| of the row
        ref = torch.argsort(W[i].abs().double() * acc.sumsq.sqrt(), stable=True)[:4]
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == set(ref.tolist())


def test_ties_prune_lower_index_first():
    mask = prune_mask(torch.ones(1, 6), 0.5, "row")
    assert mask.tolist() == [[True, True, True, False, False, False]]


def test_budget_defaults_per_method_and_explicit_choice_is_kept():
    assert UnstructuredConfig(method="wanda").resolved_budget == "row"
    assert UnstructuredConfig(method="magnitude").resolved_budget == "matrix"
    assert UnstructuredConfig(method="magnitude", budget="row").resolved_budget == "row"
    assert UnstructuredConfig(method="wanda", budget="matrix").resolved_budget == "matrix"
    torch.manual_seed(0)
    m = tiny_model("llama")
    a = get_adapter(m)
    masks = prune_unstructured(m, a, None, UnstructuredConfig(method="magnitude", sparsity=0.5, budget="row"),
                               progress=False).masks
    for mask in masks.values():  # an explicit row budget: every output row loses exactly half
        assert (mask.sum(1) == math.ceil(0.5 * mask.shape[1])).all()


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8)])
def test_nm_pattern(n, m):
    torch.manual_seed(1)
    S = torch.rand(5, 16)
    mask = prune_mask(S, 0.0, pattern=(n, m))
    groups = mask.view(5, 16 // m, m)
    assert (groups.sum(-1) == m - n).all()
    kept_min = torch.where(groups, torch.inf, S.view(5, -1, m)).min(-1).values
    pruned_max = torch.where(groups, S.view(5, -1, m), -torch.inf).max(-1).values
    assert (pruned_max <= kept_min).all()


def test_nm_must_divide_width():
    from secateur.errors import SecateurError

    with pytest.raises(SecateurError, match="does not divide"):
        prune_mask(torch.rand(2, 10), 0.0, pattern=(2, 4))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_methods_reach_target_on_every_family(family, method):
    model = tiny_model(family)
    adapter = get_adapter(model)
    res = prune_unstructured(model, adapter, random_ids(4, 16), UnstructuredConfig(method=method, sparsity=0.5),
                             progress=False)
    assert res.masks
    for name, mask in res.masks.items():
        assert abs(mask.float().mean().item() - 0.5) <= 1 / mask.shape[1]  # B9: within one weight per row
        W = model.get_submodule(name.replace("[q]", "")).weight
        W = W.T if family == "gpt2" else W
        assert (W[mask] == 0).all()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_nm_on_models(family):
    model = tiny_model(family)
    res = prune_unstructured(model, get_adapter(model), random_ids(2, 16),
                             UnstructuredConfig(method="wanda", pattern=(2, 4)), progress=False)
    for mask in res.masks.values():
        assert (mask.view(mask.shape[0], -1, 4).sum(-1) == 2).all()


def test_targets_restrict_projections():
    model = tiny_model("llama")
    res = prune_unstructured(model, get_adapter(model), random_ids(2, 16),
                             UnstructuredConfig(method="wanda", targets=frozenset({"q", "k"})), progress=False)
    assert sorted({k.split(".")[-1] for k in res.masks}) == ["k_proj", "q_proj"]


def _layer_problem(seed=0, rows=4, cols=12):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(cols, 200, generator=g, dtype=torch.float64)
    X = X + 0.5 * torch.randn(1, 200, generator=g, dtype=torch.float64)  # correlated inputs
    return torch.randn(rows, cols, generator=g, dtype=torch.float64), X @ X.T


def test_sparsegpt_zero_sparsity_leaves_weights():
    W, H = _layer_problem()
    new, mask = sparsegpt_prune(W, H, lambda k: deletion_count(k, 0.0), percdamp=0.0, dtype=torch.float64)
    assert not mask.any()
    torch.testing.assert_close(new, W)


def test_sparsegpt_single_weight_matches_obs_closed_form():
    """B8: removing one weight with the optimal update raises tr(dW H dW^T) by w_j^2 / [H^-1]_jj."""
    W, H = _layer_problem(rows=1)
    W[0, 0] = 1e-3  # the least salient weight, first column
    rho = 1 / W.numel()
    new, mask = sparsegpt_prune(W, H, lambda k: deletion_count(k, rho), percdamp=0.0, dtype=torch.float64)
    assert mask.sum() == 1 and mask[0, 0]
    dW = new - W
    loss = (dW @ H @ dW.T).item()
    closed = (W[0, 0] ** 2 / torch.linalg.inv(H)[0, 0]).item()
    assert math.isclose(loss, closed, rel_tol=1e-6)


def _err(V, W, H):
    return torch.trace((V - W) @ H @ (V - W).T).item()


def test_sparsegpt_beats_wanda_mask_without_update():
    """On correlated inputs the OBS update lowers the layer error compared with just zeroing."""
    wins = 0
    for seed in range(10):
        W, H = _layer_problem(seed, rows=8, cols=32)
        new, mask = sparsegpt_prune(W, H, lambda k: deletion_count(k, 0.5), percdamp=0.0)
        zeroed = W.masked_fill(mask, 0)
        wins += _err(new, W, H) < _err(zeroed, W, H)
    assert wins == 10


def test_sparsegpt_nm():
    W, H = _layer_problem(rows=6, cols=16)
    _, mask = sparsegpt_prune(W, H, None, n=2, m=4)
    assert (mask.view(6, 4, 4).sum(-1) == 2).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_cuda_capture_gives_the_cpu_masks(method):
    """Blocks visit the GPU while the statistics stay on the CPU: the masks must not depend on the device."""
    ids = random_ids(2, 16, seed=0)
    masks = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        m = tiny_model("llama")
        masks[device] = prune_unstructured(m, get_adapter(m), ids, UnstructuredConfig(method=method, sparsity=0.5),
                                           device=device, progress=False).masks
    for k, v in masks["cpu"].items():
        assert torch.equal(v, masks["cuda"][k].cpu()), k


def _obs_reference(W, H, rho, n=0, m=0, blocksize=128, percdamp=0.01):
    """SparseGPT as published: one rank-1 OBS update per column over the rest of its block (the loop before the
    sub-blocked one): the reference the solver must equal up to float64 rounding."""
    W, H = W.clone(), H.clone()
    cols = W.shape[1]
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += percdamp * torch.mean(torch.diag(H)) * torch.eye(cols, dtype=H.dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    mask = torch.zeros_like(W, dtype=torch.bool)
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        W1, U1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2]
        Q1, E1, d = torch.zeros_like(W1), torch.zeros_like(W1), torch.diag(U1)
        m1 = torch.zeros_like(W1, dtype=torch.bool)
        if not m:
            sal = (W1**2 / d**2).flatten()
            m1.view(-1)[torch.argsort(sal, stable=True)[:deletion_count(sal.numel(), rho)]] = True
        for i in range(i2 - i1):
            if m and i % m == 0:
                idx = torch.argsort(W1[:, i:i + m] ** 2 / d[i:i + m] ** 2, dim=1, stable=True)[:, : m - n]
                m1.scatter_(1, i + idx, True)
            w = W1[:, i]
            q = torch.where(m1[:, i], torch.zeros_like(w), w)
            Q1[:, i], E1[:, i] = q, (w - q) / d[i]
            W1[:, i:] -= E1[:, i:i + 1] * U1[i, i:].unsqueeze(0)
        W[:, i1:i2], mask[:, i1:i2] = Q1, m1
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    return W, mask


@pytest.mark.parametrize("rows,cols,pattern", [(24, 300, None), (40, 256, (2, 4)), (8, 96, (4, 8)), (5, 64, (8, 32))])
def test_sparsegpt_sub_blocked_loop_equals_the_column_loop(rows, cols, pattern):
    """The sub-blocked OBS loop sums the same updates in another order: masks equal, weights within float64
    rounding. Error argument: each entry is a sum of at most ``cols`` products of O(|w|) terms with ``U`` entries
    O(1) after damping, so reordering moves it by ~cols * eps * max|w| ~ 300 * 2.2e-16 * 5 ~ 3e-13; 1e-10 leaves
    room for the growth of the lazy updates across blocks and still catches any dropped or doubled update (O(1))."""
    g = torch.Generator().manual_seed(rows * cols)
    X = torch.randn(cols, 3 * cols, generator=g, dtype=torch.float64)
    X = X + 0.3 * torch.randn(1, 3 * cols, generator=g, dtype=torch.float64)
    W, H = torch.randn(rows, cols, generator=g, dtype=torch.float64), X @ X.T
    n, m = pattern or (0, 0)
    ref, ref_mask = _obs_reference(W, H, 0.5, n, m)
    new, mask = sparsegpt_prune(W, H, None if m else (lambda k: deletion_count(k, 0.5)), n, m, dtype=torch.float64)
    assert torch.equal(mask, ref_mask)
    torch.testing.assert_close(new, ref, rtol=0, atol=1e-10)
    assert not new[mask].any()
