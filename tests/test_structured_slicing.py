"""Physical slicing: zero units remove cleanly, sliced == masked dense model, GQA/bias handling, blocks."""

from __future__ import annotations

import copy

import pytest
import torch

from secateur.budgets.allocate import allocate_global
from secateur.errors import SecateurError
from secateur.models.adapters import get_adapter
from secateur.models.hetero import NullAttention
from secateur.scoring.structured import unit_scores
from secateur.structured.selection import LayerKeep, Selection
from secateur.structured.slicing import Replacement, add_bias, apply_selection, mask_selection
from secateur.structured.units import inventory
from secateur.testing import FAMILIES, random_ids, tiny_model

ATOL = 1e-5


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def greedy_logits(model, ids, steps=4):
    """Last-position logits of a greedy decode with the KV cache on."""
    out = []
    with torch.no_grad():
        o = model(input_ids=ids, use_cache=True)
        for _ in range(steps):
            out.append(o.logits[:, -1])
            tok = o.logits[:, -1].argmax(-1, keepdim=True)
            o = model(input_ids=tok, cache=o.cache, use_cache=True)
    return torch.stack(out)


def random_selection(model, seed=0, rho=0.4, kinds=("kv_group", "channel")):
    a = get_adapter(model)
    inv = inventory(a, kinds)
    al = allocate_global(inv, unit_scores(inv, a, "random", seed=seed), rho)
    return Selection.from_removed(inv, al.removed)


