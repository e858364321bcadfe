"""head_slot units (issue 16 §1): one query head of every KV group, chosen by per-head scores; the group size
stays uniform, slicing equals masking, exports reload, the realized fraction gets close to the target."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from secateur.budgets.allocate import allocate_uniform, shortfall_note
from secateur.budgets.select import select_units
from secateur.calib.collect import collect_stats
from secateur.errors import SecateurError
from secateur.export.sliced import save_pruned
from secateur.methods.materialize import COMPENSATIONS, CompensationConfig, compensate_selection
from secateur.methods.structured import StructuredConfig, prune_structured, stat_kinds
from secateur.models import hetero
from secateur.models.adapters import get_adapter
from secateur.scoring.structured import register_scorer, unit_scores
from secateur.structured.selection import LayerKeep, Selection
from secateur.structured.slicing import apply_selection, mask_selection
from secateur.structured.units import inventory, rank_slots
from secateur.testing import random_ids, tiny_model

GQA = ("llama", "mistral", "qwen2", "qwen3", "phi3")  # tiny configs with 4 query heads on 2 KV heads
# Sliced vs masked: the kept heads run the same kernels on the same values; the masked model adds exact zeros
# (zeroed q rows give q = 0, whose attention output meets zeroed o_proj columns). What can differ is only the
# float32 summation order of o_proj's reduction over 32 vs 16 inputs: a few ulps of O(1) logits (2^-23 ~ 1.2e-7
# each), far below 1e-5.
ATOL = 1e-5


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def qwen2_g5(layers: int = 2) -> torch.nn.Module:
    """Qwen2 with 2 KV groups of 5 query heads (head_dim 8, q/k/v biases) and 80 MLP channels."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, num_hidden_layers=layers, hidden_size=32, intermediate_size=80,
                      num_attention_heads=10, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()


# --- membership: slot j = the j-th lowest-scored head of every group ---------------------------------------

def test_rank_slots_follows_scores_with_lower_index_first_on_ties():
    inv = inventory(get_adapter(qwen2_g5()), ("head_slot",))
    p = inv.pools[0]
    assert p.kind == "head_slot" and p.n == 5 and not p.ranked
    # group 0 = heads 0..4, group 1 = heads 5..9; ties: heads 1 and 3 (2.0), heads 5, 6, 7 (0.5)
    scores = torch.tensor([3.0, 2.0, 9.0, 2.0, 1.0, 0.5, 0.5, 0.5, 7.0, -1.0])
    rank_slots(p, scores)
    slots = [inv.unit(p.offset + j).heads for j in range(5)]
    assert slots == [(4, 9), (1, 5), (3, 6), (0, 7), (2, 8)]
    assert inv.unit(p.offset).kv_heads == (0, 1) and p.ranked


def test_scorer_ranks_slots_and_sums_their_heads():
    m = qwen2_g5()
    a = get_adapter(m)
    with torch.no_grad():  # o_proj column norms set per head: magnitude's per-head score = 8 * scale
        o = a.role_refs(a.layers[0])["o"].weight
        scale = torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0, 2.0, 2.0, 9.0, 1.0, 3.0])
        o.copy_(torch.ones_like(o) / o.shape[0] ** 0.5 * scale.repeat_interleave(8))
    inv = inventory(a, ("head_slot",))
    s = unit_scores(inv, a, "magnitude")
    head = scale * 8  # ||W_:,j|| = scale per column, 8 columns per head
    assert [inv.unit(j).heads for j in range(5)] == [(1, 8), (3, 5), (4, 6), (2, 9), (0, 7)]  # 5, 6 tie: 5 first
    want = torch.tensor([head[1] + head[8], head[3] + head[5], head[4] + head[6], head[2] + head[9],
                         head[0] + head[7]], dtype=torch.float64)
    torch.testing.assert_close(s[:5], want)
    assert bool((s[:5].diff() >= 0).all())  # slot scores are nested: slot j never outranks slot j + 1


