"""CoCurve held-out selection (cocurve.md §6, V8, V9): masking hooks == zeroed == sliced; lowest KL wins."""

from __future__ import annotations

import copy

import pytest
import torch

from secateur.budgets.heldout import HeldoutKL, masked, select_heldout
from secateur.methods.cocurve import cocurve_inventory
from secateur.models.adapters import get_adapter
from secateur.structured.selection import Selection
from secateur.structured.slicing import apply_selection, mask_selection
from secateur.testing import random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _random_mask(n: int, k: int, seed: int) -> torch.Tensor:
    r = torch.zeros(n, dtype=torch.bool)
    r[torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k]] = True
    return r


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt", "gpt2"])
def test_hook_masking_equals_zeroed_and_sliced_models(family):
    model = tiny_model(family, layers=3)
    a = get_adapter(model)
    inv = cocurve_inventory(a, n_ffn_groups=4)
    removed = _random_mask(len(inv), len(inv) // 3, seed=1)
    ids = random_ids(2, 12)
    with torch.no_grad(), masked(a, inv, removed):
        hooked = model(ids).logits
    with torch.no_grad():
        dense = model(ids).logits
    assert not torch.allclose(hooked, dense)  # the mask does something
    sel = Selection.from_removed(inv, removed)
    m2 = copy.deepcopy(model)
    mask_selection(m2, get_adapter(m2), sel)
    m3 = copy.deepcopy(model)
    apply_selection(m3, get_adapter(m3), sel)
    with torch.no_grad():
        zeroed, sliced = m2(ids).logits, m3(ids).logits
        after = model(ids).logits
    assert torch.allclose(hooked, zeroed, atol=1e-5)
    assert torch.allclose(hooked, sliced, atol=1e-5)
    assert torch.equal(after, dense)  # hooks removed, weights untouched


def _brute_kl(model, inv, removed, ids) -> float:
    """Independent reference: zero the weights of a copy, full-vocabulary KL in float64."""
    m2 = copy.deepcopy(model)
    mask_selection(m2, get_adapter(m2), Selection.from_removed(inv, removed))
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits.double(), -1)
        lq = torch.log_softmax(m2(ids).logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def test_heldout_kl_and_selection_picks_the_lowest_kl():
    model = tiny_model("llama", layers=4)
    a = get_adapter(model)
    inv = cocurve_inventory(a, n_ffn_groups=4)
    ids = random_ids(3, 16, seed=7)
    teacher = HeldoutKL(model, ids, chunk=5)
    assert teacher.evaluate()["kl"] == pytest.approx(0.0, abs=1e-7)
    masks = [_random_mask(len(inv), k, seed=k) for k in (9, 3, 6, 1)]
    res = select_heldout(a, inv, masks, teacher)
    ref = [_brute_kl(model, inv, r, ids) for r in masks]
    # Every comparison below computes the same KLs through differently shaped float32 GEMMs (another LM-head
    # chunking, zeroed or sliced weights), so each log-prob may move in its last bits: |d log p_v| <= ~2 eps32
    # max|log p| (logit rounding, then log-sum-exp), on both sides of a token's KL sum_v p_v (log p_v - log q_v)
    # with sum_v p_v = 1. That is an absolute bound per token, hence on the mean; a relative tolerance fails
    # for the small KLs (1.6e-5 here moved by 9e-10 = 6e-5 relative on an AMD EPYC).
    bound = 4 * torch.finfo(torch.float32).eps * max(float(lp.abs().max()) for lp in teacher.logp0)
    assert res["kl"] == pytest.approx(ref, rel=1e-3, abs=bound)  # float32 logits (cocurve.md §11)
    assert res["chosen"] == min(range(len(ref)), key=ref.__getitem__)
    assert res["chosen"] in res["one_se_set"]
    # another model (a sliced copy) scored against the same teacher gives the masked model's KL
    sliced = copy.deepcopy(model)
    apply_selection(sliced, get_adapter(sliced), Selection.from_removed(inv, masks[0]))
    assert teacher.evaluate(sliced)["kl"] == pytest.approx(res["kl"][0], rel=1e-12, abs=bound)
    # recomputing the dense teacher (no cache) gives the same numbers
    uncached = HeldoutKL(model, ids, chunk=7, cache_elems=0)
    assert not uncached.cached
    assert select_heldout(a, inv, masks, uncached)["kl"] == pytest.approx(res["kl"], rel=1e-12, abs=bound)


def test_ties_go_to_the_first_candidate():
    model = tiny_model("llama", layers=3)
    a = get_adapter(model)
    inv = cocurve_inventory(a, n_ffn_groups=4)
    r = _random_mask(len(inv), 4, seed=2)
    res = select_heldout(a, inv, [_random_mask(len(inv), 8, seed=3), r, r.clone()], HeldoutKL(model, random_ids(2, 8)))
    assert res["kl"][1] == res["kl"][2]
    assert res["chosen"] in (0, 1)