@pytest.mark.parametrize("family", FAMILIES)
def test_removing_zero_weight_units_leaves_logits_unchanged(family):
    m = tiny_model(family, layers=2)
    a = get_adapter(m)
    layer = a.layers[0]
    refs = a.role_refs(layer)
    with torch.no_grad():  # zero every weight of KV group 1 (heads 2, 3 under GQA; head 1 under MHA);
        mha = refs["k"].out_features == refs["q"].out_features  # MQA: query heads 2, 3 (the KV head stays)
        mqa = refs["k"].out_features == 8
        heads = [1] if mha else [2, 3]
        kv = 1
        qrows = torch.cat([torch.arange(8) + 8 * h for h in heads])
        kvrows = [] if mqa else [("k", torch.arange(8) + 8 * kv), ("v", torch.arange(8) + 8 * kv)]
        for role, rows in [("q", qrows), *kvrows]:
            refs[role].weight[rows] = 0
            if refs[role].bias is not None:
                refs[role].bias[rows] = 0
        refs["o"].weight[:, qrows] = 0
        for role in ("gate", "up"):  # and MLP channel 5 of layer 1
            if role in a.role_refs(a.layers[1]):
                r = a.role_refs(a.layers[1])[role]
                r.weight[5] = 0
                if r.bias is not None:
                    r.bias[5] = 0
        a.role_refs(a.layers[1])["down"].weight[:, 5] = 0
    ids = random_ids(2, 12)
    before = logits(m, ids)
    keep_heads = [h for h in range(4) if h not in heads]
    sel = Selection(8, 2, {0: LayerKeep(heads=keep_heads, kv_heads=[0, 2, 3] if mha else [0]),
                           1: LayerKeep(channels=[c for c in range(64) if c != 5])})
    apply_selection(m, a, sel)
    assert a.role_refs(a.layers[0])["o"].in_features == 8 * len(keep_heads)
    assert a.role_refs(a.layers[1])["down"].in_features == 63
    torch.testing.assert_close(logits(m, ids), before, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", [0, 3])
def test_sliced_equals_masked(family, seed):
    m = tiny_model(family, layers=4, seed=seed)
    sel = random_selection(m, seed=seed)
    masked = copy.deepcopy(m)
    mask_selection(masked, get_adapter(masked), sel)
    ids = random_ids(2, 10, seed=seed)
    assert (logits(masked, ids) - logits(m, ids)).abs().max() > 1e-3  # the selection does something
    n_before = sum(p.numel() for p in m.parameters())
    apply_selection(m, get_adapter(m), sel)
    assert sum(p.numel() for p in m.parameters()) < n_before
    torch.testing.assert_close(logits(m, ids), logits(masked, ids), atol=ATOL, rtol=0)
    torch.testing.assert_close(greedy_logits(m, ids[:1]), greedy_logits(masked, ids[:1]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_with_everything_removed(family):
    m = tiny_model(family, layers=3)
    sel = Selection(8, 3, {1: LayerKeep(heads=[], kv_heads=[], channels=[])})
    masked = copy.deepcopy(m)
    mask_selection(masked, get_adapter(masked), sel)
    apply_selection(m, get_adapter(m), sel)
    a = get_adapter(m)
    attn = a.layers[1].attn if family == "gpt2" else a.layers[1].self_attn
    assert isinstance(attn, NullAttention)
    assert m.config.secateur_layers[1]["n_heads"] == 0 and m.config.secateur_layers[1]["intermediate"] == 0
    ids = random_ids(2, 9)
    torch.testing.assert_close(logits(m, ids), logits(masked, ids), atol=ATOL, rtol=0)
    torch.testing.assert_close(greedy_logits(m, ids[:1]), greedy_logits(masked, ids[:1]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt", "gpt2"])
def test_replacements_with_bias_match_masked(family):
    m = tiny_model(family, layers=2)
    sel = Selection(8, 2, {0: LayerKeep(heads=[0, 1], kv_heads=[0] if family in ("llama", "qwen2") else [0, 1]),
                           1: LayerKeep(channels=list(range(0, 64, 2)))})
    g = torch.Generator().manual_seed(5)
    reps = {(0, "o"): Replacement(torch.randn(32, 16, generator=g), torch.randn(32, generator=g)),
            (1, "down"): (torch.randn(32, 32, generator=g), torch.randn(32, generator=g)),
            (1, "attn_out"): Replacement(torch.randn(32, 32, generator=g))}  # all columns kept
    masked = copy.deepcopy(m)
    mask_selection(masked, get_adapter(masked), sel, reps)
    apply_selection(m, get_adapter(m), sel, reps)
    a = get_adapter(m)
    assert a.role_refs(a.layers[0])["o"].bias is not None
    assert m.config.secateur_layers[1]["down_bias"]
    ids = random_ids(2, 9)
    torch.testing.assert_close(logits(m, ids), logits(masked, ids), atol=ATOL, rtol=0)
    with pytest.raises(SecateurError, match="replacement"):
        apply_selection(m, a, Selection(8, 2), {(0, "o"): torch.zeros(32, 3)})


def test_gqa_slicing_shapes_biases_and_qk_norm():
    m = tiny_model("qwen2", layers=2)
    old = m.model.layers[0].self_attn
    q_b, k_b = old.q_proj.bias.detach().clone(), old.k_proj.bias.detach().clone()
    apply_selection(m, get_adapter(m), Selection(8, 2, {0: LayerKeep(heads=[2, 3], kv_heads=[1])}))
    at = m.model.layers[0].self_attn
    assert at.q_proj.weight.shape == (16, 32) and at.k_proj.weight.shape == (8, 32)
    assert at.v_proj.weight.shape == (8, 32) and at.o_proj.weight.shape == (32, 16)
    assert at.num_key_value_groups == 2 and at.o_proj.bias is None
    torch.testing.assert_close(at.q_proj.bias, q_b[16:32])
    torch.testing.assert_close(at.k_proj.bias, k_b[8:16])
    m3 = tiny_model("qwen3", layers=1)
    qn = m3.model.layers[0].self_attn.q_norm.weight.detach().clone()
    apply_selection(m3, get_adapter(m3), Selection(8, 1, {0: LayerKeep(heads=[0, 1], kv_heads=[0])}))
    assert torch.equal(m3.model.layers[0].self_attn.q_norm.weight, qn) and qn.shape == (8,)


def test_partial_kv_group_is_refused():
    m = tiny_model("llama", layers=1)
    with pytest.raises(SecateurError, match="KV groups"):
        apply_selection(m, get_adapter(m), Selection(8, 1, {0: LayerKeep(heads=[0, 1, 2], kv_heads=[0, 1])}))


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt", "gpt2"])
def test_block_removal_equals_identity_blocks(family):
    m = tiny_model(family, layers=4)
    sel = Selection(8, 4, removed_blocks=[1, 2])
    masked = copy.deepcopy(m)
    mask_selection(masked, get_adapter(masked), sel)
    apply_selection(m, get_adapter(m), sel)
    a = get_adapter(m)
    assert a.n_layers == 2 and m.config.num_hidden_layers == 2
    assert len(getattr(m.config, "layer_types", None) or [0, 0]) == 2
    attn = a.layers[1].attn if family == "gpt2" else a.layers[1].self_attn
    assert attn.layer_idx == 1
    ids = random_ids(2, 9)
    torch.testing.assert_close(logits(m, ids), logits(masked, ids), atol=ATOL, rtol=0)
    torch.testing.assert_close(greedy_logits(m, ids[:1]), greedy_logits(masked, ids[:1]), atol=ATOL, rtol=0)


def test_add_bias_on_bias_free_projection():
    m = tiny_model("llama", layers=1)
    ids = random_ids(1, 6)
    before = logits(m, ids)
    o = m.model.layers[0].self_attn.o_proj
    assert o.bias is None
    add_bias(o)
    assert o.bias is not None and not o.bias.any()
    torch.testing.assert_close(logits(m, ids), before)
    b = torch.randn(32)
    ref = get_adapter(m).role_refs(m.model.layers[0])["down"]
    add_bias(ref, b)
    assert torch.equal(m.model.layers[0].mlp.down_proj.bias, b)


def test_compensator_results_with_any_column_order():
    """Objects with weight/bias/kept (secateur.compensate.Compensation) are accepted; columns reordered."""
    from types import SimpleNamespace

    from secateur.calib.stats import Gram
    from secateur.compensate.flap_bias import flap_bias

    m = tiny_model("llama", layers=1)
    sel = Selection(8, 1, {0: LayerKeep(heads=[2, 3], kv_heads=[1], channels=list(range(10, 50)))})
    ids = random_ids(2, 8)
    g = Gram(64)
    hook = m.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda _m, args: g.update(args[0]))
    logits(m, ids)
    hook.remove()
    wd = m.model.layers[0].mlp.down_proj.weight.detach()
    comp = flap_bias(wd, g, sel.kept_columns(0, "mlp_out").flip(0))  # reversed column order
    gen = torch.Generator().manual_seed(0)
    kept_o = sel.kept_columns(0, "attn_out")
    perm = torch.randperm(16, generator=gen)
    w_o = torch.randn(32, 16, generator=gen)
    reps = {(0, "down"): comp, (0, "o"): SimpleNamespace(weight=w_o[:, perm], bias=None, kept=kept_o[perm])}
    masked = copy.deepcopy(m)
    mask_selection(masked, get_adapter(masked), sel, reps)
    apply_selection(m, get_adapter(m), sel, reps)
    torch.testing.assert_close(m.model.layers[0].self_attn.o_proj.weight, w_o)
    assert m.model.layers[0].mlp.down_proj.bias is not None
    torch.testing.assert_close(logits(m, ids), logits(masked, ids), atol=ATOL, rtol=0)
    bad = {(0, "o"): SimpleNamespace(weight=w_o, bias=None, kept=kept_o + 1)}
    fresh = tiny_model("llama", layers=1)
    with pytest.raises(SecateurError, match="kept columns"):
        apply_selection(fresh, get_adapter(fresh), sel, bad)
