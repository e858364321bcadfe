"""CoCurve's lambda family and choice (issue 45 §1, §3): the breakpoint family (the paper's Prop. 7) is every
distinct greedy mask on [0, 1]; the paired one-SE rule against lambda = 0; the fixed-split arm.

Graphs are random PSD Grams on inventories of real geometries built on the meta device (no forward passes),
except the fixed-split run through the held-out choice on a tiny model."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch
from test_cocurve_greedy import meta_inventory, random_graph
from transformers import LlamaConfig

from secateur.budgets.allocate import Guard
from secateur.budgets.greedy import (
    DEFAULT_LAMBDAS,
    breakpoint_path,
    conditional_greedy,
    kind_counts,
    lambda_path,
)
from secateur.budgets.heldout import HeldoutKL, paired_choice, standard_error
from secateur.errors import SecateurError
from secateur.methods.cocurve import CoCurveConfig, build_graph, cocurve_inventory, select
from secateur.models.adapters import get_adapter
from secateur.scoring.cocurve_sweep import SweepConfig
from secateur.testing import random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def small_inventory():
    """16 layers (12 eligible) x (2 KV groups + 16 FFN groups): 288 units, a greedy run takes a few ms."""
    return meta_inventory(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=16,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=32))


def key(m: torch.Tensor) -> bytes:
    return m.numpy().tobytes()


@pytest.mark.parametrize("fixed", [False, True], ids=["joint", "fixed-split"])
def test_breakpoint_family_is_every_greedy_mask_on_the_path(fixed):
    """Exhaustive: the masks of a fine lambda scan (and just either side of every breakpoint) are all in the family;
    every family mask is the greedy's at each lambda that produced it; the pieces tile [0, 1]."""
    inv = small_inventory()
    graph = random_graph(inv, seed=5, rank=20)  # low rank: strong signed edges, many reversals
    rho = 0.3
    guard = Guard.cocurve(rho)
    quota = kind_counts(graph, conditional_greedy(graph, rho, 0.0, guard).removed) if fixed else None
    fam, info = breakpoint_path(graph, rho, guard, quota=quota)
    keys = [key(c.removed) for c in fam]
    assert len(set(keys)) == len(keys) == info["distinct_masks"] == info["evaluated"] and not info["capped"]
    assert len(fam) > 5  # edges change the mask along the path
    assert fam[0].lam == 0.0 and torch.equal(fam[0].removed, conditional_greedy(graph, rho, 0.0, guard, quota).removed)
    # the pieces tile [0, 1] in order, each mask's measure is the length of its pieces
    pieces = sorted(iv for c in fam for iv in c.intervals)
    assert pieces[0][0] == 0.0 and pieces[-1][1] == 1.0
    assert all(a[1] == b[0] for a, b in zip(pieces[:-1], pieces[1:]))
    assert sum(c.measure for c in fam) == pytest.approx(1.0, abs=1e-12)
    assert info["breakpoints"] == [p[1] for p in pieces[:-1]]
    # family <= greedy masks: every lambda that produced a mask reproduces it
    for c in fam:
        for lam in c.lambdas:
            assert torch.equal(conditional_greedy(graph, rho, lam, guard, quota).removed, c.removed)
    # greedy masks on [0, 1] <= family: a fine scan, the ends, and either side of every breakpoint
    scan = [float(x) for x in np.linspace(0.0, 1.0, 401 if fixed else 2001)]  # a fixed-split run is ~10x slower
    near = [min(max(b + s, 0.0), 1.0) for b in info["breakpoints"] for s in (-1e-7, 1e-7)]
    seen = {key(conditional_greedy(graph, rho, lam, guard, quota).removed) for lam in scan + near}
    assert seen <= set(keys)
    assert len(seen) >= 0.8 * len(keys)  # the scan finds most of them (pieces narrower than its step may hide)
    # the grid's masks are in the family (the grid family is a subset of the breakpoint family)
    grid = lambda_path(graph, rho, guard, DEFAULT_LAMBDAS, quota=quota)
    assert {key(c.removed) for c in grid} <= set(keys)
    if fixed:
        assert all(kind_counts(graph, c.removed) == quota for c in fam)


