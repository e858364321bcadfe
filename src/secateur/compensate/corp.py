"""CORP - Closed-form One-shot Representation-Preserving structured pruning (seed 002; spec corp.md).

The seed lost its equations; the formulas below are corp.md's re-derivation (checked against the
authors' public code there). Two parts, both folded into the weights (no inference overhead):

**MLP channels** (any MLP; Llama/Qwen/Mistral too). Hidden ``h`` (input of ``down_proj``/``fc2``),
``y = W2 h + b2``, kept channels S, pruned P, ``mu = E[h]``, ``Sigma = Cov(h)`` (population, 1/N):

    B = Sigma_PS (Sigma_SS + lambda I)^{-1},   c = mu_P - B mu_S            (ridge affine model h_P ~ B h_S + c)
    W2' = W2[:, S] + W2[:, P] B,               b2' = b2 + W2[:, P] c         (fold)

lambda (corp.md Sec. 3 [C]): ``max(lambda0, rho_sh tr(Sigma_SS)/|S|)``, lambda0 = 1e-3, rho_sh the OAS
shrinkage intensity (:func:`corp_lambda`); at lambda -> 0 this is least squares with an intercept
(corp.md K1). Ranking (CORP Sec. 3.3): ``E[h_i^2] * ||W2[:, i]||_2`` (:func:`secateur.scoring.corp.corp_mlp_scores`).

**Q/K head dimensions** (non-RoPE models only: OPT, GPT-2). Per head and calibration sequence b:
``Q_b, K_b`` (tokens x d_h, biases included), kept dims S, missing logits ``T_b = Q_{P,b} K_{P,b}^T``.

    min_M  sum_b ||Q_{S,b} M K_{S,b}^T - T_b||_F^2 + lambda ||M||_F^2
    normal equations: sum_b A_b[S,S] M C_b[S,S] + lambda M = sum_b A_b[S,P] C_b[P,S],
    A_b = Q_b^T Q_b,  C_b = K_b^T K_b   (per-sample second moments, :class:`secateur.calib.stats.PerSampleGram`)

solved exactly as a ``d_s^2`` SPD system (``mode='exact'``, default, corp.md [A5]) or in the pooled
Sylvester form ``A M C + lambda M = A_SP C_PS`` with ``A = sum_b A_b`` (``mode='pooled'``, the public
code's system, solved by two eigendecompositions). Folded so that ``q'^T k' = q_S^T (I + M) k_S``:
balanced split ``I + M = R Sig S^T``, ``W_Q' = (R Sig^1/2)^T W_Q[S]``, ``W_K' = (S Sig^1/2)^T W_K[S]``
(MHA), or one-sided ``W_Q' = (I + M)^T W_Q[S]``, ``W_K' = W_K[S]`` (required under GQA, where K is
shared by the query heads of a group). No symmetrization of ``I + M`` (corp.md [A6]). Ranking (CORP
Sec. 3.3, reading (a) of corp.md [A2]): ``s_j = mean_b ||Q_b[:, j]||^2 ||K_b[:, j]||^2``.

The softmax scale is not touched here: keep the model's original ``1/sqrt(d_h)`` when slicing (corp.md
[A7]); the compensation preserves unscaled logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from secateur.calib.stats import Gram, PerSampleGram
from secateur.compensate.base import Compensation, InputStats, finish, prepare, pruned_index
from secateur.errors import SecateurError
from secateur.linalg import one_thread, safe_eigh, safe_svd, solve_spd

__all__ = [
    "corp_lambda", "corp_mlp", "QKHeadStats", "corp_qk_solve", "qk_logit_errors",
    "fold_qk_balanced", "fold_q_one_sided", "QKCompensation", "corp_qk_layer",
]


# --------------------------------------------------------------------------------------------------
# shared: ridge rule and selection


def corp_lambda(sigma: torch.Tensor, n: int, *, lam0: float = 1e-3, auto: bool = True) -> tuple[float, float]:
    """CORP ridge (corp.md Sec. 3 [C]; the paper's equation was lost): ``lambda = max(lambda0,
    rho_sh tr(Sigma)/p)`` with the OAS shrinkage intensity (Chen et al. 2010)

        rho_sh = min(1, ((1 - 2/p) tr(Sigma^2) + tr(Sigma)^2) / ((n + 1 - 2/p)(tr(Sigma^2) - tr(Sigma)^2 / p)))

    ``p = dim(Sigma)``, n = calibration tokens; rho_sh = 1 when the denominator is not positive.
    ``auto=False`` returns ``lambda0`` (fixed mode). Returns ``(lambda, rho_sh)``."""
    if not auto:
        return float(lam0), float("nan")
    if n <= 0:
        raise SecateurError("the automatic CORP ridge needs the calibration token count n > 0")
    p = sigma.shape[0]
    if p == 0:
        return float(lam0), float("nan")
    s = sigma.to(torch.float64)
    tr = float(s.diagonal().sum())
    tr2 = float((s * s).sum())  # tr(Sigma^2) for symmetric Sigma
    den = (n + 1 - 2 / p) * (tr2 - tr * tr / p)
    rho = 1.0 if not den > 0 else min(1.0, ((1 - 2 / p) * tr2 + tr * tr) / den)
    return max(float(lam0), rho * tr / p), rho


# --------------------------------------------------------------------------------------------------
# MLP


def corp_mlp(w0: torch.Tensor, stats: InputStats | Gram, kept: torch.Tensor | Sequence[int], *,
             bias: torch.Tensor | None = None, lam: float | Literal["auto", "fixed"] = "auto",
             lam0: float = 1e-3, intercept: bool = True) -> Compensation:
    """CORP affine ridge compensation of an MLP output projection (corp.md Sec. 3).

    w0: ``down_proj``/``fc2`` weight ``[d, f]``; stats: statistics of the hidden h (``E[h h^T]``,
    ``E[h]``, n tokens); kept: kept channels S.
    lam: ``'auto'`` (OAS rule of :func:`corp_lambda` on Sigma_SS, default), ``'fixed'`` (= lam0) or a
    number. intercept: True = affine model with centered statistics, new bias ``b2 + W2[:, P] c``
    (bias-free models get a bias, corp.md [A4](i)); False = ``h_P ~ B h_S`` with uncentered second
    moments, bias unchanged ([A4](ii)).
    Diagnostics: ``lambda``, ``rho_sh``, ``solve_method``, ``cond_est``, ``err_schur`` (lambda -> 0 optimum
    ``tr(W_P Sigma_{P|S} W_P^T)`` relative to ``E||W2 h||^2``, CORP Prop. C.1.1; intercept mode only),
    ``r2_wp`` (Prop. C.1.2, fraction of ``W_P h_P``'s variance explained by h_S).
    """
    st, k = prepare(w0, stats, kept, bias)
    if intercept and st.mean is None:
        raise SecateurError("corp_mlp(intercept=True) needs the hidden mean in the statistics")
    p = pruned_index(k, w0.shape[1])
    w = w0.to(torch.float64)
    diag: dict[str, Any] = {"method": "corp_mlp", "intercept": intercept, "n_pruned": int(p.numel())}
    base = torch.zeros(w.shape[0], dtype=torch.float64, device=w.device) if bias is None else bias.to(w)
    if p.numel() == 0:
        diag.update(**{"lambda": 0.0, "rho_sh": float("nan")})
        return finish(w0, st, k, w[:, k], None, bias, diag)
    sig = st.cov if intercept else st.second_moment
    s_ss = sig[k][:, k]
    s_ps = sig[p][:, k]
    if isinstance(lam, str):
        if lam not in ("auto", "fixed"):
            raise SecateurError(f"lam must be 'auto', 'fixed' or a number, got {lam!r}")
        lam_v, rho = corp_lambda(s_ss, st.n, lam0=lam0, auto=lam == "auto")
    else:
        lam_v, rho = float(lam), float("nan")
    if lam_v < 0:
        raise SecateurError(f"ridge lambda must be >= 0, got {lam_v}")
    diag.update(**{"lambda": lam_v, "rho_sh": rho})
    eye = torch.eye(k.numel(), dtype=sig.dtype, device=sig.device)
    bmat = solve_spd(s_ss + lam_v * eye, s_ps, info=diag)  # |P| x |S|
    if not bool(torch.isfinite(bmat).all()):
        raise SecateurError("CORP MLP ridge solve produced NaN/Inf")
    wp = w[:, p]
    w_new = w[:, k] + wp @ bmat
    new_bias = None
    if intercept:
        mu = st.mean.to(w)
        c = mu[p] - bmat @ mu[k]
        new_bias = base + wp @ c
        # Prop. C.1.1 / C.1.2 diagnostics (lambda -> 0 quantities, pseudo-inverse for safety)
        s_pp = sig[p][:, p]
        with one_thread():
            expl = s_ps @ torch.linalg.pinv(s_ss, hermitian=True) @ s_ps.mT
        y = float(((w @ st.second_moment) * w).sum())
        schur = float(((wp @ (s_pp - expl)) * wp).sum())
        var_wp = float(((wp @ s_pp) * wp).sum())
        diag["err_schur"] = schur / y if y > 0 else schur
        diag["r2_wp"] = float(((wp @ expl) * wp).sum()) / var_wp if var_wp > 0 else float("nan")
    return finish(w0, st, k, w_new, new_bias, bias, diag)


# --------------------------------------------------------------------------------------------------
# Q/K statistics


@dataclass
class QKHeadStats:
    """Statistics of one (query head, its KV head) pair: per-sample ``A_b = Q_b^T Q_b`` and
    ``C_b = K_b^T K_b`` (``[N, d_h, d_h]``, same sample order), the query mean and the token count
    (for the auto ridge)."""

    q_grams: torch.Tensor
    k_grams: torch.Tensor
    q_mean: torch.Tensor | None = None
    n_tokens: int = 0

    @classmethod
    def from_accumulators(cls, q: PerSampleGram, k: PerSampleGram, head: int, kv_head: int | None = None
                          ) -> QKHeadStats:
        if q.n_seqs != k.n_seqs:
            raise SecateurError("query and key accumulators saw different numbers of sequences")
        kv = head if kv_head is None else kv_head
        return cls(q.head(head), k.head(kv), q.mean(head), q.n_tokens)

    @property
    def q_cov(self) -> torch.Tensor:
        if self.q_mean is None or self.n_tokens <= 0:
            raise SecateurError("the auto ridge needs the query mean and token count")
        mu = self.q_mean.to(torch.float64)
        return self.q_grams.sum(0) / self.n_tokens - torch.outer(mu, mu)


def qk_logit_errors(q_grams: torch.Tensor, k_grams: torch.Tensor, kept: torch.Tensor, m: torch.Tensor
                    ) -> dict[str, float]:
    """Exact per-sample logit errors from the Grams (no n x n matrix):
    ``J(M) = sum_b tr(M^T A_SS M C_SS) - 2 tr(M^T A_SP C_PS) + tr(A_PP C_PP)``; ``J(0) = sum_b ||T_b||^2``;
    ``dense = sum_b ||Q_b K_b^T||^2 = sum_b tr(A_b C_b)``."""
    d = q_grams.shape[-1]
    p = pruned_index(kept, d)
    a, c = q_grams.to(torch.float64), k_grams.to(torch.float64)
    a_ss, c_ss = a[:, kept][:, :, kept], c[:, kept][:, :, kept]
    a_sp, c_ps = a[:, kept][:, :, p], c[:, p][:, :, kept]
    a_pp, c_pp = a[:, p][:, :, p], c[:, p][:, :, p]
    m = m.to(torch.float64)
    t2 = float((a_pp * c_pp).sum())  # tr(A_PP C_PP), both symmetric
    quad = float(((a_ss @ m @ c_ss) * m).sum())
    cross = float(((a_sp @ c_ps) * m).sum())
    dense = float((a * c).sum())
    return {"logit_err_before": t2, "logit_err_after": quad - 2 * cross + t2, "logit_dense": dense}


def corp_qk_solve(stats: QKHeadStats, kept: torch.Tensor | Sequence[int], *,
                  lam: float | Literal["auto", "fixed"] = "auto", lam0: float = 1e-3,
                  mode: Literal["exact", "pooled"] = "exact") -> tuple[torch.Tensor, dict[str, Any]]:
    """Logit compensator ``M`` (``d_s x d_s``) of one head (corp.md Sec. 4).

    exact: ``[sum_b A_b,SS (x) C_b,SS + lambda I] vec_r(M) = vec_r(sum_b A_b,SP C_b,PS)`` (row-major vec;
    Cholesky with jitter/least-squares fallback). pooled: ``A_SS M C_SS + lambda M = A_SP C_PS`` with
    ``A = sum_b A_b``, ``C = sum_b C_b``, solved as
    ``M = P_A [(P_A^T R P_C) / (l_A l_C^T + lambda)] P_C^T`` (pseudo-inverse on zero denominators).
    lam: ``'auto'`` = :func:`corp_lambda` on the query covariance ``Sigma^Q_SS`` with n = tokens
    (corp.md Sec. 4 [C]); note this is in per-token units while the system is in summed units, so it
    is a light regularizer - as in the public code. A NaN solution falls back to ``M = 0`` (corp.md
    Sec. 9). Returns ``(M, diagnostics)`` with the exact logit errors of :func:`qk_logit_errors` and
    ``rho2_attn = 1 - J(M)/J(0)`` (CORP Prop. C.2.2).
    """
    a_all = stats.q_grams.to(torch.float64)
    c_all = stats.k_grams.to(torch.float64)
    d = a_all.shape[-1]
    k = torch.as_tensor(kept, dtype=torch.long).flatten()
    p = pruned_index(k, d)
    ds = k.numel()
    diag: dict[str, Any] = {"mode": mode, "n_pruned": int(p.numel())}
    if isinstance(lam, str):
        if lam not in ("auto", "fixed"):
            raise SecateurError(f"lam must be 'auto', 'fixed' or a number, got {lam!r}")
        lam_v, rho = (corp_lambda(stats.q_cov[k][:, k], stats.n_tokens, lam0=lam0) if lam == "auto"
                      else (float(lam0), float("nan")))
    else:
        lam_v, rho = float(lam), float("nan")
    diag.update(**{"lambda": lam_v, "rho_sh": rho})
    if p.numel() == 0 or ds == 0:
        m = torch.zeros(ds, ds, dtype=torch.float64)
    else:
        a_ss, c_ss = a_all[:, k][:, :, k], c_all[:, k][:, :, k]
        rhs = (a_all[:, k][:, :, p] @ c_all[:, p][:, :, k]).sum(0)
        if mode == "exact":
            big = torch.einsum("bij,bkl->ikjl", a_ss, c_ss).reshape(ds * ds, ds * ds)
            big = big + lam_v * torch.eye(ds * ds, dtype=big.dtype)
            m = solve_spd(big, rhs.reshape(-1, 1), side="left", info=diag).reshape(ds, ds)
        elif mode == "pooled":
            # pooled statistics include cross-sample token pairs: G_Q M G_K + lambda M = C_Q C_K
            a_sum, c_sum = a_all.sum(0), c_all.sum(0)
            rhs = a_sum[k][:, p] @ c_sum[p][:, k]
            la, pa = safe_eigh(a_sum[k][:, k])
            lc, pc = safe_eigh(c_sum[k][:, k])
            den = la[:, None] * lc[None, :] + lam_v
            tiny = 1e-12 * float(den.abs().max()) if den.numel() else 0.0
            inv = torch.where(den.abs() > tiny, 1.0 / den, torch.zeros_like(den))
            m = pa @ ((pa.mT @ rhs @ pc) * inv) @ pc.mT
        else:
            raise SecateurError(f"unknown CORP attention mode {mode!r}")
        if not bool(torch.isfinite(m).all()):
            diag["nan_fallback"] = True
            m = torch.zeros(ds, ds, dtype=torch.float64)
    errs = qk_logit_errors(a_all, c_all, k, m)
    diag.update(errs)
    t2 = errs["logit_err_before"]
    diag["rho2_attn"] = 1 - errs["logit_err_after"] / t2 if t2 > 0 else float("nan")
    return m, diag


# --------------------------------------------------------------------------------------------------
# folding


def fold_qk_balanced(w_q: torch.Tensor, b_q: torch.Tensor | None, w_k: torch.Tensor, b_k: torch.Tensor | None,
                     kept: torch.Tensor, m: torch.Tensor, *, clamp: float = 1e-6,
                     info: dict[str, Any] | None = None):
    """Balanced fold of one head (corp.md Sec. 4): ``I + M = R Sig S^T`` (SVD, not symmetrized),
    ``U = R Sig^1/2``, ``V = S Sig^1/2``; ``W_Q' = U^T W_Q[S]``, ``b_Q' = U^T b_Q[S]``,
    ``W_K' = V^T W_K[S]``, ``b_K' = V^T b_K[S]`` so ``q'^T k' = q_S^T (I + M) k_S``. Singular values are
    clamped at ``clamp`` (public-code safeguard; ``info['sv_clamped']`` counts it).
    Inputs are the head's rows ``[d_h, d]`` / ``[d_h]``; returns ``(w_q', b_q', w_k', b_k')``."""
    ds = kept.numel()
    mm = torch.eye(ds, dtype=torch.float64) + m.to(torch.float64)
    r, sig, sh = safe_svd(mm)
    n_cl = int((sig < clamp).sum())
    sig = sig.clamp_min(clamp)
    u = r * sig.sqrt()
    v = sh.mT * sig.sqrt()
    if info is not None:
        info["sv_clamped"] = info.get("sv_clamped", 0) + n_cl

    def fold(t: torch.Tensor | None, f: torch.Tensor) -> torch.Tensor | None:
        if t is None:
            return None
        return (f.mT.to(torch.float64) @ t[kept].to(torch.float64)).to(t.dtype)

    return fold(w_q, u), fold(b_q, u), fold(w_k, v), fold(b_k, v)


def fold_q_one_sided(w_q: torch.Tensor, b_q: torch.Tensor | None, kept: torch.Tensor, m: torch.Tensor):
    """One-sided fold of one query head (GQA-safe): ``W_Q' = (I + M)^T W_Q[S]``, ``b_Q' = (I + M)^T b_Q[S]``;
    the (shared) key head is only sliced, ``W_K' = W_K[S]``. Returns ``(w_q', b_q')``."""
    mm = (torch.eye(kept.numel(), dtype=torch.float64) + m.to(torch.float64)).mT
    wq = (mm @ w_q[kept].to(torch.float64)).to(w_q.dtype)
    bq = None if b_q is None else (mm @ b_q[kept].to(torch.float64)).to(b_q.dtype)
    return wq, bq


# --------------------------------------------------------------------------------------------------
# one attention layer


@dataclass
class QKCompensation:
    """Result of :func:`corp_qk_layer`: new q/k weights ``[n_heads * d_s, d]``, ``[n_kv_heads * d_s, d]``
    (+ biases or None), the kept dims per KV head ``[n_kv_heads, d_s]`` (ascending; under MHA one row per
    head), the M matrices ``[n_heads, d_s, d_s]`` and per-head diagnostics. v/o are untouched; the
    attention module must accept a q/k head width ``d_s`` different from the v width and keep the
    original softmax scale ``1/sqrt(d_h)``."""

    w_q: torch.Tensor
    b_q: torch.Tensor | None
    w_k: torch.Tensor
    b_k: torch.Tensor | None
    kept: torch.Tensor
    m: torch.Tensor
    diagnostics: dict[str, Any] = field(default_factory=dict)


def corp_qk_layer(w_q: torch.Tensor, b_q: torch.Tensor | None, w_k: torch.Tensor, b_k: torch.Tensor | None,
                  q_stats: PerSampleGram, k_stats: PerSampleGram, kept: torch.Tensor, *, n_heads: int,
                  n_kv_heads: int, rope: bool = False, lam: float | Literal["auto", "fixed"] = "auto",
                  lam0: float = 1e-3, mode: Literal["exact", "pooled"] = "exact",
                  fold: Literal["auto", "balanced", "one_sided"] = "auto",
                  map_heads: Callable[[list, Callable], list] | None = None) -> QKCompensation:
    """CORP Q/K dim pruning + logit compensation of one attention layer (corp.md Sec. 2, 4, 5).

    w_q ``[n_heads * d_h, d]``, w_k ``[n_kv_heads * d_h, d]`` (``[out, in]``), biases or None;
    q_stats / k_stats: :class:`PerSampleGram` of the q and k projection outputs (``n_heads`` /
    ``n_kv_heads`` heads, the logits' q and k - e.g. OPT's q before or after its constant scaling,
    consistently). ``kept`` ``[n_kv_heads, d_s]``: the dims each KV head keeps, shared by its query heads, chosen
    by the method (:func:`secateur.scoring.corp.corp_qk_kept`: the paper's group score). fold: ``'auto'`` =
    balanced for MHA, one-sided under GQA.
    Raises for RoPE models (rotary embeddings do not commute with dim pruning/mixing, corp.md [A8]).
    ``map_heads(items, fn)``: how the per-head ridge solves are run (default: in turn; a run split over processes
    passes :meth:`secateur.calib.dist.Owners.map`, each head solved on its owner rank, the result on every rank).
    """
    fold_mode = _check_layer(w_q, w_k, q_stats, k_stats, n_heads, n_kv_heads, rope, fold)
    d_h, g = w_q.shape[0] // n_heads, n_heads // n_kv_heads
    head_stats = [QKHeadStats.from_accumulators(q_stats, k_stats, h, h // g) for h in range(n_heads)]
    kept = torch.as_tensor(kept, dtype=torch.long)
    if kept.shape[0] != n_kv_heads:
        raise SecateurError(f"kept must be [n_kv_heads={n_kv_heads}, d_s], got {tuple(kept.shape)}")
    ds = kept.shape[1]
    wq_out, bq_out, wk_out, bk_out, ms, per_head = [], [], [], [], [], []
    fold_info: dict[str, Any] = {}
    solves = (map_heads or (lambda xs, fn: [fn(x) for x in xs]))(
        list(range(n_heads)), lambda h: corp_qk_solve(head_stats[h], kept[h // g], lam=lam, lam0=lam0, mode=mode))
    for h in range(n_heads):
        kv = h // g
        s_idx = kept[kv]
        m, dg = solves[h]
        ms.append(m)
        per_head.append(dg)
        qrows = slice(h * d_h, (h + 1) * d_h)
        krows = slice(kv * d_h, (kv + 1) * d_h)
        if fold_mode == "balanced":
            wq, bq, wk, bk = fold_qk_balanced(w_q[qrows], None if b_q is None else b_q[qrows], w_k[krows],
                                              None if b_k is None else b_k[krows], s_idx, m, info=fold_info)
            wk_out.append(wk)
            bk_out.append(bk)
        else:
            wq, bq = fold_q_one_sided(w_q[qrows], None if b_q is None else b_q[qrows], s_idx, m)
        wq_out.append(wq)
        bq_out.append(bq)
    if fold_mode == "one_sided":
        for kv in range(n_kv_heads):
            krows = slice(kv * d_h, (kv + 1) * d_h)
            wk_out.append(w_k[krows][kept[kv]])
            bk_out.append(None if b_k is None else b_k[krows][kept[kv]])
    cat = (lambda xs: None if xs[0] is None else torch.cat(xs))  # noqa: E731
    return QKCompensation(w_q=torch.cat(wq_out), b_q=cat(bq_out), w_k=torch.cat(wk_out), b_k=cat(bk_out),
                          kept=kept, m=torch.stack(ms) if ms else torch.zeros(0, ds, ds),
                          diagnostics=_layer_diagnostics(per_head, mode, fold_mode, ds, fold_info))


def _check_layer(w_q: torch.Tensor, w_k: torch.Tensor, q_stats: PerSampleGram, k_stats: PerSampleGram,
                 n_heads: int, n_kv_heads: int, rope: bool, fold: str) -> str:
    """Refuse what :func:`corp_qk_layer` cannot do; returns the fold actually used."""
    if rope:
        raise SecateurError("CORP Q/K compensation is defined only for non-RoPE models (OPT, GPT-2); "
                            "this model uses rotary embeddings")
    if n_heads % n_kv_heads:
        raise SecateurError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    d_h = w_q.shape[0] // n_heads
    if w_q.shape[0] != n_heads * d_h or w_k.shape[0] != n_kv_heads * d_h:
        raise SecateurError("q/k projection rows do not match the head counts")
    if (q_stats.n_heads, k_stats.n_heads) != (n_heads, n_kv_heads) or q_stats.head_dim != d_h:
        raise SecateurError("PerSampleGram head layout does not match the projections")
    g = n_heads // n_kv_heads
    fold_mode = ("balanced" if g == 1 else "one_sided") if fold == "auto" else fold
    if fold_mode == "balanced" and g != 1:
        raise SecateurError("the balanced Q/K fold needs MHA; under GQA the key head is shared - use one_sided")
    return fold_mode


def _layer_diagnostics(per_head: list[dict], mode: str, fold_mode: str, ds: int, fold_info: dict) -> dict:
    before = sum(d["logit_err_before"] for d in per_head)
    after = sum(d["logit_err_after"] for d in per_head)
    dense = sum(d["logit_dense"] for d in per_head)
    return {"method": "corp_qk", "mode": mode, "fold": fold_mode, "d_s": ds, "heads": per_head,
            "logit_rel_before": before / dense if dense > 0 else float("nan"),
            "logit_rel_after": after / dense if dense > 0 else float("nan"),
            "sv_clamped": fold_info.get("sv_clamped", 0)}
