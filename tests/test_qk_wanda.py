"""QK-Wanda scores: every variant equals a brute-force single-deletion cost, plus the spec's invariants
(/work/shared/spec/qk-wanda.md §11, paper seed 003)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from secateur.budgets.masks import row_mask, shared_mask
from secateur.errors import SecateurError
from secateur.models.adapters import Geometry, get_adapter
from secateur.scoring import (
    VARIANTS,
    QKStats,
    QKVariant,
    model_rope_tables,
    qk_wanda_scores,
    rope_tables,
    segment_sequences,
)
from secateur.testing import random_ids, tiny_model

D = 5  # input width of the synthetic blocks

pytestmark = pytest.mark.usefixtures("one_thread")


def geom(hq: int, hk: int, m: int, rope: bool = True, qk_norm: bool = False) -> Geometry:
    return Geometry(hidden=D, n_heads=hq, n_kv_heads=hk, head_dim=m, intermediate=8, rope=rope, qkv_bias=True,
                    o_bias=False, mlp_bias=False, qk_norm=qk_norm, gated_mlp=True)


def block(hq: int, hk: int, m: int, bias: bool, seed: int = 0, d: int = D):
    g = torch.Generator().manual_seed(seed)
    Wq = torch.randn(hq * m, d, generator=g, dtype=torch.float64)
    Wk = torch.randn(hk * m, d, generator=g, dtype=torch.float64)
    bq = torch.randn(hq * m, generator=g, dtype=torch.float64) if bias else None
    bk = torch.randn(hk * m, generator=g, dtype=torch.float64) if bias else None
    return Wq, Wk, bq, bk


def sequences(seed: int = 1, d: int = D) -> list[torch.Tensor]:
    """Three independent sequences of unequal length, with a nonzero mean (so centering matters)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t, d, generator=g, dtype=torch.float64) + 0.7 for t in (5, 5, 4)]


def hf_tables(m: int, t: int = 8):
    # small theta: large angles on short sequences; a non-unit scale checks nothing assumes cos^2+sin^2=1
    return rope_tables(m, t, theta=7.0, attention_scaling=1.3)