def test_breakpoints_are_where_a_choice_changes():
    """Each run's interval is exact: the trajectory holds just inside it and changes just past its right end."""
    inv = small_inventory()
    graph = random_graph(inv, seed=6, rank=20)
    guard = Guard.cocurve(0.3)
    fam, info = breakpoint_path(graph, 0.3, guard)
    for b in info["breakpoints"][:40]:
        left = conditional_greedy(graph, 0.3, b - 1e-9, guard).order
        right = conditional_greedy(graph, 0.3, b + 2e-9, guard).order
        assert left != right


def test_family_cap_keeps_lambda_zero_and_the_widest_pieces():
    inv = small_inventory()
    graph = random_graph(inv, seed=5, rank=20)
    guard = Guard.cocurve(0.3)
    full, _ = breakpoint_path(graph, 0.3, guard)
    cap, info = breakpoint_path(graph, 0.3, guard, max_candidates=4)
    assert info["capped"] and info["distinct_masks"] == len(full) and len(cap) == info["evaluated"] == 4
    assert torch.equal(cap[0].removed, full[0].removed) and cap[0].lam == 0.0
    widest = sorted(full[1:], key=lambda c: (-c.measure, c.lam))[:3]
    assert {key(c.removed) for c in cap[1:]} == {key(c.removed) for c in widest}
    assert [c.lam for c in cap] == sorted(c.lam for c in cap)


def test_paired_se_is_the_se_of_the_per_sequence_differences():
    g = torch.Generator().manual_seed(0)
    n = 16
    base = (torch.rand(n, generator=g, dtype=torch.float64) * 2 + 1).tolist()  # per-sequence KLs vary a lot ...
    cands = [base] + [[b + float(d) for b, d in zip(base, torch.randn(n, generator=g, dtype=torch.float64) * s + m)]
                      for s, m in ((0.01, -0.005), (0.02, 0.01), (0.05, -0.04))]  # ... differences far less
    res = paired_choice(cands, 0)
    for k, x in enumerate(cands):
        d = [a - b for a, b in zip(x, base)]
        mean = sum(d) / n
        # exactly the SE of the differences, written out
        assert res["paired_se"][k] == (math.sqrt(sum((v - mean) ** 2 for v in d) / (n - 1) / n) if k else 0.0)
        assert res["diff"][k] == mean
        if k:
            assert res["paired_se"][k] == pytest.approx(statistics.stdev(d) / math.sqrt(n), rel=1e-12)
            # correlated candidates: the paired SE is far below the unpaired sqrt(SE_k^2 + SE_0^2)
            assert res["paired_se"][k] < 0.2 * math.hypot(standard_error(x), standard_error(base))
    assert standard_error([1.0]) == 0.0


def test_paired_rule_chooses_lambda_above_zero_only_beyond_its_paired_se():
    ref = [1.0, 2.0, 3.0, 4.0]
    within = [0.99, 2.01, 2.97, 4.0]  # lower mean (-0.0075), but by less than its paired SE
    beyond = [0.98, 1.98, 2.99, 3.99]  # -0.0125, paired SE 0.0025: beats lambda = 0
    best_but_noisy = [0.5, 2.5, 2.5, 4.3]  # lowest mean (-0.05), paired SE 0.19
    res = paired_choice([ref, within, beyond, best_but_noisy])
    assert res["beats_reference"] == [False, False, True, False]
    assert res["chosen"] == 2
    assert paired_choice([ref, within, best_but_noisy])["chosen"] == 0  # nothing beats the diagonal: lambda = 0
    # several beat it: the lowest mean among them; ties go to the smaller lambda (index)
    better = [x - 0.01 for x in beyond]
    assert paired_choice([ref, beyond, better])["chosen"] == 2
    assert paired_choice([ref, beyond, list(beyond)])["chosen"] == 1
    # one held-out sequence: no spread, a lower KL is enough
    assert paired_choice([[1.0], [0.9]])["chosen"] == 1 and paired_choice([[1.0], [1.0]])["chosen"] == 0
    with pytest.raises(SecateurError, match="same sequences"):
        paired_choice([[1.0, 2.0], [1.0]])


