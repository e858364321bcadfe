"""CoCurve conditional greedy and lambda path (cocurve.md V2, V4, V5, V8) on random PSD graphs.

Inventories come from real geometries built on the meta device (no weights, no forward passes)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from secateur.budgets.allocate import Guard, allocate_global
from secateur.budgets.greedy import DEFAULT_LAMBDAS, conditional_greedy, lambda_path
from secateur.errors import SecateurError
from secateur.methods.cocurve import cocurve_inventory
from secateur.models.adapters import get_adapter
from secateur.scoring.cocurve_graph import CoPruningGraph

pytestmark = pytest.mark.usefixtures("one_thread")


def meta_inventory(cfg: LlamaConfig):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return cocurve_inventory(get_adapter(model))


def smollm2_geometry() -> LlamaConfig:
    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)


def fine_geometry() -> LlamaConfig:
    """Llama-3.2-1B widths with 32 layers: one FFN group (the largest unit) is 0.16% of C."""
    return LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=64, vocab_size=1024)


def random_graph(inv, seed: int = 0, rank: int | None = None) -> CoPruningGraph:
    g = torch.Generator().manual_seed(seed)
    M = len(inv)
    # a Gram of random signed features (mixed-sign edges), scaled so nodes differ across units
    scale = torch.rand(M, generator=g, dtype=torch.float64)
    X = torch.randn(rank or 2 * M, M, generator=g, dtype=torch.float64) * scale
    return CoPruningGraph.from_inventory(inv, X.T @ X / X.shape[0])


@pytest.fixture(scope="module")
def smol_inv():
    return meta_inventory(smollm2_geometry())


def test_inventory_costs_match_the_spec(smol_inv):
    d, m, f = 576, 64, 1536
    assert len(smol_inv) == 30 * (3 + 16) == 570
    costs = smol_inv.costs
    assert costs[0] == d * m * (2 * 3 + 2)  # KV group: 3 query heads + its k/v head
    assert costs[3] == 3 * d * (f // 16)  # FFN group
    assert smol_inv.total_cost == 30 * (3 * d * m * 8 + 3 * d * f)


def from_scratch_greedy(graph: CoPruningGraph, rho: float, lam: float, guard: Guard) -> list[int]:
    """Reference: every step recomputes the edge sums H[:, S].sum(1) from S (no incremental state)."""
    H, c = graph.H, graph.costs
    total = int(c.sum())
    lc = graph.layer_costs()
    prot = guard.protected(graph.n_layers)
    lay = graph.layer_of.tolist()
    S: list[int] = []
    while int(c[S].sum()) < rho * total - 1e-9 * total:
        rem = {li: int(c[[v for v in S if lay[v] == li]].sum()) for li in lc}
        ok = torch.tensor([u not in S and lay[u] not in prot and rem[lay[u]] + int(c[u]) <= guard.cap * lc[lay[u]]
                           + 1e-9 * lc[lay[u]] for u in range(len(graph))])
        delta = 0.5 * H.diagonal() + lam * H[:, S].sum(1)
        key = torch.where(ok, delta / c, torch.tensor(float("inf"), dtype=torch.float64))
        S.append(int(torch.argmin(key)))
    return S


@pytest.mark.parametrize("lam", [0.0, 0.4, 1.0])
def test_incremental_sums_equal_recomputation(smol_inv, lam):
    """V4: g == H[:, S].sum(1); the path equals a from-scratch greedy; sum of Deltas == R_lambda(S)."""
    graph = random_graph(smol_inv, seed=1)
    guard = Guard.cocurve(0.3)
    res = conditional_greedy(graph, 0.3, lam, guard)
    assert torch.allclose(res.g, graph.H[:, res.removed].sum(1), rtol=1e-12, atol=1e-12)
    assert res.order == from_scratch_greedy(graph, 0.3, lam, guard)
    assert sum(res.deltas) == pytest.approx(graph.surrogate(res.removed, lam), rel=1e-10)


def test_from_scratch_reference_full_path_small():
    inv = meta_inventory(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=16,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=32))
    graph = random_graph(inv, seed=5, rank=20)  # low rank: strong edges, many reversals
    guard = Guard.cocurve(0.3)
    orders = {lam: conditional_greedy(graph, 0.3, lam, guard).order for lam in (0.0, 0.5, 1.0)}
    for lam, order in orders.items():
        assert order == from_scratch_greedy(graph, 0.3, lam, guard)
    assert orders[0.0] != orders[1.0]  # edges change decisions


def test_lambda_zero_is_the_cost_normalized_diagonal_ranking(smol_inv):
    """V2: lambda = 0 == the shared solver on 1/2 H_uu (ascending H_uu / 2 c_u, guards applied)."""
    graph = random_graph(smol_inv, seed=2)
    for rho in (0.2, 0.5):
        guard = Guard.cocurve(rho)
        res = conditional_greedy(graph, rho, 0.0, guard)
        ref = allocate_global(smol_inv, 0.5 * graph.diag, rho, guard=guard, cost_normalized=True).removed
        assert torch.equal(res.removed, ref)
        keys = (graph.diag / (2 * graph.costs))[res.order]
        # without a cap binding, the order is the ascending key order
        assert bool((keys[:10].diff() >= 0).all())


def test_equal_costs_no_guard_is_top_k_by_diagonal():
    inv = meta_inventory(LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=4, head_dim=16, vocab_size=32))
    graph = random_graph(inv, seed=3)
    graph.costs = torch.ones(len(inv), dtype=torch.long)
    res = conditional_greedy(graph, 0.25, 0.0, None)
    k = int(res.removed.sum())
    assert k == len(inv) // 4
    assert set(res.order) == set(torch.argsort(graph.diag, stable=True)[:k].tolist())


@pytest.mark.parametrize("rho", [0.2, 0.3, 0.4, 0.5])
def test_guards_and_budget(rho):
    """V5 on a geometry where one unit is < 0.2 pp of C, so the paper's 0.2 pp check must hold."""
    inv = meta_inventory(fine_geometry())
    graph = random_graph(inv, seed=4)
    guard = Guard.cocurve(rho)
    c_max, total = int(graph.costs.max()), int(graph.costs.sum())
    assert c_max / total < 0.002
    lc = graph.layer_costs()
    for lam in (0.0, 1.0):
        res = conditional_greedy(graph, rho, lam, guard)
        removed_cost = int(graph.costs[res.removed].sum())
        assert rho * total <= removed_cost < rho * total + c_max
        assert abs(res.realized - rho) < 0.002
        assert not bool(res.removed[torch.isin(graph.layer_of, torch.tensor([0, 1, 30, 31]))].any())
        for li, c in lc.items():
            got = int(graph.costs[res.removed & (graph.layer_of == li)].sum())
            assert got <= guard.cap * c + 1e-9 * c


