"""QK-Wanda end to end: the engine handler, budgets, scopes, segmentation, progressive re-scoring, the CLI
(spec /work/shared/spec/qk-wanda.md §4-5, §11 I2/I7/I9/I14; paper seed 003). Score formulas themselves are
tested in test_qk_wanda.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from secateur.budgets.masks import budget_counts, deletion_count, lowest_k_masks, prune_masks, row_mask
from secateur.cli import main
from secateur.errors import SecateurError
from secateur.masks_file import load_masks
from secateur.methods.qk_wanda import (
    QKWandaConfig,
    QKWandaHandler,
    prune_qk_wanda,
)
from secateur.methods.unstructured import UnstructuredConfig, prune_unstructured
from secateur.models.adapters import get_adapter
from secateur.safe_write import MASKS_NAME
from secateur.scoring import VARIANTS, QKStats, model_rope_tables, qk_wanda_scores
from secateur.scoring.wanda import wanda_scores
from secateur.testing import random_ids, save_tiny, tiny_model

QK = ("self_attn.q_proj", "self_attn.k_proj")

pytestmark = pytest.mark.usefixtures("one_thread")


def run(family, ids, seed=0, mode="sequential", chunk_size=8, double=False, **cfg):
    model = tiny_model(family, seed=seed)
    if double:
        model = model.double()
    res = prune_qk_wanda(model, get_adapter(model), ids, QKWandaConfig(**cfg), mode=mode, chunk_size=chunk_size,
                         progress=False)
    return model, res


def qk_masks(res, layers=2):
    return [res.masks[f"model.layers.{i}.{n}"] for i in range(layers) for n in QK]


# --- I2: one sequence + row budgets = Wanda ------------------------------------------------------------

@pytest.mark.parametrize("rounding", ["ceil", "floor"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_one_sequence_row_budget_equals_wanda_through_the_pipeline(family, rounding):
    ids = random_ids(1, 24, seed=5)
    for rho in (0.3, 0.5, 0.8):
        m_qk, res = run(family, ids, sparsity=rho, budget="row", rounding=rounding)
        wanda = tiny_model(family)
        cfg = UnstructuredConfig(method="wanda", sparsity=rho, budget="row", rounding=rounding,
                                 targets=frozenset({"q", "k"}))
        ref = prune_unstructured(wanda, get_adapter(wanda), ids, cfg, progress=False)
        assert set(ref.masks) == set(res.masks)
        for key, mask in ref.masks.items():
            assert torch.equal(res.masks[key], mask), key
        for a, b in zip(m_qk.parameters(), wanda.parameters()):
            assert torch.equal(a, b)


def test_two_sequences_row_budget_differs_from_wanda():
    """I8 through the pipeline: with several sequences the QK factor re-weights columns within a row, so
    the row-budget masks are no longer Wanda's (the test above is not vacuous)."""
    ids = random_ids(6, 24, seed=5)
    _, res = run("llama", ids, sparsity=0.5, budget="row")
    wanda = tiny_model("llama")
    cfg = UnstructuredConfig(method="wanda", sparsity=0.5, targets=frozenset({"q", "k"}))
    ref = prune_unstructured(wanda, get_adapter(wanda), ids, cfg, progress=False)
    assert any(not torch.equal(res.masks[k], ref.masks[k]) for k in ref.masks)


# --- block-0 wiring: the pipeline's masks equal masks built by hand from QKStats ------------------------

