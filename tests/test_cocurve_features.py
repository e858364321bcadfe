"""CoCurve features and H (cocurve.md V1, V3, V6, V7): Fisher math, the shared-prefix sweep vs brute force."""

from __future__ import annotations

import pytest
import torch

from secateur.budgets.heldout import masked
from secateur.methods.cocurve import CoCurveConfig, build_graph, cocurve_inventory
from secateur.models.adapters import get_adapter
from secateur.scoring.cocurve_graph import CoPruningGraph
from secateur.scoring.cocurve_sweep import (
    SweepConfig,
    ablation_sweep,
    fisher_features,
    gram,
    sample_positions,
    teacher_support,
)
from secateur.testing import random_ids, tiny_model

VOCAB = 128

pytestmark = pytest.mark.usefixtures("one_thread")


def _fisher(p: torch.Tensor) -> torch.Tensor:
    return torch.diag(p) - torch.outer(p, p)


def test_features_equal_exact_fisher_form_with_full_support():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 40, generator=g, dtype=torch.float64)
    p = torch.softmax(z, -1)
    dz = torch.randn(3, 5, 40, generator=g, dtype=torch.float64)  # 3 units x 5 positions
    phi = fisher_features(dz, p)
    for t in range(5):
        F = _fisher(p[t])
        for u in range(3):
            for v in range(3):
                exact = dz[u, t] @ F @ dz[v, t]
                assert torch.allclose(phi[u, t] @ phi[v, t], exact, rtol=1e-12, atol=1e-15)
    # softmax shift invariance: a constant added to dz changes nothing
    assert torch.allclose(fisher_features(dz + 3.7, p), phi, atol=1e-12)
    # the un-centered ablation is not shift invariant (so the test above can fail)
    assert not torch.allclose(fisher_features(dz + 3.7, p, center="none"), fisher_features(dz, p, center="none"))


def test_support_renormalization():
    p = torch.tensor([[0.5, 0.2, 0.1]], dtype=torch.float64)  # mass 0.8 on the support
    dz = torch.tensor([[[1.0, -1.0, 2.0]]], dtype=torch.float64)
    q = p / p.sum()
    exact = dz[0, 0] @ _fisher(q[0]) @ dz[0, 0]
    assert torch.allclose((fisher_features(dz, p) ** 2).sum(), exact)
    raw = fisher_features(dz, p, renormalize=False)  # dz^T (diag p - ...) without renormalization
    assert not torch.allclose((raw ** 2).sum(), exact)


def test_identical_responses_give_equal_nodes_and_edge():
    """V7: two units with identical dz (any layers) -> H_uv = H_uu = H_vv."""
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(7, 16, generator=g, dtype=torch.float64), -1)
    dz = torch.randn(7, 16, generator=g, dtype=torch.float64)
    other = torch.randn(7, 16, generator=g, dtype=torch.float64)
    phi = fisher_features(torch.stack([dz, other, dz]), p)  # units 0 and 2 identical
    H = gram(phi.reshape(3, -1).T)
    assert H[0, 2] == H[0, 0] == H[2, 2]
    assert H[0, 1] != H[0, 0]


def test_positions_and_support():
    assert torch.equal(sample_positions(2048, 128), torch.arange(1, 129) * 16 - 1)
    assert torch.equal(sample_positions(10, 32), torch.arange(10))
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    idx, p = teacher_support(logits, 3)
    assert idx.tolist() == [[1, 2, 0]]  # ties: smaller token id first
    assert torch.allclose(p, torch.softmax(logits.double(), -1)[:, [1, 2, 0]])


def _brute_H(model, inv, ids, cfg: SweepConfig, units: list[int]) -> torch.Tensor:
    """Reference: each ablation by masking the full model (no shared prefix), exact float64 Gram."""
    a = get_adapter(model)
    pos = sample_positions(ids.shape[1], cfg.positions_per_seq)
    with torch.no_grad():
        z0 = model(ids).logits[:, pos].float()
    idx, p = teacher_support(z0, cfg.top_r)
    feats = []
    for u in units:
        r = torch.zeros(len(inv), dtype=torch.bool)
        r[u] = True
        with torch.no_grad(), masked(a, inv, r):
            zu = model(ids).logits[:, pos].float()
        feats.append(fisher_features(z0.gather(-1, idx) - zu.gather(-1, idx), p, cfg.renormalize).reshape(-1))
    phi = torch.stack(feats, 1)
    return phi.T @ phi / pos.numel() / ids.shape[0]


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt", "gpt2", "gemma3_text", "phi3"])
def test_sweep_equals_brute_force_ablations(family):  # gemma3_text: post-norms inside the residual, MQA heads
    model = tiny_model(family, layers=3)
    a = get_adapter(model)
    inv = cocurve_inventory(a, n_ffn_groups=4)
    ids = random_ids(3, 24, VOCAB, seed=2)
    cfg = SweepConfig(positions_per_seq=6, top_r=20, unit_batch=3, seqs_per_block=2)
    sw = ablation_sweep(model, a, inv, ids, cfg)
    ref = _brute_H(model, inv, ids, cfg, list(range(len(inv))))
    scale = float(ref.diagonal().max())
    assert torch.allclose(sw.H, ref, atol=1e-5 * scale, rtol=1e-4)
    assert torch.equal(sw.H, sw.H.T)