def test_uniform_allocation_removes_the_lowest_slots_and_keeps_group_sizes():
    m = qwen2_g5()
    sel = select_units(get_adapter(m), "magnitude", 0.4, kinds=("head_slot",))
    for k in sel.layers.values():
        assert k.kv_heads == [0, 1]
        per_group = [sum(h // 5 == g for h in k.heads) for g in (0, 1)]
        assert per_group == [3, 3]  # ceil(0.6 * 5) slots kept: 3 heads in each group
    info = sel.info["by_kind"]["head_slot"]
    assert (info["units"], info["removed_units"]) == (10, 4)


def test_flap_alam_ranks_slots_by_standardized_head_scores():
    m = qwen2_g5()
    a = get_adapter(m)
    stats = collect_stats(m, a, random_ids(2, 16), stat_kinds(StructuredConfig(score="flap")))
    sel = select_units(a, "flap", 0.3, stats.groups, kinds=("head_slot", "channel"), allocation="flap")
    uni = select_units(a, "flap", 0.4, stats.groups, kinds=("head_slot",))
    for k in list(sel.layers.values()) + list(uni.layers.values()):
        if k.heads is not None:
            assert k.kv_heads == [0, 1] and sum(h < 5 for h in k.heads) == sum(h >= 5 for h in k.heads)
    # AL-AM's per-head z is monotone in the uniform score's per-head sum: both rank the slots alike
    inv_u, inv_z = inventory(a, ("head_slot",)), inventory(a, ("head_slot",))
    unit_scores(inv_u, a, "flap", stats.groups)
    from secateur.scoring.structured import flap_alam_scores

    flap_alam_scores(inv_z, a, stats.groups)
    assert all(torch.equal(p.members, q.members) for p, q in zip(inv_u.pools, inv_z.pools))


# --- slicing == masking, for every GQA family, uniform and global, with every compensator ----------------------

@pytest.mark.parametrize("family", GQA)
@pytest.mark.parametrize("allocation", ["uniform", "global"])
def test_sliced_equals_masked_dense(family, allocation):
    m = tiny_model(family, layers=3)
    a = get_adapter(m)
    sel = select_units(a, "random", 0.5, kinds=("head_slot", "channel"), allocation=allocation, seed=3)
    assert any(k.heads is not None for k in sel.layers.values())
    dense = copy.deepcopy(m)
    masked = mask_selection(dense, get_adapter(dense), sel)
    ids = random_ids(2, 12)
    want = logits(masked, ids)
    apply_selection(m, a, sel)
    for i, layer in enumerate(a.layers):
        k = sel.layers.get(i, LayerKeep())
        n_h = len(k.heads) if k.heads is not None else 4
        attn = hetero.attention_module(family, layer)
        if n_h:  # a uniform group size: the stock forward's repeat_kv reads it
            assert attn.num_key_value_groups == n_h // 2
    torch.testing.assert_close(logits(m, ids), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("comp", [c for c in COMPENSATIONS if c != "none"])
def test_compensation_writes_the_kept_columns_of_the_slots(comp):
    base = tiny_model("qwen2", layers=2)
    ids = random_ids(2, 16)
    a = get_adapter(base)
    stats = collect_stats(base, a, ids, stat_kinds(StructuredConfig(compensation="ls")))
    sel = select_units(a, "wanda_sp", 0.5, stats.groups, kinds=("head_slot", "channel"))
    kept = sel.kept_columns(0, "attn_out")
    assert kept.numel() == 2 * 8  # one head of each of the 2 groups, 8 columns each
    cfg = CompensationConfig(compensation=comp)
    if comp == "coec":
        from secateur.compensate import COECOptions

        cfg = CompensationConfig(compensation=comp, coec=COECOptions(max_rounds=2))
    reps, records, _ = compensate_selection(base, a, sel, stats, cfg)
    assert {(r["layer"], r["group"]) for r in records} >= {(0, "attn_out"), (1, "attn_out")}
    assert all(r["recon_after"] <= r["recon_before"] + 1e-9 for r in records)
    dense = copy.deepcopy(base)
    want = logits(mask_selection(dense, get_adapter(dense), sel, reps), ids)
    apply_selection(base, a, sel, reps)
    torch.testing.assert_close(logits(base, ids), want, atol=ATOL, rtol=0)


# --- export: stock config with the new head count, hetero when uneven -------------------------------------

@pytest.mark.parametrize("family", GQA)
def test_uniform_slots_export_to_a_stock_config(family, tmp_path):
    m = tiny_model(family, layers=2)
    a = get_adapter(m)
    apply_selection(m, a, select_units(a, "magnitude", 0.5, kinds=("head_slot", "channel")))
    r = save_pruned(m, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert r["route"] == "stock" and cfg["model_type"] == family
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (2, 2, 8)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = random_ids(2, 11)
    assert torch.equal(logits(loaded, ids), logits(m, ids))


def test_uneven_slots_export_to_the_per_layer_config(tmp_path):
    m = qwen2_g5(layers=3)
    a = get_adapter(m)
    sel = select_units(a, "random", 0.4, kinds=("head_slot", "channel"), allocation="global", seed=1)
    apply_selection(m, a, sel)
    heads = [s["n_heads"] for s in m.config.secateur_layers]
    assert len(set(heads)) > 1 and all(h % 2 == 0 for h in heads)
    r = save_pruned(m, tmp_path / "out")
    assert r["route"] == "hetero"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = random_ids(2, 11)
    assert torch.equal(logits(loaded, ids), logits(m, ids))


# --- what is realized ---------------------------------------------------------------------------------------

def test_twenty_percent_uniform_is_realized_with_slots_not_with_kv_groups():
    a = get_adapter(qwen2_g5())
    kv = select_units(a, "magnitude", 0.2, kinds=("kv_group", "channel"))
    slots = select_units(a, "magnitude", 0.2, kinds=("head_slot", "channel"))
    assert kv.info["by_kind"]["kv_group"]["removed_units"] == 0  # ceil(0.8 x 2) = 2 groups kept
    assert kv.info["realized"] == pytest.approx(1536 / 13936)  # MLP only: 16 of 80 channels of 96 params
    assert slots.info["realized"] == pytest.approx(0.2)  # 1 of 5 slots (1040 params) + 16 channels, of 12880
    note = shortfall_note(kv.info, 0.2)
    assert "head_slot" in note and shortfall_note(slots.info, 0.2) is None


def test_qwen25_05b_geometry_realizes_close_to_twenty_percent():
    """Qwen2.5-0.5B layer shapes (896 wide, 14 query heads on 2 KV heads, 4864 channels), on the meta device:
    20% uniform realizes 0.175 with KV groups (no group removed) and 0.194 with head slots (1 of 7 kept out)."""
    cfg = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=2, num_attention_heads=14,
                      num_key_value_heads=2, vocab_size=1000)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    a = get_adapter(m)
    real = {}
    for kind in ("kv_group", "head_slot"):
        inv = inventory(a, (kind, "channel"))
        real[kind] = allocate_uniform(inv, torch.zeros(len(inv), dtype=torch.float64), 0.2).info["realized"]
    assert round(real["kv_group"], 4) == 0.1752 and round(real["head_slot"], 4) == 0.1936


# --- refusals -------------------------------------------------------------------------------------------------

def test_refusals():
    with pytest.raises(SecateurError, match="MHA.*use head units"):
        inventory(get_adapter(tiny_model("opt")), ("head_slot",))
    with pytest.raises(SecateurError, match="names two attention units"):
        StructuredConfig(score="wanda_sp", units=("kv_group", "head_slot")).validate()
    with pytest.raises(SecateurError, match="corp ranks MLP channels .--units channel. and query.key head dimensions"):
        StructuredConfig(score="corp", units=("head_slot", "channel"), compensation="corp").validate()
    a = get_adapter(tiny_model("llama"))
    register_scorer("h5_flat", lambda inv, adapter, stats, **kw: torch.zeros(len(inv)))
    with pytest.raises(SecateurError, match="no per-query-head scores"):
        unit_scores(inventory(a, ("head_slot",)), a, "h5_flat")
    inv = inventory(a, ("head_slot",))  # never ranked: a selection refuses it
    with pytest.raises(SecateurError, match="never ranked"):
        Selection.from_removed(inv, torch.tensor([True, False, False, False]))
    # uneven groups: Hugging Face's repeat_kv cannot run them
    with pytest.raises(SecateurError, match="same number of heads from each of the kept KV groups"):
        apply_selection(tiny_model("llama"), a, Selection(8, 2, {0: LayerKeep(heads=[0, 1, 2], kv_heads=[0, 1])}))


def test_removing_every_slot_removes_the_attention():
    """The MQA rule: the KV heads are no slot's cost and go with the last slot."""
    m = tiny_model("llama", layers=2)
    a = get_adapter(m)
    inv = inventory(a, ("head_slot",))
    unit_scores(inv, a, "magnitude")
    sel = Selection.from_removed(inv, torch.tensor([True, True, False, False]))
    assert sel.layers[0].heads == [] and sel.layers[0].kv_heads == []
    ids = random_ids(1, 8)
    dense = copy.deepcopy(m)
    want = logits(mask_selection(dense, get_adapter(dense), sel), ids)
    apply_selection(m, a, sel)
    assert type(a.layers[0].self_attn).__name__ == "NullAttention"
    torch.testing.assert_close(logits(m, ids), want, atol=ATOL, rtol=0)


def test_cli_head_slot_units_reach_the_target_and_reload(tmp_path, capsys):
    from secateur.cli import main
    from secateur.testing import save_tiny

    model = save_tiny("llama", tmp_path / "m")
    text = tmp_path / "c.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "out"
    rc = main(["prune", "--model", model, "--method", "wanda-sp", "--sparsity", "0.5", "--units", "head_slot,channel",
               "--calib", str(text), "--nsamples", "2", "--seqlen", "32", "--quiet", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "note: realized" not in err
    rep = json.loads((out / "secateur-report.json").read_text())
    d = rep["details"]
    assert d["units"] == ["head_slot", "channel"] and d["realized"] == pytest.approx(0.5)
    assert d["by_kind"]["head_slot"]["removed_units"] == 2  # 1 of 2 slots in each of 2 layers
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (2, 2)
    AutoModelForCausalLM.from_pretrained(out)


def test_prune_structured_with_rcpu_on_slots():
    m = tiny_model("qwen3", layers=2)
    ids = random_ids(2, 16)
    res = prune_structured(m, get_adapter(m), ids, StructuredConfig(score="rcpu", sparsity=0.5, compensation="rcpu",
                                                                     units=("head_slot", "channel")))
    assert res.details["by_kind"]["head_slot"]["realized"] == pytest.approx(0.5)
    assert torch.isfinite(logits(m, ids)).all()
