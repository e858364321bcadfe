"""CORP Q/K end to end: statistics from the engine, dims kept per head, compensation folded into W_Q/W_K and
written back by zeroing (OPT, GPT-2's fused c_attn), CLI and reload."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, OPTConfig

from secateur.cli import main
from secateur.errors import SecateurError
from secateur.methods.corp_qk import CorpQKConfig, prune_corp_qk
from secateur.models.adapters import get_adapter
from secateur.testing import random_ids, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
NON_ROPE = ("opt", "gpt2")


def block0_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Per-head pre-softmax q.k of block 0 on ``ids`` (its input does not depend on any pruning)."""
    a = get_adapter(model)
    g = a.geometry
    x, _ = a.capture_inputs(ids)
    layer = a.layers[0]
    with torch.no_grad():
        xn = a.attn_norm(layer, x)
        refs = a.role_refs(layer)
        q, k = (torch.nn.functional.linear(xn, refs[r].weight, refs[r].bias) for r in ("q", "k"))
    b, t, _ = q.shape
    q = q.view(b, t, g.n_heads, g.head_dim).transpose(1, 2)
    k = k.view(b, t, g.n_kv_heads, g.head_dim).transpose(1, 2)
    return q @ k.transpose(-1, -2)


def _prune(family: str, rho: float, ids, **kw):
    m = tiny_model(family)
    res = prune_corp_qk(m, get_adapter(m), ids, CorpQKConfig(sparsity=rho, min_qk_dim=2, **kw), progress=False)
    return m, res


@pytest.mark.parametrize("family", NON_ROPE)
def test_compensation_beats_zeroing_the_same_dims(family):
    """The folded weights reproduce the dense logits better than dropping the same dims, in the model itself
    (a misaligned write-back of q and k rows would make them far worse)."""
    ids = random_ids(4, 24)
    dense = block0_logits(tiny_model(family), ids)
    m, res = _prune(family, 0.5, ids)
    comp = block0_logits(m, ids)
    masks = {k: v for k, v in res["masks"].items() if ".0." in k}
    plain = tiny_model(family)
    with torch.no_grad():
        for name, mask in masks.items():
            mod = plain.get_submodule(name)
            w = mod.weight.T if family == "gpt2" else mod.weight
            w.masked_fill_(mask, 0)
            rows = mask.all(1)
            mod.bias[rows] = 0
    zeroed = block0_logits(plain, ids)
    err = lambda x: float((x - dense).norm() / dense.norm())  # noqa: E731
    assert err(comp) < err(zeroed)
    lay = res["details"]["layers"][0]
    assert lay["logit_rel_after"] <= lay["logit_rel_before"]


@pytest.mark.parametrize("family", NON_ROPE)
def test_masks_remove_floor_rho_dims_per_head_and_are_zero(family):
    ids = random_ids(2, 16)
    m, res = _prune(family, 0.5, ids)
    g = get_adapter(m).geometry
    for name, mask in res["masks"].items():
        mod = m.get_submodule(name)
        w = mod.weight.T if family == "gpt2" else mod.weight
        assert torch.all(w[mask] == 0)
        rows = mask.all(1)
        assert torch.all(mod.bias[rows] == 0)
        qk_rows = rows[: 2 * g.n_heads * g.head_dim].view(-1, g.head_dim)  # q then k heads (GPT-2: v after)
        assert (qk_rows.sum(1) == g.head_dim // 2).all()
        assert not rows[2 * g.n_heads * g.head_dim:].any()  # v untouched


def test_rho_zero_keeps_the_model():
    ids = random_ids(2, 16)
    m, _ = _prune("opt", 0.0, ids, lam=1e-12)
    ref = tiny_model("opt")
    x = random_ids(2, 10, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(m(x).logits, ref(x).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rope_or_qk_norm_models_are_refused(family):
    m = tiny_model(family)
    with pytest.raises(SecateurError, match="RoPE|rotary|normalizes"):
        prune_corp_qk(m, get_adapter(m), random_ids(2, 8), CorpQKConfig(), progress=False)


def test_cli_prune_reload_identical(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2,
                    max_position_embeddings=256, word_embed_proj_dim=64)  # d_h = 32 > min_qk_dim
    src = tmp_path / "opt"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(src)
    tiny_tokenizer().save_pretrained(src)
    calib = tmp_path / "c.txt"
    calib.write_text("the quick brown fox jumps over the lazy dog " * 40)
    out = tmp_path / "out"
    assert main(["prune", "--model", str(src), "--method", "corp-qk", "--sparsity", "0.25", "--calib", str(calib),
                 "--nsamples", "2", "--seqlen", "32", "--out", str(out), "--quiet"]) == 0
    rep = json.loads((out / "secateur-report.json").read_text())
    assert rep["details"]["d_s"] == [24]  # 32 - floor(0.25 * 32)
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    w = loaded.model.decoder.layers[0].self_attn.q_proj.weight
    assert int((w.abs().sum(1) == 0).sum()) == 2 * 8  # 8 dims of each of 2 heads
    assert main(["prune", "--model", str(src), "--method", "corp-qk", "--budget", "row", "--calib", str(calib),
                 "--out", str(tmp_path / "x")]) != 0


def test_cli_refuses_a_rope_model_before_building_calibration(tmp_path, capsys, monkeypatch):
    import secateur.api
    from secateur.testing import save_tiny

    def fail(*a, **k):
        raise AssertionError("calibration data was built before the model check")

    monkeypatch.setattr(secateur.api, "calibration_set", fail)  # the model check must fire first
    src = save_tiny("llama", tmp_path / "llama")
    rc = main(["prune", "--model", src, "--method", "corp-qk", "--calib", "self", "--seqlen", "16",
               "--out", str(tmp_path / "out")])
    assert rc != 0
    assert "rotary" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