def test_full_vocabulary_support_gives_exact_fisher_nodes():
    """V3 on a model: with r = |vocab|, H_uu = E_t dz_u^T (diag p - p p^T) dz_u (full-model masking)."""
    model = tiny_model("llama", layers=3)
    a = get_adapter(model)
    inv = cocurve_inventory(a, n_ffn_groups=4)
    ids = random_ids(2, 20, VOCAB, seed=3)
    sw = ablation_sweep(model, a, inv, ids, SweepConfig(positions_per_seq=5, top_r=VOCAB))
    pos = sample_positions(20, 5)
    with torch.no_grad():
        z0 = model(ids).logits[:, pos].double()
    p0 = torch.softmax(z0, -1)
    for u in range(len(inv)):
        r = torch.zeros(len(inv), dtype=torch.bool)
        r[u] = True
        with torch.no_grad(), masked(a, inv, r):
            dz = z0 - model(ids).logits[:, pos].double()
        exact = torch.stack([dz[b, t] @ _fisher(p0[b, t]) @ dz[b, t] for b in range(2) for t in range(5)]).mean()
        assert torch.allclose(sw.H[u, u], exact, rtol=1e-4, atol=1e-12), u


def test_zero_unit_has_exactly_zero_row_and_protected_units_are_skipped():
    model = tiny_model("llama", layers=5)
    a = get_adapter(model)
    inv = cocurve_inventory(a, n_ffn_groups=4)
    pool = next(p for p in inv.pools if p.layer == 2 and p.kind == "kv_group")
    u = pool.offset + 1
    heads = pool.unit_members(1)
    m = inv.head_dim
    with torch.no_grad():
        for h in heads.tolist():
            a.layers[2].self_attn.o_proj.weight[:, h * m:(h + 1) * m] = 0
    cfg = CoCurveConfig(sweep=SweepConfig(positions_per_seq=4, top_r=16), n_ffn_groups=4)
    g = build_graph(model, a, random_ids(2, 16, VOCAB), cfg, inv)
    assert torch.count_nonzero(g.H[u]) == 0
    prot = torch.isin(g.layer_of, torch.tensor([0, 1, 3, 4]))
    assert not bool(g.ablated[prot].any()) and bool(g.ablated[~prot].all())
    assert torch.count_nonzero(g.H[prot]) == 0
    assert bool((g.H.diagonal()[~prot & (torch.arange(len(inv)) != u)] > 0).all())


def test_H_symmetric_psd_and_h_lambda_psd(tmp_path):
    """V1 plus persistence."""
    model = tiny_model("qwen3", layers=6)
    a = get_adapter(model)
    inv = cocurve_inventory(a, n_ffn_groups=4)
    cfg = CoCurveConfig(sweep=SweepConfig(positions_per_seq=8, top_r=32), n_ffn_groups=4)
    g = build_graph(model, a, random_ids(2, 32, VOCAB), cfg, inv)
    assert torch.equal(g.H, g.H.T)
    tr = float(g.H.diagonal().sum())
    assert g.check_psd() >= -1e-8 * tr
    for lam in (0.0, 0.3, 1.0):
        assert float(torch.linalg.eigvalsh(g.h_lambda(lam)).min()) >= -1e-8 * tr
    info = g.save(tmp_path / "g.npz")
    back = CoPruningGraph.load(tmp_path / "g.npz")
    assert torch.equal(back.H, g.H) and torch.equal(back.costs, g.costs) and back.meta["n_ablated"] == 12
    assert info["H_sha256"] == g.save(tmp_path / "again.npz")["H_sha256"]
    with pytest.raises(Exception, match="not PSD"):
        CoPruningGraph(H=-torch.eye(3, dtype=torch.float64), costs=torch.ones(3, dtype=torch.long),
                       layer_of=torch.zeros(3, dtype=torch.long), is_attn=torch.zeros(3, dtype=torch.bool),
                       n_layers=1).check_psd()


def test_weak_unit_node_is_twice_its_kl():
    """V6 (finite-ablation form): for a weak unit, 1/2 H_uu ~ KL(p_0 || p_{-u}) at second order."""
    model = tiny_model("llama", layers=3)
    a = get_adapter(model)
    inv = cocurve_inventory(a, n_ffn_groups=4)
    pool = next(p for p in inv.pools if p.layer == 1 and p.kind == "ffn_group")
    ch = pool.unit_members(0)
    with torch.no_grad():
        a.layers[1].mlp.down_proj.weight[:, ch] *= 1e-2
    units = torch.zeros(len(inv), dtype=torch.bool)
    units[pool.offset] = True
    sw = ablation_sweep(model, a, inv, random_ids(2, 16, VOCAB), SweepConfig(positions_per_seq=8, top_r=VOCAB),
                        units)
    u = pool.offset
    assert sw.kl_single[u] > 0
    assert abs(0.5 * float(sw.H[u, u]) / float(sw.kl_single[u]) - 1) < 1e-4
