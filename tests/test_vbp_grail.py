"""CORP's competitors as compositions of secateur's stages (issue 44): VBP (post-activation variance + the mean-shift
bias fold) and GRAIL (``ls`` with GRAIL's ridge rule).

Tolerances: the bias fold and the ridge solve are float64 sums over a few hundred terms of O(1) values, so they
agree with the direct formulas to ~1e-13; 1e-10 is a generous bound that still fails on any wrong column, sign or
lambda (a wrong lambda moves the solution by O(lambda) ~ 1e-3 here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from secateur import api
from secateur.calib.stats import MeanVar
from secateur.compensate import InputStats, compensate
from secateur.methods.compensation import COMPENSATIONS, GRAIL_LAMBDA_REL
from secateur.models.families import get_adapter
from secateur.scoring.structured import vbp
from secateur.testing import save_tiny, tiny_vision_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(n: int = 400, d: int = 24, seed: int = 0) -> tuple[torch.Tensor, InputStats]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * torch.linspace(0.2, 2.0, d, dtype=torch.float64) + 0.3
    return x, InputStats(second_moment=x.T @ x / n, mean=x.mean(0), n=n)


def test_grail_is_ls_with_the_ridge_of_its_code():
    """W' = W G[:, K] (G_KK + lambda I)^{-1}, lambda = 1e-3 mean(diag G_KK), bias unchanged."""
    x, st = _inputs()
    w0 = torch.randn(10, 24, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    bias = torch.randn(10, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    kept = torch.tensor([0, 2, 3, 7, 8, 11, 15, 16, 20, 23])
    res = compensate(COMPENSATIONS["grail"], w0, st, kept, bias=bias, lam_rel=GRAIL_LAMBDA_REL)
    g = st.second_moment
    gkk = g[kept][:, kept]
    lam = 1e-3 * gkk.diagonal().mean()
    want = w0 @ g[:, kept] @ torch.linalg.inv(gkk + lam * torch.eye(len(kept), dtype=torch.float64))
    torch.testing.assert_close(res.weight.to(torch.float64), want, atol=1e-10, rtol=0)
    assert res.bias is None or torch.equal(res.bias.to(torch.float64), bias)


def test_vbp_bias_fold_is_the_removed_means_times_their_columns():
    """The mean shift: ``b' = b + W[:, P] mu_P`` exactly, the kept columns unchanged."""
    x, st = _inputs()
    w0 = torch.randn(6, 24, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    bias = torch.randn(6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    kept = torch.arange(0, 24, 2)
    pruned = torch.arange(1, 24, 2)
    res = compensate(COMPENSATIONS["bias"], w0, st, kept, bias=bias)
    torch.testing.assert_close(res.bias.to(torch.float64), bias + w0[:, pruned] @ x.mean(0)[pruned], atol=1e-10,
                               rtol=0)
    assert torch.equal(res.weight.to(torch.float64), w0[:, kept])


def test_vbp_score_is_the_population_variance():
    x, _ = _inputs()
    acc = MeanVar(24)
    acc.update(x[:150].float())
    acc.update(x[150:].float())
    torch.testing.assert_close(vbp(acc), x.float().double().var(0, unbiased=False), atol=1e-9, rtol=1e-9)


def test_vbp_removes_the_lowest_variance_neurons_of_a_vision_model(tmp_path):
    """Through the pipeline: the kept fc1 rows are the neurons of highest post-activation variance, per layer."""
    folder = save_tiny("vit", tmp_path / "m")
    npz = tmp_path / "c.npz"
    np.savez(npz, images=np.random.default_rng(0).integers(0, 256, (8, 16, 16, 3), dtype=np.uint8))
    res = api.prune(model=folder, method="vbp", sparsity=0.5, calib=str(npz), nsamples=8, quiet=True)
    assert res.report["details"]["compensation"] == "bias"
    dense = tiny_vision_model("vit")
    ad = get_adapter(dense)
    from secateur.data.images import load_images

    px = load_images(str(npz), folder, n=8).pixel_values
    h, kw = ad.capture_inputs(px)
    pruned = get_adapter(res.model)
    for i, layer in enumerate(ad.layers):
        a = ad.attn_norm(layer, h)
        h2 = ad.attn_residual(layer, h, ad.out_module(layer, "attn_out")(ad.attn_core(layer, a, kw)))
        act = ad.mlp_core(layer, ad.mlp_norm(layer, h2)).reshape(-1, 64).double()
        top = set(torch.argsort(act.var(0, unbiased=False), descending=True, stable=True)[:32].tolist())
        w_kept = pruned.layers[i].mlp.fc1.weight
        rows = {next(j for j in range(64) if torch.equal(layer.mlp.fc1.weight[j], r)) for r in w_kept}
        assert rows == top
        h = ad.block_forward(layer, h, kw)


@pytest.mark.parametrize("ranking", ["activation", "magnitude"])
def test_corp_rankings_of_fig5(tmp_path, ranking):
    """``--corp-ranking activation`` keeps the channels of largest ``E[h_i^2]``, ``magnitude`` those of largest
    ``||W2[:, i]||``: the kept fc2 columns are the top half by that score alone (a stable descending order)."""
    folder = save_tiny("vit", tmp_path / "m")
    npz = tmp_path / "c.npz"
    np.savez(npz, images=np.random.default_rng(0).integers(0, 256, (8, 16, 16, 3), dtype=np.uint8))
    res = api.prune(model=folder, method="corp", units="channel", corp_ranking=ranking, compensation="none",
                    sparsity=0.5, calib=str(npz), nsamples=8, quiet=True)
    dense = tiny_vision_model("vit")
    ad = get_adapter(dense)
    from secateur.data.images import load_images

    h, kw = ad.capture_inputs(load_images(str(npz), folder, n=8).pixel_values)
    for i, layer in enumerate(ad.layers):
        a = ad.attn_norm(layer, h)
        h2 = ad.attn_residual(layer, h, ad.out_module(layer, "attn_out")(ad.attn_core(layer, a, kw)))
        act = ad.mlp_core(layer, ad.mlp_norm(layer, h2)).reshape(-1, 64).double()
        score = act.pow(2).mean(0) if ranking == "activation" else layer.mlp.fc2.weight.double().norm(dim=0)
        top = set(torch.argsort(score, descending=True, stable=True)[:32].tolist())
        kept = get_adapter(res.model).layers[i].mlp.fc2.weight
        cols = {next(j for j in range(64) if torch.equal(layer.mlp.fc2.weight[:, j], kept[:, c]))
                for c in range(kept.shape[1])}
        assert cols == top
        h = ad.block_forward(layer, h, kw)
