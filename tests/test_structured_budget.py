"""Units, costs, budgets, guards and parameter counts (no forward passes beyond tiny models)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from secateur.budgets.allocate import (
    Guard,
    allocate_blocks,
    allocate_global,
    allocate_uniform,
    allocate_weighted_threshold,
    keep_count,
)
from secateur.errors import SecateurError
from secateur.eval.efficiency import count_params, count_params_from_config, flops_per_token, uniform_layer_specs
from secateur.models.adapters import get_adapter
from secateur.structured.selection import Selection
from secateur.structured.units import inventory, layer_shape
from secateur.testing import FAMILIES, tiny_model


def qwen25_7b_config() -> Qwen2Config:
    return Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)


# --- parameter counts (evaluation.md E4) ------------------------------------------------------------

def test_qwen25_7b_counts_match_coec_table4():
    c = qwen25_7b_config()
    dense = count_params_from_config(c)
    pruned = count_params_from_config(c, uniform_layer_specs(c, 0.30))
    assert dense == 7_615_616_512 and round(dense / 1e9, 2) == 7.62
    assert pruned == 5_699_162_112 and round(pruned / 1e9, 2) == 5.70
    assert round(flops_per_token(dense) / 1e9, 1) == 15.2
    assert round(flops_per_token(pruned) / 1e9, 1) == 11.4
    spec = uniform_layer_specs(c, 0.30)[0]
    assert (spec["n_kv_heads"], spec["n_heads"], spec["intermediate"]) == (3, 21, 13261)
    # floor on KV groups is what COEC rules out (5.49 B)
    floor = uniform_layer_specs(c, 0.30, rounding="floor")
    assert round(count_params_from_config(c, floor) / 1e9, 2) == 5.49


def test_config_counter_matches_meta_model_for_qwen25_7b():
    c = qwen25_7b_config()
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(c)
    assert count_params(m) == count_params_from_config(c)


@pytest.mark.parametrize("family", FAMILIES)
def test_param_counters_agree_on_tiny_models(family):
    m = tiny_model(family)
    unique = {p.data_ptr(): p.numel() for p in m.parameters()}
    assert count_params(m) == sum(unique.values()) == count_params_from_config(m.config)


def test_tied_embeddings_counted_once():
    m = tiny_model("gpt2")
    assert m.lm_head.weight.data_ptr() == m.transformer.wte.weight.data_ptr()
    n_all = sum(p.numel() for _, p in m.named_parameters(remove_duplicate=False))
    assert count_params(m) == n_all - m.lm_head.weight.numel()


# --- rounding ----------------------------------------------------------------------------------------

def test_keep_count_ceil_rule_and_float_guard():
    assert keep_count(4, 0.30) == 3 and keep_count(18944, 0.30) == 13261
    assert keep_count(10, 0.7) == 3  # (1 - 0.7) * 10 = 3.0000000000000004 must not round up to 4
    assert keep_count(10, 0.3, "floor") == 7 and keep_count(5, 0.5, "round") == 3
    for n in range(1, 60):
        for rho in (0.1, 0.2, 0.25, 0.3, 0.5, 0.7, 0.9):
            assert keep_count(n, rho) == n - math.floor(round(rho * n, 9))  # = FLAP's n - floor(rho n)
    assert keep_count(7, 0.0) == 7 and keep_count(7, 1.0) == 0
    with pytest.raises(SecateurError):
        keep_count(4, 1.5)


# --- inventory and costs -----------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_unit_costs_partition_layer_removable_params(family):
    m = tiny_model(family, layers=2)
    a = get_adapter(m)
    inv = inventory(a, ("kv_group", "channel"))
    for i in range(2):
        s = layer_shape(a, i)
        cost = sum(int(p.cost.sum()) for p in inv.pools if p.layer == i)
        layer = a.layers[i]
        keep = {"o_proj.bias", "out_proj.bias", "down_proj.bias", "fc2.bias", "attn.c_proj.bias",
                "mlp.c_proj.bias"}
        proj = sum(p.numel() for n, p in layer.named_parameters()
                   if ("proj" in n or "fc" in n or "c_attn" in n) and not any(n.endswith(k) for k in keep))
        # MQA: query-head units only; the one KV head goes with the last of them and is no unit's cost
        kv = s.attn_unit_params(0, 1) if s.n_kv_heads == 1 < s.n_heads else 0
        assert cost + kv == s.removable == proj


def test_kv_group_cost_formula_gqa_with_biases():
    m = tiny_model("qwen2")  # d=32, 4 heads, 2 KV heads, m=8, q/k/v biases
    inv = inventory(get_adapter(m), ("kv_group",))
    d, mm, gs = 32, 8, 2
    assert int(inv.pools[0].cost[0]) == d * mm * (2 * gs + 2) + gs * mm + 2 * mm
    assert inv.unit(1).heads == (2, 3) and inv.unit(1).kv_heads == (1,)


def test_single_heads_refused_under_gqa_allowed_for_mha():
    with pytest.raises(SecateurError, match="GQA"):
        inventory(get_adapter(tiny_model("llama")), ("head",))
    inv = inventory(get_adapter(tiny_model("opt")), ("head",))
    assert [inv.unit(i).heads for i in range(4)] == [(0,), (1,), (2,), (3,)]


def test_ffn_groups_partition_channels():
    a = get_adapter(tiny_model("llama"))
    inv = inventory(a, ("ffn_group",), n_ffn_groups=5)  # 64 channels -> sizes 12/13
    p = inv.pools[0]
    assert torch.equal(p.members, torch.arange(64))
    assert p.ptr.diff().tolist() == [12, 13, 13, 13, 13]
    assert int(p.cost.sum()) == 64 * 3 * 32
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    inv2 = inventory(a, ("ffn_group",), n_ffn_groups=4, ffn_order={0: perm})
    assert sorted(inv2.pools[0].members.tolist()) == list(range(64))
    assert set(inv2.pools[0].unit_members(0).tolist()) == set(perm[:16].tolist())
    with pytest.raises(SecateurError):
        inventory(a, ("ffn_group",), ffn_order={0: torch.zeros(64, dtype=torch.long)})


# --- allocators --------------------------------------------------------------------------------------

def _inv(layers=8, family="llama", kinds=("kv_group", "ffn_group")):
    m = tiny_model(family, layers=layers)
    return inventory(get_adapter(m), kinds, n_ffn_groups=16)


def test_uniform_allocation_ceil_per_pool_and_lowest_scores():
    inv = _inv(4, kinds=("kv_group", "channel"))
    scores = torch.rand(len(inv), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    al = allocate_uniform(inv, scores, 0.3)
    for p in inv.pools:
        r = al.removed[p.offset:p.offset + p.n]
        assert int((~r).sum()) == keep_count(p.n, 0.3)
        s = scores[p.offset:p.offset + p.n]
        if r.any() and (~r).any():
            assert s[r].max() < s[~r].min()
    assert al.info["by_kind"]["kv_group"]["removed_units"] == 4 * (2 - keep_count(2, 0.3))


def test_uniform_ties_remove_smaller_index_first():
    inv = _inv(2, kinds=("channel",))
    al = allocate_uniform(inv, torch.zeros(len(inv), dtype=torch.float64), 0.25)
    assert al.removed[:16].all() and not al.removed[16:64].any()


@pytest.mark.parametrize("rho", [0.2, 0.3, 0.45])
def test_global_greedy_budget_guards_and_cap(rho):
    inv = _inv(16)  # 12 eligible layers x 1.5 rho cap > rho: feasible
    g = Guard.cocurve(rho)
    scores = torch.rand(len(inv), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    al = allocate_global(inv, scores, rho, guard=g)
    costs, total = inv.costs, inv.total_cost
    removed = int(costs[al.removed].sum())
    assert rho * total <= removed < rho * total + int(costs.max())  # CoCurve V5
    layer_of = inv.layer_of
    assert not al.removed[(layer_of < 2) | (layer_of >= 14)].any()
    lc = inv.layer_costs()
    for li, d in al.info["per_layer"].items():
        assert d["removed_params"] <= g.cap * lc[li] + 1e-6
    assert al.info["realized"] == pytest.approx(removed / total)


def test_global_greedy_is_cost_normalized_diagonal_ranking():
    # CoCurve V2: without guards the greedy takes units in ascending score/cost order
    inv = _inv(4)
    scores = torch.rand(len(inv), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    al = allocate_global(inv, scores, 0.3)
    order = torch.argsort(scores / inv.costs, stable=True)
    k = int(al.removed.sum())
    assert set(order[:k].tolist()) == set(al.removed.nonzero().view(-1).tolist())


def test_infeasible_budget_raises_instead_of_relaxing():
    inv = _inv(4)
    with pytest.raises(SecateurError, match="infeasible"):
        allocate_global(inv, torch.zeros(len(inv), dtype=torch.float64), 0.6, guard=Guard.cocurve(0.6))


def test_guard_protected_layers():
    g = Guard.cocurve(0.2)
    assert g.protected(10) == {0, 1, 8, 9} and g.cap == pytest.approx(0.3)
    assert Guard(protect=(-1,)).protected(5) == {4}
    assert Guard.cocurve(0.8).cap == 1.0


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("rho", [0.2, 0.5])
def test_flap_alam_within_one_head_weight(seed, rho):
    # baselines.md B4: kept weighted budget within one head weight of (1 - rho) total
    inv = _inv(4, kinds=("kv_group", "channel"))
    scores = torch.randn(len(inv), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    al = allocate_weighted_threshold(inv, scores, rho)
    head_w = int(inv.pools[0].cost[0])
    assert abs(al.info["kept_params"] - (1 - rho) * inv.total_cost) <= head_w / 2
    kept = ~al.removed
    assert scores[kept].min() >= scores[al.removed].max()
    flap = allocate_weighted_threshold(inv, scores, rho, rule="flap")
    assert int(flap.removed.sum()) in (int(al.removed.sum()), int(al.removed.sum()) + 1)


def test_blocks_allocation_removes_lowest_influence():
    inv = _inv(8, kinds=("block",))
    bi = torch.tensor([0.9, 0.1, 0.5, 0.05, 0.3, 0.2, 0.6, 0.01], dtype=torch.float64)
    al = allocate_blocks(inv, bi, 0.25)
    assert al.removed.nonzero().view(-1).tolist() == [3, 7]
    al = allocate_blocks(inv, bi, 0.25, guard=Guard(protect_last=2))
    assert al.removed.nonzero().view(-1).tolist() == [1, 3]
    sel = Selection.from_removed(inv, al.removed)
    assert sel.removed_blocks == [1, 3]


def test_a_shortfall_is_named_on_the_command_line(tmp_path, capsys):
    """Tiny Llama with 2 KV groups per layer at 30%: uniform allocation keeps ceil(0.7 x 2) = 2 groups, so no
    attention is pruned and the run realizes less than asked; the CLI says so, naming the KV groups."""
    from secateur.cli import main
    from secateur.testing import save_tiny

    model = save_tiny("llama", tmp_path / "m")
    text = tmp_path / "c.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    rc = main(["prune", "--model", model, "--method", "wanda-sp", "--sparsity", "0.3", "--calib", str(text),
               "--nsamples", "2", "--seqlen", "32", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 0
    assert "secateur: note: realized 0.19" in err and "KV groups 0.000 (0 of 4 units)" in err
    assert "--units head_slot,channel" in err  # the unit kind that can prune attention there


def test_no_shortfall_note_when_the_target_is_met():
    from secateur.budgets.allocate import shortfall_note

    info = {"realized": 0.295, "by_kind": {"channel": {"realized": 0.295, "removed_units": 3, "units": 10}}}
    assert shortfall_note(info, 0.3) is None
    assert "MLP channels 0.295" in shortfall_note(info, 0.4)
