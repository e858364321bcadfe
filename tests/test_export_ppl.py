"""Save/reload with identical logits, atomic output, bit-packed masks, perplexity protocols."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from secateur.errors import SecateurError
from secateur.eval.ppl import perplexity, window_plan
from secateur.export.folder import atomic_dir
from secateur.export.hf import load_masks, save_run
from secateur.methods.unstructured import UnstructuredConfig, prune_unstructured
from secateur.models.adapters import get_adapter
from secateur.testing import FAMILIES, random_ids, tiny_model, tiny_tokenizer


@pytest.mark.parametrize("family", FAMILIES)
def test_reload_gives_identical_logits(family, tmp_path):
    model = tiny_model(family)
    res = prune_unstructured(model, get_adapter(model), random_ids(2, 16),
                             UnstructuredConfig(method="wanda", sparsity=0.5), progress=False)
    out = save_run(model, tiny_tokenizer(), tmp_path / "m", {"method": "wanda"}, res.masks)
    again = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    ids = random_ids(2, 20, seed=3)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)
    masks = load_masks(out / "secateur-masks.npz")
    assert masks.keys() == res.masks.keys()
    assert all(torch.equal(masks[k], res.masks[k]) for k in masks)


def test_atomic_dir_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("boom")
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_atomic_dir_refuses_existing(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(SecateurError, match="already exists"):
        with atomic_dir(tmp_path / "out"):
            pass


def test_chunked_nll_equals_model_loss():
    """E1: our chunked float32 NLL equals the model's own loss."""
    model = tiny_model("llama")
    ids = random_ids(1, 200)[0]
    r = perplexity(model, ids, seqlen=64, progress=False)
    tot = 0.0
    for i in range(200 // 64):
        w = ids[i * 64:(i + 1) * 64][None]
        tot += model(w, labels=w).loss.item() * 63
    assert math.isclose(r["ppl"], math.exp(tot / (3 * 63)), rel_tol=1e-5)
    assert r["windows"] == 200 // 64 and r["protocol"] == "nonoverlap-64"


@pytest.mark.parametrize("n_tok,L,S", [(100, 32, 8), (2048 * 3 + 7, 2048, 512), (50, 16, 16)])
def test_window_plan_scores_every_token_but_first_once(n_tok, L, S):
    """E2: sliding windows score each token except the first exactly once; non-overlap uses floor(N/L)."""
    plan = window_plan(n_tok, L, S if S < L else None)
    if S >= L:
        assert len(plan) == n_tok // L
        return
    scored = torch.zeros(n_tok, dtype=torch.long)
    for _b, e, n in plan:
        scored[e - n:e] += 1
    assert scored[0] == 0 and (scored[1:] == 1).all()
