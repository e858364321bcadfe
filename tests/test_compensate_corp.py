"""CORP invariants (corp.md Sec. 10): MLP ridge-affine compensation (K1-K4), Q/K logit compensator
(K5-K8, K10), the per-sample Gram accumulator, the ridge rule, ranking and selection."""

from __future__ import annotations

import pytest
import torch

from secateur.calib.stats import PerSampleGram
from secateur.compensate import InputStats, ls_refit
from secateur.compensate.corp import (
    QKHeadStats,
    corp_lambda,
    corp_mlp,
    corp_qk_layer,
    corp_qk_solve,
    fold_q_one_sided,
    fold_qk_balanced,
    qk_logit_errors,
)
from secateur.errors import SecateurError
from secateur.scoring.corp import corp_keep, corp_mlp_scores, corp_qk_kept, corp_qk_scores

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


def mlp_case(d: int = 16, f: int = 40, n: int = 900, seed: int = 0):
    """Hidden activations h (post-GELU-like: non-negative mean, correlated), W2 and b2."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, f, generator=g, dtype=F64) @ (torch.eye(f, dtype=F64)
                                                    + torch.randn(f, f, generator=g, dtype=F64) / f**0.5)
    h = torch.nn.functional.gelu(z)
    w2 = torch.randn(d, f, generator=g, dtype=F64)
    b2 = torch.randn(d, generator=g, dtype=F64)
    kept = torch.sort(torch.randperm(f, generator=g)[: f // 2]).values
    return h, w2, b2, kept


def rel_err(h, w2, b2, kept, w_new, b_new):
    y = h @ w2.T + b2
    yh = h[:, kept] @ w_new.T + (b2 if b_new is None else b_new)
    return float(((y - yh) ** 2).sum(1).mean() / ((h @ w2.T) ** 2).sum(1).mean())


# ---------------------------------------------------------------- MLP


def test_mlp_lambda_zero_is_ls_with_intercept():
    """K1: lambda -> 0 CORP == least squares of y = W2 h + b2 on [h_S, 1] (brute force and ls_refit)."""
    h, w2, b2, kept = mlp_case()
    st = InputStats.from_samples(h)
    out = corp_mlp(w2, st, kept, bias=b2, lam=0.0)
    xa = torch.cat([h[:, kept], torch.ones(h.shape[0], 1, dtype=F64)], 1)
    sol = torch.linalg.lstsq(xa, h @ w2.T + b2).solution.T
    torch.testing.assert_close(out.weight, sol[:, :-1], atol=1e-8, rtol=1e-8)
    torch.testing.assert_close(out.bias, sol[:, -1], atol=1e-8, rtol=1e-8)
    ls = ls_refit(w2, st, kept, bias=b2, lam=0.0, intercept=True)
    torch.testing.assert_close(out.weight, ls.weight, atol=1e-8, rtol=1e-8)
    torch.testing.assert_close(out.bias, ls.bias, atol=1e-8, rtol=1e-8)
    near = corp_mlp(w2, st, kept, bias=b2, lam=1e-11)
    torch.testing.assert_close(near.weight, out.weight, atol=1e-6, rtol=1e-6)


def test_mlp_errors_schur_and_monotone():
    """K2: compensated error (lambda -> 0) = tr(W_P Sigma_{P|S} W_P^T); uncompensated = tr(W_P (Sigma_PP +
    mu_P mu_P^T) W_P^T); compensated <= uncompensated for every lambda >= 0; diagnostics match tokens."""
    h, w2, b2, kept = mlp_case(seed=1)
    st = InputStats.from_samples(h)
    p = torch.tensor([i for i in range(h.shape[1]) if i not in set(kept.tolist())])
    y = float(((h @ w2.T) ** 2).sum(1).mean())
    sig, mu = st.cov, st.mean
    wp = w2[:, p]
    schur = sig[p][:, p] - sig[p][:, kept] @ torch.linalg.solve(sig[kept][:, kept], sig[kept][:, p])
    out0 = corp_mlp(w2, st, kept, bias=b2, lam=0.0)
    torch.testing.assert_close(out0.diagnostics["recon_after"], float(torch.trace(wp @ schur @ wp.T)) / y)
    torch.testing.assert_close(out0.diagnostics["err_schur"], out0.diagnostics["recon_after"])
    unc = float(torch.trace(wp @ (sig[p][:, p] + torch.outer(mu[p], mu[p])) @ wp.T)) / y
    torch.testing.assert_close(out0.diagnostics["recon_before"], unc)
    for lam in (0.0, 1e-3, 0.1, 10.0, "auto", "fixed"):
        out = corp_mlp(w2, st, kept, bias=b2, lam=lam)
        torch.testing.assert_close(out.diagnostics["recon_after"], rel_err(h, w2, b2, kept, out.weight, out.bias))
        assert out0.diagnostics["recon_after"] <= out.diagnostics["recon_after"] <= unc
    assert 0 <= out0.diagnostics["r2_wp"] <= 1


def test_mlp_exact_affine_is_loss_free_and_empty_prune():
    """K3: h_P affine in h_S -> lambda -> 0 compensation reproduces the dense output; K4: P = {}."""
    g = torch.Generator().manual_seed(2)
    hs = torch.randn(500, 12, generator=g, dtype=F64) + 1.0
    hp = hs @ torch.randn(12, 5, generator=g, dtype=F64) + torch.randn(5, generator=g, dtype=F64)
    h = torch.cat([hs, hp], 1)
    w2 = torch.randn(8, 17, generator=g, dtype=F64)
    st = InputStats.from_samples(h)
    kept = torch.arange(12)
    out = corp_mlp(w2, st, kept, lam=0.0)  # bias-free layer: CORP adds one
    assert out.bias is not None
    torch.testing.assert_close(h[:, kept] @ out.weight.T + out.bias, h @ w2.T, atol=1e-8, rtol=1e-8)
    assert out.diagnostics["recon_after"] < 1e-14
    same = corp_mlp(w2, st, torch.arange(17))
    torch.testing.assert_close(same.weight, w2)
    assert same.bias is None


def test_mlp_no_intercept_mode():
    h, w2, b2, kept = mlp_case(seed=3)
    st = InputStats.from_samples(h)
    out = corp_mlp(w2, st, kept, bias=b2, lam=0.0, intercept=False)
    assert out.bias is None
    ls = ls_refit(w2, st, kept, lam=0.0)  # uncentered regression h_P ~ B h_S == LS without intercept
    torch.testing.assert_close(out.weight, ls.weight, atol=1e-8, rtol=1e-8)


def test_corp_lambda_rule():
    """lambda = max(lambda0, rho_sh tr(S)/p) with the OAS intensity; checked on hand-computable cases."""
    lam, rho = corp_lambda(2.0 * torch.eye(4, dtype=F64), n=100)
    assert rho == 1.0 and lam == 2.0  # isotropic: denominator 0 -> full shrinkage, lambda = tr/p
    s = torch.diag(torch.tensor([3.0, 1.0], dtype=F64))  # p=2: tr=4, tr(S^2)=10 -> rho = 16/((n)(2))
    lam, rho = corp_lambda(s, n=40)
    torch.testing.assert_close(rho, 16.0 / (40 * 2.0))
    torch.testing.assert_close(lam, max(1e-3, rho * 2.0))
    lam, _ = corp_lambda(1e-9 * s, n=40)
    assert lam == 1e-3
    assert corp_lambda(s, n=40, auto=False)[0] == 1e-3


def test_mlp_scores_and_keep():
    g = torch.Generator().manual_seed(4)
    w2 = torch.randn(6, 10, generator=g, dtype=F64)
    e = torch.rand(10, generator=g, dtype=F64)
    torch.testing.assert_close(corp_mlp_scores(w2, e), e * w2.norm(dim=0))
    w1 = torch.randn(10, 6, generator=g, dtype=F64)
    torch.testing.assert_close(corp_mlp_scores(w2, e, weight_factor="in_row_out_col", w_in=[w1]),
                               e * w1.norm(dim=1) * w2.norm(dim=0))
    scores = torch.tensor([5.0, 1.0, 1.0, 3.0, 1.0, 9.0])
    kept = corp_keep(scores, 0.5)  # prune floor(3) lowest: the three 1.0s
    assert kept.tolist() == [0, 3, 5]
    assert corp_keep(scores, 0.34).tolist() == [0, 1, 3, 5]  # tie among 1.0s: lower index kept
    assert corp_keep(scores, 0.9, min_keep=4).numel() == 4
    with pytest.raises(SecateurError):
        corp_keep(scores, 1.0)


# ---------------------------------------------------------------- Q/K


def qk_case(n_seq: int = 3, t: int = 7, d_h: int = 6, d: int = 10, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_seq, t, d, generator=g, dtype=F64)
    w_q = torch.randn(d_h, d, generator=g, dtype=F64)
    w_k = torch.randn(d_h, d, generator=g, dtype=F64)
    b_q = torch.randn(d_h, generator=g, dtype=F64)
    b_k = torch.randn(d_h, generator=g, dtype=F64)
    q = x @ w_q.T + b_q
    k = x @ w_k.T + b_k
    return x, q, k, w_q, b_q, w_k, b_k


def head_stats(q, k) -> QKHeadStats:
    aq, ak = PerSampleGram(q.shape[-1]), PerSampleGram(k.shape[-1])
    aq.update(q)
    ak.update(k)
    return QKHeadStats.from_accumulators(aq, ak, 0)


def brute_J(q, k, kept, m):
    p = [j for j in range(q.shape[-1]) if j not in set(kept.tolist())]
    tot = 0.0
    for b in range(q.shape[0]):
        qs, ks, qp, kp = q[b][:, kept], k[b][:, kept], q[b][:, p], k[b][:, p]
        tot += float(((qs @ m @ ks.T - qp @ kp.T) ** 2).sum())
    return tot


def test_per_sample_gram_streaming_and_merge():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 9, 3 * 4, generator=g, dtype=F64)
    acc = PerSampleGram(head_dim=4, n_heads=3)
    acc.update(x[:2])
    other = PerSampleGram(head_dim=4, n_heads=3)
    other.update(x[2:])
    acc.merge(other)
    assert acc.n_seqs == 5 and acc.n_tokens == 45
    xs = x.view(5, 9, 3, 4)
    for b in range(5):
        for h in range(3):
            torch.testing.assert_close(acc.grams[b, h], xs[b, :, h].T @ xs[b, :, h])
    torch.testing.assert_close(acc.mean(1), xs[:, :, 1].reshape(-1, 4).mean(0))
    with pytest.raises(SecateurError):
        acc.update(torch.zeros(1, 2, 5))


def test_qk_scores_reading_a():
    """K8: score_j = mean_b ||Q_b[:, j]||^2 ||K_b[:, j]||^2 = uncompensated error of removing dim j / N."""
    _, q, k, *_ = qk_case()
    hs = head_stats(q, k)
    s = corp_qk_scores(hs.q_grams, hs.k_grams)
    ref = ((q**2).sum(1) * (k**2).sum(1)).mean(0)
    torch.testing.assert_close(s, ref)
    j = 2
    kept = torch.tensor([i for i in range(6) if i != j])
    err = qk_logit_errors(hs.q_grams, hs.k_grams, kept, torch.zeros(5, 5, dtype=F64))
    torch.testing.assert_close(err["logit_err_before"], q.shape[0] * float(s[j]))
    torch.testing.assert_close(err["logit_err_after"], brute_J(q, k, kept, torch.zeros(5, 5, dtype=F64)))


def test_qk_exact_attains_least_squares_optimum():
    """K6: the exact (lambda -> 0) M minimizes sum_b ||Q_S M K_S^T - T_b||^2: equals the brute-force
    least-squares solution of the vectorized problem, and its reported error is the true residual."""
    _, q, k, *_ = qk_case(n_seq=4, t=9)
    hs = head_stats(q, k)
    kept = torch.tensor([0, 2, 3, 5])
    m, dg = corp_qk_solve(hs, kept, lam=0.0)
    p = [1, 4]
    rows, rhs = [], []
    for b in range(q.shape[0]):
        qs, ks = q[b][:, kept], k[b][:, kept]
        rows.append(torch.kron(qs, ks))  # vec_r(Q_S M K_S^T) = (Q_S kron K_S) vec_r(M)
        rhs.append((q[b][:, p] @ k[b][:, p].T).reshape(-1))
    sol = torch.linalg.lstsq(torch.cat(rows), torch.cat(rhs)).solution.reshape(4, 4)
    torch.testing.assert_close(m, sol, atol=1e-8, rtol=1e-8)
    torch.testing.assert_close(dg["logit_err_after"], brute_J(q, k, kept, m), atol=1e-8, rtol=1e-9)
    assert dg["logit_err_after"] < dg["logit_err_before"] and 0 < dg["rho2_attn"] < 1
    # the pooled solution is optimal for another system: never better on the exact objective
    mp, dp = corp_qk_solve(hs, kept, lam=0.0, mode="pooled")
    assert dp["logit_err_after"] >= dg["logit_err_after"] - 1e-9


def test_qk_single_sample_exact_equals_pooled_and_eigen_equals_kronecker():
    """K5 (one sample: exact == pooled) and K10 (eigen Sylvester solve == Kronecker solve)."""
    _, q, k, *_ = qk_case(n_seq=1, t=12)
    hs = head_stats(q, k)
    kept = torch.tensor([1, 2, 4, 5])
    for lam in (0.0, 0.5):
        me, _ = corp_qk_solve(hs, kept, lam=lam, mode="exact")
        mp, _ = corp_qk_solve(hs, kept, lam=lam, mode="pooled")
        torch.testing.assert_close(me, mp, atol=1e-8, rtol=1e-8)
    _, q3, k3, *_ = qk_case(n_seq=3, t=8, seed=7)
    hs3 = head_stats(q3, k3)
    mp, _ = corp_qk_solve(hs3, kept, lam=0.3, mode="pooled")
    a, c = hs3.q_grams.sum(0), hs3.k_grams.sum(0)
    p = torch.tensor([0, 3])
    big = torch.kron(a[kept][:, kept], c[kept][:, kept]) + 0.3 * torch.eye(16, dtype=F64)
    ref = torch.linalg.solve(big, (a[kept][:, p] @ c[p][:, kept]).reshape(-1)).reshape(4, 4)
    torch.testing.assert_close(mp, ref, atol=1e-8, rtol=1e-8)


def test_qk_folds_reproduce_compensated_logits():
    """K7: (W_Q' x + b_Q')^T (W_K' x + b_K') = q_S^T (I + M) k_S for the balanced and one-sided folds."""
    x, q, k, w_q, b_q, w_k, b_k = qk_case()
    kept = torch.tensor([0, 1, 3, 4])
    g = torch.Generator().manual_seed(8)
    m = 0.3 * torch.randn(4, 4, generator=g, dtype=F64)
    target = q[..., kept] @ (torch.eye(4, dtype=F64) + m) @ k[..., kept].transpose(-1, -2)
    wq, bq, wk, bk = fold_qk_balanced(w_q, b_q, w_k, b_k, kept, m)
    torch.testing.assert_close((x @ wq.T + bq) @ (x @ wk.T + bk).transpose(-1, -2), target)
    wq1, bq1 = fold_q_one_sided(w_q, b_q, kept, m)
    torch.testing.assert_close((x @ wq1.T + bq1) @ (x @ w_k[kept].T + b_k[kept]).transpose(-1, -2), target)
    # M = 0 keeps the sliced logits Q_S K_S^T
    wq0, bq0, wk0, bk0 = fold_qk_balanced(w_q, b_q, w_k, b_k, kept, torch.zeros(4, 4, dtype=F64))
    torch.testing.assert_close((x @ wq0.T + bq0) @ (x @ wk0.T + bk0).transpose(-1, -2),
                               q[..., kept] @ k[..., kept].transpose(-1, -2))


@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (4, 2)])
def test_qk_layer_mha_and_gqa(n_heads, n_kv):
    """Layer API: kept dims shared per KV group, folded logits reproduce q_S^T (I + M_h) k_S per head,
    and the compensated logit error is below the uncompensated one."""
    g = torch.Generator().manual_seed(9)
    d, d_h, n_seq, t = 24, 8, 3, 10
    x = torch.randn(n_seq, t, d, generator=g, dtype=F64)
    w_q = torch.randn(n_heads * d_h, d, generator=g, dtype=F64)
    w_k = torch.randn(n_kv * d_h, d, generator=g, dtype=F64)
    b_q = torch.randn(n_heads * d_h, generator=g, dtype=F64)
    b_k = torch.randn(n_kv * d_h, generator=g, dtype=F64)
    q, k = x @ w_q.T + b_q, x @ w_k.T + b_k
    qa, ka = PerSampleGram(d_h, n_heads), PerSampleGram(d_h, n_kv)
    qa.update(q)
    ka.update(k)
    kept = corp_qk_kept(qa, ka, n_heads, n_kv, 0.5, min_qk_dim=2)
    out = corp_qk_layer(w_q, b_q, w_k, b_k, qa, ka, kept, n_heads=n_heads, n_kv_heads=n_kv, lam=0.0)
    ds = d_h - 4
    assert out.w_q.shape == (n_heads * ds, d) and out.w_k.shape == (n_kv * ds, d) and out.kept.shape == (n_kv, ds)
    assert out.diagnostics["fold"] == ("balanced" if n_heads == n_kv else "one_sided")
    g_size = n_heads // n_kv
    qn, kn = x @ out.w_q.T + out.b_q, x @ out.w_k.T + out.b_k
    for h in range(n_heads):
        kv = h // g_size
        s_idx = out.kept[kv]
        qh, kh = q[..., h * d_h:(h + 1) * d_h], k[..., kv * d_h:(kv + 1) * d_h]
        target = qh[..., s_idx] @ (torch.eye(ds, dtype=F64) + out.m[h]) @ kh[..., s_idx].transpose(-1, -2)
        got = qn[..., h * ds:(h + 1) * ds] @ kn[..., kv * ds:(kv + 1) * ds].transpose(-1, -2)
        torch.testing.assert_close(got, target)
        dense = qh @ kh.transpose(-1, -2)
        err = float(((got - dense) ** 2).sum())
        torch.testing.assert_close(err, out.diagnostics["heads"][h]["logit_err_after"], rtol=1e-8, atol=1e-8)
        assert err < out.diagnostics["heads"][h]["logit_err_before"]
        # GQA: the group's query heads were ranked jointly (summed scores) and share the kept set
        score = sum(corp_qk_scores(qa.head(j), ka.head(kv)) for j in range(kv * g_size, (kv + 1) * g_size))
        assert torch.equal(out.kept[kv], corp_keep(score, 0.5))
    assert out.diagnostics["logit_rel_after"] < out.diagnostics["logit_rel_before"]


def test_qk_layer_refuses_rope():
    qa, ka = PerSampleGram(4, 2), PerSampleGram(4, 2)
    w = torch.zeros(8, 6, dtype=F64)
    with pytest.raises(SecateurError, match="RoPE"):
        corp_qk_layer(w, None, w, None, qa, ka, corp_qk_kept(qa, ka, 2, 2, 0.5), n_heads=2, n_kv_heads=2, rope=True)


def test_qk_layer_on_tiny_opt():
    """Real non-RoPE projections: per-sample Grams of OPT's q_proj/k_proj outputs (captured by hooks) drive
    the layer compensator; the folded projections reproduce q_S^T (I + M) k_S on the calibration tokens
    and lower the logit error of plain dim slicing."""
    from secateur.models.adapters import get_adapter
    from secateur.testing import random_ids, tiny_model

    model = tiny_model("opt")
    ad = get_adapter(model)
    geo = ad.geometry
    refs = ad.role_refs(ad.layers[1])
    d_h, n_h = geo.head_dim, geo.n_heads
    qa, ka = PerSampleGram(d_h, n_h), PerSampleGram(d_h, geo.n_kv_heads)
    xs: list[torch.Tensor] = []
    hooks = [refs["q"].module.register_forward_hook(lambda _m, _a, out: qa.update(out.detach())),
             refs["k"].module.register_forward_hook(lambda _m, _a, out: ka.update(out.detach())),
             refs["q"].module.register_forward_pre_hook(lambda _m, a: xs.append(a[0].detach()))]
    with torch.no_grad():
        for i in range(2):
            model(random_ids(3, 16, seed=10 + i))
    for h in hooks:
        h.remove()
    assert qa.n_seqs == 6 and qa.n_tokens == 96
    w_q, b_q = refs["q"].weight.detach().to(F64), refs["q"].bias.detach().to(F64)
    w_k, b_k = refs["k"].weight.detach().to(F64), refs["k"].bias.detach().to(F64)
    kept = corp_qk_kept(qa, ka, n_h, geo.n_kv_heads, 0.5, min_qk_dim=1)
    out = corp_qk_layer(w_q, b_q, w_k, b_k, qa, ka, kept, n_heads=n_h, n_kv_heads=geo.n_kv_heads, rope=geo.rope)
    assert out.diagnostics["fold"] == "balanced"
    x = torch.cat(xs).to(F64)
    q, k = x @ w_q.T + b_q, x @ w_k.T + b_k
    qn, kn = x @ out.w_q.T + out.b_q, x @ out.w_k.T + out.b_k
    ds = d_h // 2
    for h in range(n_h):
        s_idx = out.kept[h]
        qh, kh = q[..., h * d_h:(h + 1) * d_h], k[..., h * d_h:(h + 1) * d_h]
        got = qn[..., h * ds:(h + 1) * ds] @ kn[..., h * ds:(h + 1) * ds].transpose(-1, -2)
        target = qh[..., s_idx] @ (torch.eye(ds, dtype=F64) + out.m[h]) @ kh[..., s_idx].transpose(-1, -2)
        torch.testing.assert_close(got, target, atol=1e-8, rtol=1e-8)
    assert out.diagnostics["logit_rel_after"] < out.diagnostics["logit_rel_before"]