@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_block0_masks_equal_direct_scores(family, variant):
    ids = random_ids(3, 16, seed=2)
    for budget in ("shared", "separate", "row"):
        _, res = run(family, ids, sparsity=0.5, budget=budget, variant=variant, segment_len=8)
        model = tiny_model(family)
        ad = get_adapter(model)
        seg = ids.reshape(6, 8)
        h, _ = ad.capture_inputs(seg)
        with torch.no_grad():
            x = ad.attn_norm(ad.layers[0], h)
        r = ad.role_refs(ad.layers[0])
        st = QKStats(r["q"].weight, r["k"].weight, r["q"].bias, r["k"].bias, ad.geometry, variant,
                     rope=model_rope_tables(model, 8))
        st.update(x)
        Sq, Sk = qk_wanda_scores(r["q"].weight, r["k"].weight, r["q"].bias, r["k"].bias, st, ad.geometry, variant)
        mq, mk = prune_masks([Sq, Sk], 0.5, budget=budget)
        assert torch.equal(res.masks["model.layers.0.self_attn.q_proj"], mq)
        assert torch.equal(res.masks["model.layers.0.self_attn.k_proj"], mk)


def test_projected_statistics_equal_qkstats():
    """The handler's statistics (base fast path: float32 energies, float64 sums; other variants: QKStats's
    chunk code with the given projections) equal QKStats recomputing Q/K itself in float64."""
    import torch.nn.functional as F

    from secateur.calib.qk import ProjectedQKStats

    model = tiny_model("qwen2")
    ad = get_adapter(model)
    r = ad.role_refs(ad.layers[1])
    Wq, Wk, bq, bk = (t.detach() for t in (r["q"].weight, r["k"].weight, r["q"].bias, r["k"].bias))
    x = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(0)) + 0.3
    rope = model_rope_tables(model, 8)
    for variant in ("base", "MRC"):
        ref = QKStats(Wq, Wk, bq, bk, ad.geometry, variant, rope=rope)
        ref.update(x)
        mine = ProjectedQKStats(Wq, Wk, bq, bk, ad.geometry, variant, rope=rope, proj=(Wq, bq, Wk, bk))
        mine.update(x[:1])
        mine.update(x[1:])
        hooked = ProjectedQKStats(Wq, Wk, bq, bk, ad.geometry, variant, rope=rope)
        hooked.update_projected(x, F.linear(x, Wq, bq), F.linear(x, Wk, bk))
        for st in (mine, hooked):
            assert st.n_seqs == 3 and st.n_tokens == 24
            for a, b in zip(st.factors(), ref.factors()):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=0)


# --- I7 budgets, I14 bit-identical retained weights --------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen2", "opt"])
@pytest.mark.parametrize("rho", [0.3, 0.55, 0.8])
def test_budget_counts_and_retained_weights(family, rho):
    ids = random_ids(4, 16, seed=1)
    dense = tiny_model(family)
    prefix = get_adapter(dense).base_prefix
    for budget in ("shared", "separate", "row"):
        model, res = run(family, ids, sparsity=rho, budget=budget)
        al = res.details["allocation"]
        for i in range(2):
            mq, mk = (res.masks[f"{prefix}.{i}.{n}"] for n in QK)
            nq, nk = mq.numel(), mk.numel()
            if budget == "shared":
                assert int(mq.sum() + mk.sum()) == math.ceil(rho * (nq + nk) - 1e-9)
            elif budget == "separate":
                assert int(mq.sum()) == deletion_count(nq, rho) and int(mk.sum()) == deletion_count(nk, rho)
            else:
                k = deletion_count(mq.shape[1], rho)
                assert (mq.sum(1) == k).all() and (mk.sum(1) == k).all()
            blk = al["per_block"][i]
            assert blk["q_removed"] == int(mq.sum()) and blk["k_removed"] == int(mk.sum())
            assert blk["rho_q"] * nq + blk["rho_k"] * nk == pytest.approx(int(mq.sum() + mk.sum()))
        dense_params = dict(dense.named_parameters())
        for name, p in model.named_parameters():
            owner = name.rsplit(".", 1)[0]
            mask = res.masks.get(owner) if name.endswith("weight") else None
            d = dense_params[name]
            if mask is None:  # every non-QK parameter (biases, norms, v/o/MLP, embeddings) untouched
                assert torch.equal(p, d), name
            else:
                assert torch.equal(p[~mask], d[~mask]) and bool((p[mask] == 0).all()), name