def general_tables(m: int, t: int = 8, seed: int = 3):
    """Arbitrary cos/sin with different halves: R_{t,a} = [[c_a, -s_a], [s_{a+m/2}, c_{a+m/2}]]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, m, generator=g, dtype=torch.float64), torch.randn(t, m, generator=g, dtype=torch.float64)


def collect(Wq, Wk, bq, bk, g, variants, seqs, rope=None, **kw) -> QKStats:
    st = QKStats(Wq, Wk, bq, bk, g, variants=variants, rope=rope, **kw)
    st.update(torch.stack(seqs[:2]))  # two sequences of length 5 in one chunk
    for s in seqs[2:]:
        st.update(s[None])  # a shorter one alone
    return st


# --- brute force: materialize every T x T product ---------------------------------------------------

def products(Wq, Wk, bq, bk, X, hq, hk, m, v: QKVariant, rope):
    """``Z[h, t, u]`` (query t, key u) for every query head, one sequence ``X [T, d]``."""
    T = X.shape[0]
    Q = (X @ Wq.T + (0 if bq is None else bq)).reshape(T, hq, m)
    K = (X @ Wk.T + (0 if bk is None else bk)).reshape(T, hk, m)
    if v.rope:
        Q, K = apply_rotary_pos_emb(Q, K, rope[0][:T], rope[1][:T], unsqueeze_dim=1)  # HF's own rotation
    K = K.repeat_interleave(hq // hk, dim=1)  # HF repeat_kv: query head h reads key head h // r
    return torch.einsum("thm,uhm->htu", Q, K)


def loss(Z_hat, Z, v: QKVariant) -> torch.Tensor:
    E = Z_hat - Z
    T = E.shape[-1]
    allowed = torch.ones(T, T, dtype=torch.float64)
    if v.causal:
        allowed = allowed.tril()
    if v.centered:  # subtract each query row's mean error over its eligible keys (Eqs. 60/65)
        E = E - ((E * allowed).sum(-1, keepdim=True) / allowed.sum(-1, keepdim=True))
    return ((E * allowed) ** 2).sum()


def brute_force(Wq, Wk, bq, bk, seqs, hq, hk, m, variant, rope=None):
    """(C_Q, C_K): the loss (mean over sequences) after zeroing each single weight."""
    v = QKVariant.parse(variant)
    ref = [products(Wq, Wk, bq, bk, X, hq, hk, m, v, rope) for X in seqs]

    def cost(Wq_, Wk_):
        return sum(loss(products(Wq_, Wk_, bq, bk, X, hq, hk, m, v, rope), Z, v) for X, Z in zip(seqs, ref)) / len(seqs)

    Cq, Ck = torch.zeros_like(Wq), torch.zeros_like(Wk)
    for i in range(Wq.shape[0]):
        for j in range(Wq.shape[1]):
            W = Wq.clone()
            W[i, j] = 0
            Cq[i, j] = cost(W, Wk)
    for i in range(Wk.shape[0]):
        for j in range(Wk.shape[1]):
            W = Wk.clone()
            W[i, j] = 0
            Ck[i, j] = cost(Wq, W)
    return Cq, Ck


def close(a, b, rtol=1e-9):
    torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.abs().max()))


# --- I1: score = explicit loss -----------------------------------------------------------------------

@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("heads", [(3, 3, 4), (4, 2, 4)], ids=["mha", "gqa"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_scores_equal_bruteforce_single_deletion(variant, heads, bias):
    hq, hk, m = heads
    Wq, Wk, bq, bk = block(hq, hk, m, bias)
    seqs = sequences()
    rope = hf_tables(m)
    st = collect(Wq, Wk, bq, bk, geom(hq, hk, m), variant, seqs, rope=rope)
    Sq, Sk = qk_wanda_scores(Wq, Wk, bq, bk, st, geom(hq, hk, m), variant)
    Cq, Ck = brute_force(Wq, Wk, bq, bk, seqs, hq, hk, m, variant, rope)
    close(Sq, Cq)
    close(Sk, Ck)


@pytest.mark.parametrize("variant", ["R", "MR", "RC", "MRC"])
def test_rope_scores_with_general_rotary_maps(variant):
    """Unequal cos/sin halves and non-rotation 2x2 maps: no hidden assumption about the tables."""
    hq, hk, m = 4, 2, 6
    Wq, Wk, bq, bk = block(hq, hk, m, True, seed=5)
    seqs = sequences(seed=6)
    rope = general_tables(m)
    st = collect(Wq, Wk, bq, bk, geom(hq, hk, m), variant, seqs, rope=rope, chunk_elems=7)  # many inner chunks
    Cq, Ck = brute_force(Wq, Wk, bq, bk, seqs, hq, hk, m, variant, rope)
    Sq, Sk = st.scores(variant)
    close(Sq, Cq)
    close(Sk, Ck)


@pytest.mark.parametrize("variant", ["C", "MC", "RC", "MRC"])
def test_centered_scores_survive_a_large_input_offset(variant):
    """A shared offset 300x the spread in every input feature (LLM hidden states carry such channels) and a
    slowly turning rotary pair, so the centered moments are tiny differences of large sums (App. O): every
    score keeps 7 significant digits in float64 (float32 statistics lose about 5 of them here)."""
    hq, hk, m = 4, 2, 4
    Wq, Wk, bq, bk = block(hq, hk, m, True, seed=7)
    seqs = [x + 300.0 for x in sequences(seed=8)]
    rope = rope_tables(m, 8, theta=1e6)  # pair 1 turns by 1e-3 rad per position
    st = collect(Wq, Wk, bq, bk, geom(hq, hk, m), variant, seqs, rope=rope)
    Cq, Ck = brute_force(Wq, Wk, bq, bk, seqs, hq, hk, m, variant, rope)
    Sq, Sk = st.scores(variant)
    torch.testing.assert_close(Sq, Cq, rtol=1e-7, atol=0)  # elementwise: small scores count as much as large
    torch.testing.assert_close(Sk, Ck, rtol=1e-7, atol=0)


# --- paper examples (I3, I4) and Wanda equivalence (I2) ----------------------------------------------

def one_head(Wq, Wk, X_dT, variant):
    g = geom(1, 1, 1, rope=False)
    st = QKStats(torch.tensor([Wq], dtype=torch.float64), torch.tensor([Wk], dtype=torch.float64), None, None, g,
                 variant)
    st.update(torch.tensor(X_dT, dtype=torch.float64).T[None])  # paper X is d x T
    return st.scores()


def test_two_token_causal_example_b3():
    Sq, _ = one_head([2.0, 1.0], [1.0, 0.0], [[1, 2], [3, 4]], "M")
    assert Sq[0, 0].item() == 84.0


def test_counterexample_b4_causal_breaks_wanda_equivalence():
    X = [[1, 0], [0, 1]]
    wanda = torch.tensor([[2.0, 1.0]]) ** 2 * torch.ones(1, 2)  # W^2 ||X_j||^2
    base, _ = one_head([2.0, 1.0], [1.0, 3.0], X, "base")
    causal, _ = one_head([2.0, 1.0], [1.0, 3.0], X, "M")
    assert base.tolist() == [[40.0, 10.0]] and causal.tolist() == [[4.0, 10.0]] and wanda.tolist() == [[4.0, 1.0]]
    assert row_mask(wanda, 0.5).tolist() == [[False, True]]
    assert row_mask(base, 0.5).tolist() == [[False, True]]
    assert row_mask(causal, 0.5).tolist() == [[True, False]]


@pytest.mark.parametrize("rounding", ["ceil", "floor"])
def test_single_sequence_row_masks_equal_wanda(rounding):
    hq, hk, m, d = 4, 2, 3, 11
    Wq, Wk, bq, bk = block(hq, hk, m, True, seed=2, d=d)
    x = torch.randn(1, 9, d, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    st = QKStats(Wq, Wk, bq, bk, geom(hq, hk, m), "base")
    st.update(x)
    Sq, Sk = st.scores()
    norm = x[0].norm(dim=0)
    for rho in (0.1, 0.3, 0.5, 0.8):
        assert torch.equal(row_mask(Sq, rho, rounding), row_mask(Wq.abs() * norm, rho, rounding))
        assert torch.equal(row_mask(Sk, rho, rounding), row_mask(Wk.abs() * norm, rho, rounding))


def test_multi_sequence_average_of_products_not_product_of_averages():
    """I8: sum_s e_X^(s) e_K^(s), not (sum_s e_X^(s))(sum_s e_K^(s))/N."""
    hq, hk, m = 2, 1, 2
    Wq, Wk, bq, bk = block(hq, hk, m, True, seed=8)
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(6, D, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3, D, dtype=torch.float64),
          torch.randn(6, D, generator=g, dtype=torch.float64) * torch.linspace(3, 0.1, D, dtype=torch.float64) * 4]
    st = QKStats(Wq, Wk, bq, bk, geom(hq, hk, m), "base")
    st.update(torch.stack(xs))
    Sq, _ = st.scores()
    eX = [x.pow(2).sum(0) for x in xs]
    eK = [(x @ Wk.T + bk).pow(2).sum(0) for x in xs]
    per_seq = sum(torch.outer(k, e) for k, e in zip(eK, eX)) / 2
    pooled = torch.outer(sum(eK), sum(eX)) / 4
    expect = Wq**2 * per_seq.repeat(hq, 1)
    close(Sq, expect, rtol=1e-12)
    assert not torch.allclose(Sq, Wq**2 * pooled.repeat(hq, 1), rtol=1e-3)


# --- invariances (I5, I6, I9, I10, I11) --------------------------------------------------------------

def all_scores(Wq, Wk, bq, bk, g, seqs, rope, **kw):
    st = collect(Wq, Wk, bq, bk, g, VARIANTS, seqs, rope=rope, **kw)
    return {v: st.scores(v) for v in VARIANTS}


def test_groupwise_reciprocal_rescaling_leaves_scores_unchanged():
    hq, hk, m = 4, 2, 4
    Wq, Wk, bq, bk = block(hq, hk, m, True, seed=11)
    seqs, rope, g = sequences(12), hf_tables(m), geom(hq, hk, m)
    ref = all_scores(Wq, Wk, bq, bk, g, seqs, rope)
    a, grp = -2.7, 1
    rows_q = slice(grp * 2 * m, (grp + 1) * 2 * m)  # query heads 2, 3 read key head 1
    rows_k = slice(grp * m, (grp + 1) * m)
    Wq2, bq2, Wk2, bk2 = Wq.clone(), bq.clone(), Wk.clone(), bk.clone()
    Wq2[rows_q] *= a
    bq2[rows_q] *= a
    Wk2[rows_k] /= a
    bk2[rows_k] /= a
    new = all_scores(Wq2, Wk2, bq2, bk2, g, seqs, rope)
    for v in VARIANTS:
        close(new[v][0], ref[v][0], rtol=1e-10)
        close(new[v][1], ref[v][1], rtol=1e-10)


@pytest.mark.parametrize("a", [2.0, -3.0])
def test_rescaling_one_projection_keeps_shared_mask(a):
    """Multiplying W_Q and b_Q by a multiplies *both* Q and K scores by a^2: shared rankings unchanged."""
    hq, hk, m = 4, 2, 4
    Wq, Wk, bq, bk = block(hq, hk, m, True, seed=13)
    seqs, rope, g = sequences(14), hf_tables(m), geom(hq, hk, m)
    ref = all_scores(Wq, Wk, bq, bk, g, seqs, rope)
    new = all_scores(Wq * a, Wk, bq * a, bk, g, seqs, rope)
    for v in VARIANTS:
        close(new[v][0], a * a * ref[v][0], rtol=1e-10)
        close(new[v][1], a * a * ref[v][1], rtol=1e-10)
        for rho in (0.3, 0.5, 0.8):
            assert all(torch.equal(x, y) for x, y in zip(shared_mask(list(new[v]), rho),
                                                         shared_mask(list(ref[v]), rho)))


def test_gqa_equals_mha_with_replicated_key_heads():
    """I6: query scores match; a GQA key score is the sum of the per-query-head MHA key scores."""
    hq, hk, m = 6, 2, 4
    r = hq // hk
    Wq, Wk, bq, bk = block(hq, hk, m, True, seed=15)
    seqs, rope = sequences(16), hf_tables(m)
    rep = torch.cat([torch.arange(h // r * m, h // r * m + m) for h in range(hq)])
    gqa = all_scores(Wq, Wk, bq, bk, geom(hq, hk, m), seqs, rope)
    mha = all_scores(Wq, Wk[rep], bq, bk[rep], geom(hq, hq, m), seqs, rope)
    for v in VARIANTS:
        close(gqa[v][0], mha[v][0], rtol=1e-10)
        summed = mha[v][1].reshape(hk, r, m, D).sum(1).reshape(hk * m, D)
        close(gqa[v][1], summed, rtol=1e-10)


def test_identity_rotations_reduce_r_to_prerope():
    """I11: with cos = 1, sin = 0 every R variant equals its pre-RoPE counterpart."""
    hq, hk, m = 4, 2, 4
    Wq, Wk, bq, bk = block(hq, hk, m, True, seed=17)
    seqs = sequences(18)
    ident = (torch.ones(8, m, dtype=torch.float64), torch.zeros(8, m, dtype=torch.float64))
    s = all_scores(Wq, Wk, bq, bk, geom(hq, hk, m), seqs, ident)
    for with_r, without in (("R", "base"), ("MR", "M"), ("RC", "C"), ("MRC", "MC")):
        close(s[with_r][0], s[without][0], rtol=1e-10)
        close(s[with_r][1], s[without][1], rtol=1e-10)
    assert not torch.allclose(s["M"][0], s["base"][0])  # the switches do change the scores


def test_chunking_merging_and_duplication_invariance():
    """I9/I10: 1 chunk vs several vs merged accumulators; duplicating every sequence (N -> 2N) changes
    nothing (a mean over sequences, not a sum)."""
    hq, hk, m = 4, 2, 4
    Wq, Wk, bq, bk = block(hq, hk, m, True, seed=19)
    g, rope = geom(hq, hk, m), hf_tables(m)
    x = torch.randn(6, 5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(20)) + 0.3
    one = QKStats(Wq, Wk, bq, bk, g, VARIANTS, rope=rope)
    one.update(x)
    many = QKStats(Wq, Wk, bq, bk, g, VARIANTS, rope=rope)
    for c in x.split(2):
        many.update(c)
    part_a = QKStats(Wq, Wk, bq, bk, g, VARIANTS, rope=rope)
    part_b = QKStats(Wq, Wk, bq, bk, g, VARIANTS, rope=rope)
    part_a.update(x[:1])
    part_b.update(x[1:], rope=(rope[0][None, :5].expand(5, -1, -1), rope[1][None, :5].expand(5, -1, -1)))
    part_a.merge(part_b)
    dup = QKStats(Wq, Wk, bq, bk, g, VARIANTS, rope=rope)
    dup.update(torch.cat([x, x]))
    assert one.n_seqs == many.n_seqs == part_a.n_seqs == 6 and dup.n_seqs == 12
    for v in VARIANTS:
        ref = one.scores(v)
        masks = shared_mask(list(ref), 0.5)
        for other in (many, part_a, dup):
            got = other.scores(v)
            close(got[0], ref[0], rtol=1e-12)
            close(got[1], ref[1], rtol=1e-12)
            assert all(torch.equal(a, b) for a, b in zip(shared_mask(list(got), 0.5), masks))


def test_float32_inputs_and_weights_are_accumulated_in_float64():
    hq, hk, m = 2, 1, 4
    Wq, Wk, bq, bk = block(hq, hk, m, True, seed=21)
    x = torch.randn(2, 5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(22))
    st64 = QKStats(Wq, Wk, bq, bk, geom(hq, hk, m), "MC")
    st64.update(x)
    st32 = QKStats(Wq.float(), Wk.float(), bq.float(), bk.float(), geom(hq, hk, m), "MC")
    st32.update(x.float())
    assert st32.A_K[QKVariant.parse("MC")].dtype == torch.float64
    close(st32.scores()[0], st64.scores()[0], rtol=1e-5)


# --- segmentation ------------------------------------------------------------------------------------

def test_segment_sequences_order_and_errors():
    x = torch.arange(2 * 8 * 3).reshape(2, 8, 3)
    seg = segment_sequences(x, 4)
    assert seg.shape == (4, 4, 3)
    assert torch.equal(seg, torch.stack([x[0, :4], x[0, 4:], x[1, :4], x[1, 4:]]))
    assert segment_sequences(torch.arange(16).reshape(2, 8), 2).shape == (8, 2)
    with pytest.raises(SecateurError, match="divide"):
        segment_sequences(x, 3)
    with pytest.raises(SecateurError):
        segment_sequences(x, 0)


def test_segmented_windows_are_independent_sequences():
    """Statistics of a segmented window = statistics of its segments given one by one (positions restart)."""
    hq, hk, m = 2, 1, 4
    Wq, Wk, bq, bk = block(hq, hk, m, True, seed=23)
    x = torch.randn(2, 8, D, dtype=torch.float64, generator=torch.Generator().manual_seed(24))
    rope = hf_tables(m, 4)
    a = QKStats(Wq, Wk, bq, bk, geom(hq, hk, m), VARIANTS, rope=rope)
    a.update(segment_sequences(x, 4))
    b = QKStats(Wq, Wk, bq, bk, geom(hq, hk, m), VARIANTS, rope=rope)
    for w in range(2):
        for s in range(2):
            b.update(x[w, 4 * s:4 * s + 4])
    whole = QKStats(Wq, Wk, bq, bk, geom(hq, hk, m), VARIANTS, rope=hf_tables(m, 8))
    whole.update(x)
    assert a.n_seqs == 4 and whole.n_seqs == 2
    for v in VARIANTS:
        close(a.scores(v)[0], b.scores(v)[0], rtol=1e-12)
        close(a.scores(v)[1], b.scores(v)[1], rtol=1e-12)
        assert not torch.allclose(a.scores(v)[0], whole.scores(v)[0])


# --- real (tiny) Hugging Face blocks ------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tiny_model_block_matches_module_bruteforce(family):
    """Scores from QKStats on a real block equal deletion costs computed through the block's own q_proj /
    k_proj modules and the model's rotary tables (spot-checked on a sample of weights)."""
    model = tiny_model(family).double()
    ad = get_adapter(model)
    layer = ad.layers[0]
    ids = random_ids(2, 6)
    h, kw = ad.capture_inputs(ids)
    with torch.no_grad():
        x = ad.attn_norm(layer, h)
    cos, sin = model_rope_tables(model, 6)
    assert torch.equal(cos, kw["position_embeddings"][0][0]) and torch.equal(sin, kw["position_embeddings"][1][0])
    gm = ad.geometry
    hq, hk, m = gm.n_heads, gm.n_kv_heads, gm.head_dim
    a = layer.self_attn
    refs = ad.role_refs(layer)
    variants = ["base", "MR", "MRC"]
    st = QKStats(refs["q"].weight, refs["k"].weight, refs["q"].bias, refs["k"].bias, gm, variants,
                 rope=kw["position_embeddings"])
    st.update(x)

    def zs(v):
        with torch.no_grad():
            Q = a.q_proj(x).reshape(2, 6, hq, m)
            K = a.k_proj(x).reshape(2, 6, hk, m)
            if v.rope:
                Q, K = apply_rotary_pos_emb(Q, K, cos[None], sin[None], unsqueeze_dim=2)
        K = K.repeat_interleave(hq // hk, dim=2)
        return [torch.einsum("thm,uhm->htu", Q[s], K[s]) for s in range(2)]

    gen = torch.Generator().manual_seed(0)
    for name in variants:
        v = QKVariant.parse(name)
        Sq, Sk = qk_wanda_scores(refs["q"].weight, refs["k"].weight, refs["q"].bias, refs["k"].bias, st, gm, name)
        ref = zs(v)
        for proj, S in ((a.q_proj, Sq), (a.k_proj, Sk)):
            for _ in range(6):
                i = int(torch.randint(S.shape[0], (1,), generator=gen))
                j = int(torch.randint(S.shape[1], (1,), generator=gen))
                with torch.no_grad():
                    w = proj.weight[i, j].item()
                    proj.weight[i, j] = 0
                    got = zs(v)
                    proj.weight[i, j] = w
                cost = sum(loss(got[s], ref[s], v) for s in range(2)) / 2
                torch.testing.assert_close(S[i, j], cost, rtol=1e-8, atol=1e-12)


# --- errors and parsing ------------------------------------------------------------------------------

def test_variant_parsing():
    assert QKVariant.parse("rm").code == "MR"
    assert QKVariant.parse("QK-Wanda-MRC") == QKVariant(True, True, True)
    assert QKVariant.parse(None).code == "base" and QKVariant.parse("base").method_name == "QK-Wanda"
    assert QKVariant.parse("c").method_name == "QK-Wanda-C"
    assert sorted(QKVariant.parse(v).code for v in VARIANTS) == sorted(VARIANTS)
    for bad in ("X", "MM", "causal"):
        with pytest.raises(SecateurError, match="variant"):
            QKVariant.parse(bad)


def test_errors():
    Wq, Wk, bq, bk = block(4, 2, 4, True)
    g = geom(4, 2, 4)
    with pytest.raises(SecateurError, match="q/k norm"):
        QKStats(Wq, Wk, bq, bk, geom(4, 2, 4, qk_norm=True))
    with pytest.raises(SecateurError, match="multiple"):
        QKStats(Wq, Wk, bq, bk, geom(4, 3, 4))
    with pytest.raises(SecateurError, match="do not match"):
        QKStats(Wq, Wk, bq, bk, geom(2, 2, 4))
    with pytest.raises(SecateurError, match="rotary"):
        QKStats(Wq, Wk, bq, bk, geom(4, 2, 4, rope=False), "MR")
    st = QKStats(Wq, Wk, bq, bk, g, "R")
    with pytest.raises(SecateurError, match="cos/sin"):
        st.update(torch.randn(1, 3, D))
    with pytest.raises(SecateurError, match="covers 2 positions"):
        st.update(torch.randn(1, 3, D), rope=hf_tables(4, 2))
    with pytest.raises(SecateurError, match="no calibration"):
        st.scores()
    with pytest.raises(SecateurError, match="inputs"):
        st.update(torch.randn(1, 3, D + 1))
    with pytest.raises(SecateurError, match="non-finite"):
        st.update(torch.full((1, 3, D), float("nan")))
    st.update(torch.randn(1, 3, D), rope=hf_tables(4))
    with pytest.raises(SecateurError, match="not collected"):
        st.scores("M")
    with pytest.raises(SecateurError, match="differ"):
        qk_wanda_scores(Wq + 1, Wk, bq, bk, st)
    with pytest.raises(SecateurError, match="differ"):
        qk_wanda_scores(Wq, Wk, bq, None, st)
    with pytest.raises(SecateurError, match="geometry"):
        qk_wanda_scores(Wq, Wk, bq, bk, st, geom(2, 1, 8))
    assert qk_wanda_scores(Wq, Wk, bq, bk, st, g)[0].shape == Wq.shape
    other = QKStats(Wq, Wk, bq, bk, g, "M")
    with pytest.raises(SecateurError, match="same variants"):
        st.merge(other)
