"""Save/reload with identical logits, atomic output, bit-packed masks, perplexity protocols."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from secateur.errors import SecateurError
from secateur.eval.ppl import perplexity, window_plan
from secateur.export.hf import save_run
from secateur.masks_file import load_masks
from secateur.methods.unstructured import UnstructuredConfig, prune_unstructured
from secateur.models.adapters import get_adapter
from secateur.safe_write import atomic_dir
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


def test_bos_convention_follows_the_tokenizer():
    """A tokenizer that adds no BOS keeps today's protocol (results files stay valid); one that prepends BOS gets
    one BOS in front of the stream (window 0), named in the protocol; ``every`` starts each window with BOS."""
    from secateur.eval.ppl import bos_convention

    plain, with_bos = tiny_tokenizer(), tiny_tokenizer(bos=True)
    assert bos_convention(plain) is None and bos_convention(with_bos) == 1 and bos_convention(None) is None
    assert with_bos("ab")["input_ids"][0] == 1 and with_bos("ab", add_special_tokens=False)["input_ids"][0] != 1
    model = tiny_model("llama")
    ids = random_ids(1, 200)[0].clamp(min=3)
    r0 = perplexity(model, ids, seqlen=64, progress=False)
    rp = perplexity(model, ids, seqlen=64, progress=False, tokenizer=plain)
    assert rp["protocol"] == r0["protocol"] == "nonoverlap-64" and rp["bos"] == r0["bos"] == "none"
    assert rp["ppl"] == r0["ppl"]
    rf = perplexity(model, ids, seqlen=64, progress=False, tokenizer=with_bos)
    assert rf["protocol"] == "nonoverlap-64+bos-first" and rf["bos"] == "first"
    stream = torch.cat([torch.tensor([1]), ids])
    assert rf["ppl"] == perplexity(model, stream, seqlen=64, progress=False)["ppl"]
    assert rf["windows"] == 201 // 64 and rf["corpus_tokens"] == 200
    re_ = perplexity(model, ids, seqlen=64, progress=False, tokenizer=with_bos, bos="every")
    assert re_["protocol"] == "nonoverlap-64+bos-every" and re_["windows"] == 200 // 63
    tot = 0.0
    for i in range(200 // 63):
        w = torch.cat([torch.tensor([1]), ids[i * 63:(i + 1) * 63]])[None]
        tot += model(w, labels=w).loss.item() * 63
    assert math.isclose(re_["ppl"], math.exp(tot / (3 * 63)), rel_tol=1e-5)
    with pytest.raises(SecateurError, match="BOS token"):
        perplexity(model, ids, seqlen=64, progress=False, bos="first")