def test_shared_budget_moves_weights_between_q_and_k():
    """The shared pool has no per-projection quota: on a GQA model (n_Q = 2 n_K) it does not split evenly."""
    _, res = run("llama", random_ids(4, 16), sparsity=0.5, budget="shared")
    al = res.details["allocation"]
    assert any(abs(b["rho_q"] - 0.5) > 0.01 for b in al["per_block"])
    assert al["qk_removed"] == sum(deletion_count(b["q_total"] + b["k_total"], 0.5) for b in al["per_block"])


# --- I9 batch invariance, engine modes, segmentation -------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_masks_independent_of_chunking_and_engine_mode(family):
    """Sequential (Q/K recomputed from X) and dense-block (Q/K taken from the block's own forward by hooks)
    give the same Q/K masks; so do chunk sizes 1 and 32 (I9). Float64 model: no rounding near-ties."""
    ids = random_ids(4, 16, seed=3)
    ref = None
    for mode, chunk in (("sequential", 1), ("sequential", 32), ("dense-block", 1), ("dense-block", 32)):
        _, res = run(family, ids, mode=mode, chunk_size=chunk, double=True, sparsity=0.5, variant="MR",
                     segment_len=8)
        assert res.details["projections_reused"] == (mode == "dense-block")
        if ref is None:
            ref = qk_masks(res)
        else:
            assert all(torch.equal(a, b) for a, b in zip(qk_masks(res), ref)), (mode, chunk)


def test_segment_len_equals_presegmented_ids_and_restarts_positions():
    ids = random_ids(2, 32, seed=4)
    _, a = run("llama", ids, sparsity=0.5, variant="R", segment_len=8)
    _, b = run("llama", ids.reshape(8, 8), sparsity=0.5, variant="R")
    _, whole = run("llama", ids, sparsity=0.5, variant="R")
    assert a.details["calibration_sequences"] == [8, 8]
    assert all(torch.equal(x, y) for x, y in zip(qk_masks(a), qk_masks(b)))
    assert not all(torch.equal(x, y) for x, y in zip(qk_masks(a), qk_masks(whole)))
    with pytest.raises(SecateurError, match="divide"):
        run("llama", ids, segment_len=7)


# --- scope=all: hybrid ----------------------------------------------------------------------------------