def test_fixed_split_on_a_tiny_model_keeps_the_diagonal_counts_and_budget():
    """The fixed-split arm through the held-out choice: every candidate (and the chosen mask) removes as many
    attention and FFN units as the diagonal, so its budget is the diagonal's within one unit."""
    model = tiny_model("opt", layers=16)  # its diagonal removes both kinds (a tiny Llama's: FFN groups only)
    a = get_adapter(model)
    inv = cocurve_inventory(a, 16)
    cfg = CoCurveConfig(sweep=SweepConfig(top_r=32, unit_batch=16), n_ffn_groups=16, split="fixed",
                        max_candidates=6)
    g = build_graph(model, a, random_ids(2, 24, seed=1), cfg, inv)
    teacher = HeldoutKL(model, random_ids(3, 24, seed=2))
    for rho in (0.3, 0.4):
        diag = select(g, inv, rho, cfg=cfg, diagonal=True)
        res = select(g, inv, rho, a, teacher, cfg)
        want = kind_counts(g, diag.removed)
        assert want[0] > 0 and want[1] > 0
        assert res.info["split"] == "fixed" and res.info["lambda_family"]["fixed_split"] == {
            "attn_units": want[0], "ffn_units": want[1]}
        assert len(res.candidates) > 1
        for c in res.candidates:
            assert (c["attn_units"], c["ffn_units"]) == want
            assert abs(c["removed_params"] - int(g.costs[diag.removed].sum())) <= int(g.costs.max())
            assert len(c["heldout_per_sequence"]) == 3
        assert kind_counts(g, res.removed) == want
        assert abs(res.info["budget_vs_diagonal"]["units"]) <= 1.0


def test_bad_family_settings_are_one_line_errors():
    with pytest.raises(SecateurError, match="^bisect_depth refines the lambda grid"):
        CoCurveConfig(bisect_depth=2).validate()
    with pytest.raises(SecateurError, match="^unknown CoCurve split 'half'; choose from joint, fixed$"):
        CoCurveConfig(split="half").validate()
    CoCurveConfig(family="grid", bisect_depth=2).validate()


@pytest.mark.parametrize("uniform", [True, False], ids=["uniform-costs", "any-costs"])
def test_quota_feasibility_is_exact(uniform):
    """The fixed split's look-ahead (can both counts still be met under the per-layer caps?) against brute force
    over every per-layer number of attention units."""
    import copy
    import itertools

    from secateur.budgets.greedy import _Problem

    inv = meta_inventory(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=32))
    graph = random_graph(inv, seed=1)
    if not uniform:
        graph.costs = graph.costs + torch.randint(0, 200, (len(inv),), generator=torch.Generator().manual_seed(0))
    p = _Problem.build(graph, 0.3, Guard(cap=0.6))
    assert (p.uniform is not None) == uniform
    rng = np.random.default_rng(0)
    L = p.n_layers

    def brute(removed, rem, na, nf) -> bool:
        per = []
        for li in range(L):
            ua = np.sort(p.costs[(p.layer_of == li) & p.is_attn & ~removed])
            uf = np.sort(p.costs[(p.layer_of == li) & ~p.is_attn & ~removed])
            cap = p.limit[li] - rem[li]
            opts = {}
            for x in range(ua.size + 1):
                used = ua[:x].sum()
                if used <= cap:
                    opts[x] = int((np.cumsum(uf) <= cap - used).sum())
            per.append(opts)
        return any(sum(xs) == na and sum(o[x] for o, x in zip(per, xs)) >= nf
                   for xs in itertools.product(*[list(o) for o in per]))

    checked = {True: 0, False: 0}
    for _ in range(300):
        removed = np.zeros(len(inv), dtype=bool)
        rem = np.zeros(L, dtype=np.int64)
        for u in rng.permutation(len(inv))[:rng.integers(0, 40)]:
            if rem[p.layer_of[u]] + p.costs[u] <= p.limit[p.layer_of[u]]:
                removed[u], rem[p.layer_of[u]] = True, rem[p.layer_of[u]] + p.costs[u]
        na, nf = int(rng.integers(0, 6)), int(rng.integers(0, 40))
        want = brute(removed, rem, na, nf)
        assert p.quota_feasible(removed, rem, na, nf) == want
        generic = copy.copy(p)
        generic.uniform = None
        assert generic.quota_feasible(removed, rem, na, nf) == want
        checked[want] += 1
    assert min(checked.values()) > 20  # both answers are exercised
