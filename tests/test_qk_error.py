"""Held-out QK reconstruction error (Eq. 49) and stage errors (Eq. 51): exact brute-force references on tiny
models (spec evaluation.md §3 and §7 E3; qk-wanda.md §11 I13), the held-out set, the plots."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import DATA_DIR, requires_data
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from secateur.errors import SecateurError
from secateur.eval.qk_error import QK_ERROR_SEED, heldout_ids, qk_error, qk_errors
from secateur.methods.qk_wanda import QKWandaConfig, prune_qk_wanda
from secateur.models.adapters import get_adapter
from secateur.scoring import model_rope_tables
from secateur.testing import random_ids, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def random_masks(model, rho=0.5, seed=0, roles=("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] in roles:  # masks are [out, in] (GPT-2's Conv1D stores [in, out])
            shape = mod.weight.shape[::-1] if type(mod).__name__ == "Conv1D" else mod.weight.shape
            out[name] = torch.rand(shape, generator=g) < rho
    return out


def apply_masks(model, masks):
    m = copy.deepcopy(model)
    with torch.no_grad():
        for k, mask in masks.items():
            mod = m.get_submodule(k)
            mod.weight.masked_fill_(mask.T if type(mod).__name__ == "Conv1D" else mask, 0)
    return m


def layer_io(model, ids):
    """Inputs and outputs of every decoder layer, and the q_proj input, from one plain forward."""
    ins, outs, xs = [], [], []
    hooks = []

    def io_hook(mod, args, kwargs, out) -> None:
        ins.append(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])
        outs.append(out[0] if isinstance(out, tuple) else out)

    def x_hook(mod, args) -> None:
        xs.append(args[0])

    for layer in model.model.layers:
        hooks.append(layer.register_forward_hook(io_hook, with_kwargs=True))
        hooks.append(layer.self_attn.q_proj.register_forward_pre_hook(x_hook))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    return ins, outs, xs


@torch.no_grad()
def brute_force(dense, pruned, ids):
    """Every T x T product materialized at once (all sequences, all heads), float64."""
    g = get_adapter(dense).geometry
    hq, hk, m = g.n_heads, g.n_kv_heads, g.head_dim
    ins, outs, xs = layer_io(dense, ids)
    _, pouts, _ = layer_io(pruned, ids)  # rollout: the pruned model's own trajectory
    cos, sin = model_rope_tables(dense, ids.shape[1])
    causal = torch.ones(ids.shape[1], ids.shape[1]).tril().bool()
    per_block, lg_num, lg_den, blk_num, blk_den, roll_num = [], 0.0, 0.0, 0.0, 0.0, 0.0
    for i, (ld, lp) in enumerate(zip(dense.model.layers, pruned.model.layers)):
        x = xs[i].double()

        def prods(layer, rope, x=x):
            a = layer.self_attn
            B, T = x.shape[:2]
            Q = (x @ a.q_proj.weight.double().T + (0 if a.q_proj.bias is None else a.q_proj.bias.double()))
            K = (x @ a.k_proj.weight.double().T + (0 if a.k_proj.bias is None else a.k_proj.bias.double()))
            Q, K = Q.reshape(B, T, hq, m), K.reshape(B, T, hk, m)
            if rope:
                Q, K = apply_rotary_pos_emb(Q, K, cos[None].double(), sin[None].double(), unsqueeze_dim=2)
            K = K.repeat_interleave(hq // hk, dim=2)
            return torch.einsum("bthm,buhm->bhtu", Q, K)

        Bd, Bp = prods(ld, False), prods(lp, False)
        per_block.append(100 * float(((Bp - Bd) ** 2).sum() / (Bd ** 2).sum()))
        Zd, Zp = prods(ld, True) / math.sqrt(m) * causal, prods(lp, True) / math.sqrt(m) * causal
        lg_num += float(((Zp - Zd) ** 2).sum())
        lg_den += float((Zd ** 2).sum())
        with torch.no_grad():
            kw = {"position_embeddings": (cos[None], sin[None])}
            y_same = lp(ins[i], attention_mask=None, **kw)
            y_same = y_same[0] if isinstance(y_same, tuple) else y_same
        blk_num += float(((y_same.double() - outs[i].double()) ** 2).sum())
        blk_den += float((outs[i].double() ** 2).sum())
        roll_num += float(((pouts[i].double() - outs[i].double()) ** 2).sum())
    return {"per_block": per_block, "e_qk": sum(per_block) / len(per_block), "e_logits": 100 * lg_num / lg_den,
            "e_block": 100 * blk_num / blk_den, "e_rollout": 100 * roll_num / blk_den}


# --- E3 -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_dense_model_has_zero_error(family):
    dense = tiny_model(family)
    ids = random_ids(3, 12)
    res = qk_errors(dense, {"copy": copy.deepcopy(dense), "no-masks": {}}, ids,
                    stages=("qk", "logits", "block", "rollout"), progress=False)
    for r in res.values():
        assert r["e_qk"] == 0.0 and r["per_block"] == [0.0, 0.0]
        assert r["e_logits"] == r["e_block"] == r["e_rollout"] == 0.0
        assert r["removal"]["qk_removed"] == 0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_equals_bruteforce_tt_computation(family):
    """GQA (4 query heads on 2 key heads), Qwen2 biases retained; chunked evaluation (chunk 2 of 3)."""
    dense = tiny_model(family)
    ids = random_ids(3, 12, seed=1)
    masks = random_masks(dense, 0.4)
    pruned = apply_masks(dense, masks)
    ref = brute_force(dense, pruned, ids)
    res = qk_errors(dense, {"model": pruned, "masks": masks}, ids, stages=("qk", "logits", "block", "rollout"),
                    chunk_size=2, progress=False)
    for r in res.values():
        for a, b in zip(r["per_block"], ref["per_block"]):
            assert a == pytest.approx(b, rel=1e-4)
        assert r["e_qk"] == pytest.approx(ref["e_qk"], rel=1e-4)
        assert r["e_qk"] == pytest.approx(sum(r["per_block"]) / 2, rel=1e-12)  # equal-weight block mean
        for st in ("logits", "block", "rollout"):
            assert r[f"e_{st}"] == pytest.approx(ref[f"e_{st}"], rel=1e-4), st
    assert res["model"]["per_block"] == pytest.approx(res["masks"]["per_block"], rel=1e-12)
    # block mean of ratios, not the pooled ratio
    r = res["masks"]
    pooled = 100 * sum(r["qk_num"]) / sum(r["qk_den"])
    assert abs(pooled - r["e_qk"]) > 1e-6 * r["e_qk"]


def test_rollout_equals_same_input_when_only_the_last_block_is_pruned():
    dense = tiny_model("llama")
    masks = {k: v for k, v in random_masks(dense).items() if k.startswith("model.layers.1.")}
    res = qk_errors(dense, {"m": masks}, random_ids(2, 10), stages=("qk", "block", "rollout"), progress=False)["m"]
    assert res["per_block"][0] == 0.0 and res["per_block"][1] > 0
    assert res["e_rollout"] == pytest.approx(res["e_block"], rel=1e-6) and res["e_block"] > 0


def test_zero_input_feature_deletions_cost_nothing():
    """I13: deleting only weights whose input feature is identically zero leaves every product unchanged."""
    dense = tiny_model("qwen2")
    j = 5
    with torch.no_grad():
        for layer in dense.model.layers:
            layer.input_layernorm.weight[j] = 0.0  # X_j = 0 at every q/k input
    masks = {}
    for i in range(2):
        for n in ("q_proj", "k_proj"):
            w = dense.get_submodule(f"model.layers.{i}.self_attn.{n}").weight
            m = torch.zeros(w.shape, dtype=torch.bool)
            m[:, j] = True
            masks[f"model.layers.{i}.self_attn.{n}"] = m
    other = {k: v.roll(1, dims=1) for k, v in masks.items()}  # column j+1 instead: a real deletion
    res = qk_errors(dense, {"zero": masks, "other": other}, random_ids(2, 10), stages=("qk", "logits"),
                    progress=False)
    assert res["zero"]["e_qk"] == 0.0 and res["zero"]["e_logits"] == 0.0
    assert res["zero"]["removal"]["mean_rho_q"] == pytest.approx(1 / 32)
    assert res["other"]["e_qk"] > 0


def test_qk_wanda_beats_random_masks_and_removal_matches_masks():
    dense = tiny_model("llama")
    model = tiny_model("llama")
    pr = prune_qk_wanda(model, get_adapter(model), random_ids(8, 16, seed=2), QKWandaConfig(0.5), progress=False)
    rnd = {k: torch.rand(v.shape, generator=torch.Generator().manual_seed(1)) < 0.5 for k, v in pr.masks.items()}
    res = qk_errors(dense, {"qkw": model, "qkw-masks": pr.masks, "random": rnd}, random_ids(4, 16, seed=9),
                    progress=False)
    assert res["qkw"]["e_qk"] < res["random"]["e_qk"]
    assert res["qkw"]["removal"]["per_block"] == res["qkw-masks"]["removal"]["per_block"]
    assert res["qkw-masks"]["removal"]["per_block"] == pr.details["allocation"]["per_block"]


def test_errors():
    dense = tiny_model("llama")
    ids = random_ids(1, 8)
    with pytest.raises(SecateurError, match="matches no projection"):
        qk_errors(dense, {"x": {"model.layers.9.self_attn.q_proj": torch.zeros(32, 32, dtype=torch.bool)}}, ids)
    with pytest.raises(SecateurError, match="shape"):
        qk_errors(dense, {"x": {"model.layers.0.self_attn.q_proj": torch.zeros(3, 3, dtype=torch.bool)}}, ids,
                  progress=False)
    with pytest.raises(SecateurError, match="architecture"):
        qk_errors(dense, {"x": tiny_model("llama", layers=3)}, ids)
    with pytest.raises(SecateurError, match="stages"):
        qk_errors(dense, {"x": {}}, ids, stages=("logits",))
    with pytest.raises(SecateurError, match="exactly one"):
        qk_error(dense, ids=ids)


@torch.no_grad()
def reference_per_block(dense, masks, ids):
    """Eq. 49 per block from the q/k inputs of a plain forward (hooks), the masked model's own q/k modules
    (GPT-2's fused ``c_attn`` split in thirds, Qwen3's q/k norms applied) and float64 products."""
    pruned = apply_masks(dense, masks)
    g = get_adapter(dense).geometry
    hq, hk, m = g.n_heads, g.n_kv_heads, g.head_dim

    def parts(layer):
        a = getattr(layer, "self_attn", getattr(layer, "attn", None))
        fused = getattr(a, "c_attn", getattr(a, "qkv_proj", None))  # GPT-2's thirds, Phi-3's [q; k; v] (GQA)
        return a, (fused,) if fused is not None else (a.q_proj, a.k_proj)

    def qk(layer, x):
        a, mods = parts(layer)
        y = mods[0](x) if len(mods) == 1 else None
        q, k = (y[..., :hq * m], y[..., hq * m:(hq + hk) * m]) if len(mods) == 1 else (mods[0](x), mods[1](x))
        q, k = q.reshape(*x.shape[:2], hq, m), k.reshape(*x.shape[:2], hk, m)
        if hasattr(a, "q_norm"):
            q, k = a.q_norm(q), a.k_norm(k)
        return q.double(), k.repeat_interleave(hq // hk, dim=2).double()

    layers = get_adapter(dense).layers
    xs = []
    hooks = [parts(layer)[1][0].register_forward_pre_hook(lambda mod, args: xs.append(args[0])) for layer in layers]
    dense(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    out = []
    for x, ld, lp in zip(xs, layers, get_adapter(pruned).layers):
        B = torch.einsum("bthm,buhm->bhtu", *qk(ld, x))
        Bp = torch.einsum("bthm,buhm->bhtu", *qk(lp, x))
        out.append(float(100 * (Bp - B).square().sum() / B.square().sum()))
    return out


@pytest.mark.parametrize("family", ["opt", "gpt2", "qwen3", "gemma3_text", "phi3"])
def test_other_families_equal_an_independent_computation(family):
    """OPT (biases, no RoPE), GPT-2 (fused Conv1D ``c_attn``, masks stored [out, in]) and Qwen3 (q/k norms):
    Eq. 49 per block equals the hook-based reference, zero without pruning; the other stages run."""
    dense = tiny_model(family)
    ids = random_ids(2, 8)
    masks = random_masks(dense, roles=("q_proj", "k_proj", "c_attn", "qkv_proj"))
    res = qk_errors(dense, {"m": masks, "none": {}}, ids, stages=("qk", "logits", "block"), progress=False)
    ref = reference_per_block(dense, masks, ids)
    assert res["m"]["per_block"] == pytest.approx(ref, rel=1e-4) and min(ref) > 1.0
    assert res["m"]["e_qk"] == pytest.approx(sum(ref) / len(ref), rel=1e-4)
    assert res["none"]["per_block"] == [0.0] * len(ref) and res["none"]["e_block"] == 0.0
    assert res["m"]["e_logits"] > 0 and res["m"]["e_block"] > 0


# --- held-out data --------------------------------------------------------------------------------------

@requires_data
def test_heldout_sequences_come_from_heldout_documents():
    from secateur.data.sources import C4_CALIB_DOCS, C4_EVAL_DOCS, c4_documents

    tok = tiny_tokenizer()
    ids, man = heldout_ids(tok, n=4, seqlen=64, data_dir=DATA_DIR)
    again, man2 = heldout_ids(tok, n=4, seqlen=64, data_dir=DATA_DIR)
    assert torch.equal(ids, again) and man["sha256"] == man2["sha256"] and man["seed"] == QK_ERROR_SEED
    assert ids.shape == (4, 64) and "[1500, 2000)" in man["source"]
    def enc(doc: str) -> str:  # token ids as a string, so "is a contiguous window of" is a substring test
        return "".join(map(chr, tok(doc, add_special_tokens=False)["input_ids"]))

    held = [enc(d) for d in c4_documents(DATA_DIR, *C4_EVAL_DOCS)]
    calib = [enc(d) for d in c4_documents(DATA_DIR, *C4_CALIB_DOCS)]
    for row in ids:
        text = "".join(map(chr, row.tolist()))
        assert any(text in d for d in held)
        assert not any(text in d for d in calib)
    other, _ = heldout_ids(tok, n=4, seqlen=64, seed=1, data_dir=DATA_DIR)
    assert not torch.equal(other, ids)


# --- plots ------------------------------------------------------------------------------------------------

def test_plots_write_png(tmp_path):
    from secateur.plots import plot_block_errors, plot_qk_removal

    al = {"per_block": [{"block": i, "rho_q": 0.5 + 0.01 * i, "rho_k": 0.5 - 0.02 * i} for i in range(4)],
          "qk_removed": 50, "qk_total": 100}
    data = plot_qk_removal({"QK-Wanda": al, "other": al["per_block"]}, tmp_path / "a.png", title="t")
    assert data[:4] == b"\x89PNG" and (tmp_path / "a.png").read_bytes() == data
    assert plot_block_errors({"x": [0.1, 0.2], "y": [0.3, 0.0]}, tmp_path / "b.png")[:4] == b"\x89PNG"