def test_smollm2_granularity_bound(smol_inv):
    """SmolLM2: a KV group is 0.28% of C, so the guaranteed bound is one unit (not 0.2 pp)."""
    graph = random_graph(smol_inv, seed=6)
    c_max, total = int(graph.costs.max()), int(graph.costs.sum())
    assert c_max / total == pytest.approx(294912 / 106168320)
    for rho in (0.2, 0.3, 0.4, 0.5):
        res = conditional_greedy(graph, rho, 1.0, Guard.cocurve(rho))
        assert 0 <= res.realized - rho < c_max / total


def test_infeasible_budget_raises():
    inv = meta_inventory(LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=6,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=32))
    graph = random_graph(inv)
    with pytest.raises(SecateurError, match="infeasible"):
        conditional_greedy(graph, 0.9, 0.5, Guard.cocurve(0.9))  # 4 of 6 layers protected


def test_lambda_path_distinct_masks(smol_inv):
    """V8: lambda = 0 is a candidate; masks are distinct; each lambda reproduces its mask; bisection only adds."""
    graph = random_graph(smol_inv, seed=7, rank=60)
    guard = Guard.cocurve(0.4)
    assert DEFAULT_LAMBDAS[:3] == (0.0, 0.02, 0.05) and DEFAULT_LAMBDAS[-1] == 1.0 and len(DEFAULT_LAMBDAS) == 22
    cands = lambda_path(graph, 0.4, guard)
    assert cands[0].lam == 0.0
    assert len(cands) > 1
    keys = {c.removed.numpy().tobytes() for c in cands}
    assert len(keys) == len(cands)
    assert sum(len(c.lambdas) for c in cands) == len(DEFAULT_LAMBDAS)
    assert [c.lam for c in cands] == sorted(c.lam for c in cands)
    for c in cands:
        for lam in {c.lambdas[0], c.lambdas[-1]}:
            assert torch.equal(conditional_greedy(graph, 0.4, lam, guard).removed, c.removed)
    fine = lambda_path(graph, 0.4, guard, bisect_depth=2)
    assert keys <= {c.removed.numpy().tobytes() for c in fine}
    assert len(fine) >= len(cands)