def test_hybrid_scope_prunes_v_o_mlp_rowwise_like_wanda():
    """Block 0 in dense-block mode: Q/K masks are the QK-only ones, v/o/gate/up/down masks are exactly
    Wanda's row-wise masks (same dense pass, [A4]); every later row loses ceil(rho d_in)."""
    ids, rho = random_ids(3, 16, seed=6), 0.5
    model, hyb = run("qwen2", ids, mode="dense-block", sparsity=rho, scope="all")
    _, qk_only = run("qwen2", ids, mode="dense-block", sparsity=rho, scope="qk")
    wanda = tiny_model("qwen2")
    ref = prune_unstructured(wanda, get_adapter(wanda), ids, UnstructuredConfig(method="wanda", sparsity=rho),
                             mode="dense-block", progress=False)
    assert set(hyb.masks) == set(ref.masks)
    for n in QK:
        assert torch.equal(hyb.masks[f"model.layers.0.{n}"], qk_only.masks[f"model.layers.0.{n}"])
    for n in ("self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        assert torch.equal(hyb.masks[f"model.layers.0.{n}"], ref.masks[f"model.layers.0.{n}"]), n
        for i in range(2):
            m = hyb.masks[f"model.layers.{i}.{n}"]
            assert (m.sum(1) == deletion_count(m.shape[1], rho)).all()
    dense = tiny_model("qwen2")
    for (name, p), d in zip(model.named_parameters(), dense.parameters()):
        if name.endswith("bias") or "norm" in name or "embed" in name:
            assert torch.equal(p, d), name


def test_hybrid_wanda_part_uses_wanda_scores_in_sequential_mode():
    """Sequential mode: v shares X with q/k, so block-0 v masks equal Wanda row masks of the dense X."""
    ids = random_ids(2, 16, seed=7)
    _, hyb = run("llama", ids, sparsity=0.4, scope="all")
    model = tiny_model("llama")
    ad = get_adapter(model)
    h, _ = ad.capture_inputs(ids)
    from secateur.calib.stats import SumSq

    acc = SumSq(32)
    with torch.no_grad():
        acc.update(ad.attn_norm(ad.layers[0], h))
    v = ad.role_refs(ad.layers[0])["v"].weight
    assert torch.equal(hyb.masks["model.layers.0.self_attn.v_proj"], row_mask(wanda_scores(v, acc), 0.4))


# --- progressive re-scoring (App. K) -------------------------------------------------------------------

def test_count_driven_masks_match_prune_masks():
    """The count-driven selection (progressive re-scoring) equals budgets.prune_masks exactly, heavy ties,
    -inf entries (progressive re-scoring) and the edge counts included."""
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        S = [torch.randint(0, 4, (6, 10), generator=g).double(), torch.randint(0, 4, (3, 10), generator=g).double()]
        if trial % 3 == 0:
            S[0][torch.rand(6, 10, generator=g) < 0.2] = -torch.inf
        for rho in (0.0, 0.05, 0.45, 0.5, 0.8, 0.99):
            for budget in ("row", "separate", "shared"):
                k = budget_counts([s.shape for s in S], rho, budget, "ceil")
                got = lowest_k_masks(S, budget, k)
                ref = prune_masks(S, rho, budget=budget)
                assert all(torch.equal(a, b) for a, b in zip(got, ref)), (trial, rho, budget)
    with pytest.raises(SecateurError, match="NaN"):
        lowest_k_masks([torch.tensor([[0.0, float("nan")]])], "shared", 1)


@pytest.mark.parametrize("budget", ["shared", "separate", "row"])
def test_progressive_rescoring_counts_and_nesting(budget):
    ids = random_ids(3, 16, seed=8)
    _, one = run("llama", ids, sparsity=0.5, budget=budget, variant="M")
    _, j1 = run("llama", ids, sparsity=0.5, budget=budget, variant="M", progressive=1)
    _, j4 = run("llama", ids, sparsity=0.5, budget=budget, variant="M", progressive=4)
    assert all(torch.equal(a, b) for a, b in zip(qk_masks(one), qk_masks(j1)))
    for a, b in zip(qk_masks(one), qk_masks(j4)):
        if budget == "row":
            assert torch.equal(a.sum(1), b.sum(1))
        else:
            assert a.sum() == b.sum() or budget == "shared"
    for blk_one, blk_j4 in zip(one.details["allocation"]["per_block"], j4.details["allocation"]["per_block"]):
        assert blk_one["q_removed"] + blk_one["k_removed"] == blk_j4["q_removed"] + blk_j4["k_removed"]
    assert not all(torch.equal(a, b) for a, b in zip(qk_masks(one), qk_masks(j4)))  # re-scoring matters


def test_progressive_steps_grow_nested_masks():
    """Each step keeps every earlier deletion and reaches floor(r M / J) (Eq. 53): check via a handler spy."""
    seen = []
    orig = lowest_k_masks

    def spy(scores, budget, k):
        out = orig(scores, budget, k)
        seen.append((k, [m.clone() for m in out]))
        return out

    import secateur.methods.qk_wanda as mod

    mod.lowest_k_masks = spy
    try:
        run("llama", random_ids(2, 16), sparsity=0.6, budget="shared", progressive=3)
    finally:
        mod.lowest_k_masks = orig
    per_block = [seen[i:i + 3] for i in range(0, len(seen), 3)]
    for steps in per_block:
        M = steps[-1][0]
        assert [k for k, _ in steps] == [M * r // 3 for r in (1, 2, 3)]
        for (_, prev), (_, cur) in zip(steps, steps[1:]):
            assert all(bool((p <= c).all()) for p, c in zip(prev, cur))
        assert sum(int(m.sum()) for m in steps[-1][1]) == M


# --- refusals -----------------------------------------------------------------------------------------

def test_config_and_model_refusals():
    with pytest.raises(SecateurError, match="budget"):
        QKWandaConfig(budget="global").validate()
    with pytest.raises(SecateurError, match="scope"):
        QKWandaConfig(scope="mlp").validate()
    with pytest.raises(SecateurError, match="progressive"):
        QKWandaConfig(progressive=0).validate()
    with pytest.raises(SecateurError, match="variant"):
        QKWandaConfig(variant="X").validate()
    assert QKWandaConfig(budget="matrix").validate() is None
    for family in ("qwen3", "gemma3_text"):
        with pytest.raises(SecateurError, match="q/k norms"):
            run(family, random_ids(1, 8))
    with pytest.raises(SecateurError, match="rotary"):
        run("opt", random_ids(1, 8), variant="R")
    h = QKWandaHandler(QKWandaConfig(progressive=2), reuse_projections=True)
    assert not h.reuse  # progressive re-scoring re-reads X, so it always recomputes


# --- CLI end to end ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def calib_txt(tmp_path_factory):
    p = tmp_path_factory.mktemp("c") / "calib.txt"
    p.write_text("The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 40)
    return str(p)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_cli_prune_and_qk_error_end_to_end(family, tmp_path, calib_txt, capsys):
    dense_dir = save_tiny(family, tmp_path / "dense")
    out = tmp_path / "pruned"
    assert main(["prune", "--model", dense_dir, "--method", "qk-wanda", "--budget", "shared", "--variant", "mr",
                 "--scope", "qk", "--sparsity", "0.5", "--segment-len", "8", "--calib", calib_txt, "--nsamples", "2",
                 "--seqlen", "32", "--quiet", "--out", str(out)]) == 0
    rep = json.loads((out / "secateur-report.json").read_text())
    d = rep["details"]
    assert rep["method"] == "qk-wanda" and d["method"] == "QK-Wanda-MR" and d["config"]["budget"] == "shared"
    assert d["calibration_sequences"] == [8, 8] and rep["options"]["segment_len"] == 8
    assert rep["realized_sparsity"]["targeted"] == pytest.approx(0.5, abs=1e-3)
    assert (out / "qk-removal.png").read_bytes()[:4] == b"\x89PNG"
    masks = load_masks(out / MASKS_NAME)
    assert sorted(masks) == sorted(f"model.layers.{i}.{n}" for i in range(2) for n in QK)
    pruned = AutoModelForCausalLM.from_pretrained(out)
    dense = AutoModelForCausalLM.from_pretrained(dense_dir)
    for key, m in masks.items():
        w = pruned.get_submodule(key).weight
        wd = dense.get_submodule(key).weight
        assert bool((w[m] == 0).all()) and torch.equal(w[~m], wd[~m])
    if family == "qwen2":
        assert torch.equal(pruned.model.layers[0].self_attn.q_proj.bias, dense.model.layers[0].self_attn.q_proj.bias)
    capsys.readouterr()
    js = tmp_path / "qk.json"
    assert main(["eval", "qk-error", "--model", str(out), "--dense", dense_dir, "--text", calib_txt, "--n", "2",
                 "--seqlen", "24", "--quiet", "--json", str(js), "--plot", str(tmp_path / "fig3.png")]) == 0
    res = json.loads(js.read_text())
    assert res["e_qk"] > 0 and len(res["per_block"]) == 2 and {"e_logits", "e_block", "e_rollout"} <= res.keys()
    assert res["removal"]["qk_removed"] == sum(int(m.sum()) for m in masks.values())
    assert "relative QK error" in capsys.readouterr().out
    assert (tmp_path / "fig3.png").read_bytes()[:4] == b"\x89PNG"
    # the same numbers from the saved masks applied to the dense model
    js2 = tmp_path / "qk2.json"
    assert main(["eval", "qk-error", "--masks", str(out), "--dense", dense_dir, "--text", calib_txt, "--n", "2",
                 "--seqlen", "24", "--quiet", "--json", str(js2)]) == 0
    res2 = json.loads(js2.read_text())
    assert res2["per_block"] == res["per_block"] and res2["e_rollout"] == res["e_rollout"]


def test_cli_hybrid_scope_and_errors(tmp_path, calib_txt, capsys):
    dense_dir = save_tiny("llama", tmp_path / "dense")
    out = tmp_path / "hyb"
    assert main(["prune", "--model", dense_dir, "--method", "qk-wanda", "--scope", "all", "--budget", "separate",
                 "--sparsity", "0.3", "--calib", calib_txt, "--nsamples", "2", "--seqlen", "16", "--quiet",
                 "--out", str(out)]) == 0
    masks = load_masks(out / MASKS_NAME)
    assert len(masks) == 14
    assert masks["model.layers.1.mlp.down_proj"].sum(1).eq(deletion_count(64, 0.3)).all()
    capsys.readouterr()
    cases = [
        (["--budget", "global"], "budget"),
        (["--targets", "q,k"], "--scope"),
        (["--pattern", "2:4"], "--scope"),
        (["--segment-len", "5"], "divide"),
    ]
    for extra, msg in cases:
        o = tmp_path / "bad"
        assert main(["prune", "--model", dense_dir, "--method", "qk-wanda", "--calib", calib_txt, "--nsamples", "2",
                     "--seqlen", "16", "--quiet", "--out", str(o), *extra]) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("secateur:")]
        assert len(err) == 1 and msg in err[0], (extra, err)
        assert not o.exists()
    with pytest.raises(SystemExit) as e:
        main(["prune", "--model", dense_dir, "--method", "qk-wanda", "--variant", "MX"])
    assert e.value.code == 2
    capsys.readouterr()
    assert main(["eval", "qk-error", "--dense", dense_dir, "--text", calib_txt]) == 2
    assert "exactly one of --model" in capsys.readouterr().err


def test_cli_refuses_qwen3_clearly(tmp_path, calib_txt, capsys):
    path = save_tiny("qwen3", tmp_path / "q3")
    assert main(["prune", "--model", path, "--method", "qk-wanda", "--calib", calib_txt, "--nsamples", "2",
                 "--seqlen", "16", "--quiet", "--out", str(tmp_path / "o")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("secateur:")]
    assert len(err) == 1 and "q/k norms" in err[0] and "qwen3" in err[0]
    assert not (tmp_path / "o").exists()


def test_phi3_fused_qkv_prunes_its_q_and_k_slices():
    """Phi-3's fused qkv_proj ([q; k; v] rows, GQA sizes): QK-Wanda prunes the q and k row slices to the shared
    budget, leaves v alone, and stores one mask for the fused module."""
    model, res = run("phi3", random_ids(2, 16), sparsity=0.5)
    g = get_adapter(model).geometry
    qw, kw = g.n_heads * g.head_dim, g.n_kv_heads * g.head_dim
    assert sorted(res.masks) == [f"model.layers.{i}.self_attn.qkv_proj" for i in range(2)]
    for layer in model.model.layers:
        w = layer.self_attn.qkv_proj.weight
        zq, zk = int((w[:qw] == 0).sum()), int((w[qw:qw + kw] == 0).sum())
        assert zq + zk == (qw + kw) * w.shape[1] // 2 and zq and zk
        assert not (w[qw + kw:] == 0).any()
