"""Accumulators over the q/k input of an attention block that need the block's q/k projections.

:class:`QKStats` holds QK-Wanda's interaction factors (the formulas of every M/R/C variant are in
:mod:`secateur.scoring.qk_wanda`, whose ``qk_wanda_scores`` reads them); :class:`ProjectedQKStats` feeds
them the model's own q/k outputs; :class:`QKOutputGrams` holds CORP's per-sequence Q/K Grams.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from secateur.calib.rope import apply_rope, normalize_tables, pair_columns, rotated_diag
from secateur.calib.stats import Accumulator, PerSampleGram, check_finite
from secateur.errors import SecateurError
from secateur.models.linear import LinearRef

VARIANTS = ("base", "M", "R", "C", "MR", "MC", "RC", "MRC")


@dataclass(frozen=True)
class QKVariant:
    """Objective switches: ``causal`` (M), ``rope`` (R), ``centered`` (C)."""

    causal: bool = False
    rope: bool = False
    centered: bool = False

    @classmethod
    def parse(cls, v: str | QKVariant | None) -> QKVariant:
        """``"base"``/``""``/``None`` or letters from ``M, R, C`` in any order/case (``"mrc"``,
        ``"QK-Wanda-MR"``)."""
        if isinstance(v, QKVariant):
            return v
        s = (v or "").strip().upper()
        for prefix in ("QK-WANDA", "QKWANDA", "QK_WANDA"):
            if s.startswith(prefix):
                s = s[len(prefix):].lstrip("-_")
        if s in ("", "BASE", "UNMASKED"):
            return cls()
        if not set(s) <= set("MRC") or len(set(s)) != len(s):
            raise SecateurError(f"unknown QK-Wanda variant {v!r}; choose from {', '.join(VARIANTS)}")
        return cls(causal="M" in s, rope="R" in s, centered="C" in s)

    @property
    def code(self) -> str:
        letters = "M" * self.causal + "R" * self.rope + "C" * self.centered
        return letters or "base"

    @property
    def method_name(self) -> str:
        return "QK-Wanda" if self.code == "base" else f"QK-Wanda-{self.code}"


def _parse_variants(variants: str | QKVariant | Iterable[str | QKVariant] | None) -> tuple[QKVariant, ...]:
    items = [variants] if variants is None or isinstance(variants, str | QKVariant) else list(variants)
    out: list[QKVariant] = []
    for v in items:
        pv = QKVariant.parse(v)
        if pv not in out:
            out.append(pv)
    if not out:
        raise SecateurError("QKStats needs at least one variant")
    return tuple(out)


# ----------------------------------------------------------------------------------------------------
# small tensor helpers (all operate on one chunk of B independent sequences; dim 1 is the token axis)

def _outer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_s a_s b_s^T`` for ``a [B, D]``, ``b [B, d]``."""
    return a.T @ b


def _contract(f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``sum_s sum_t f[s,t,:] g[s,t,:]^T`` for ``f [B, T, ...]`` (flattened to D) and ``g [B, T, d]``."""
    b, t = g.shape[:2]
    return f.reshape(b * t, -1).T @ g.reshape(b * t, -1)


def _suffix_sum(v: torch.Tensor) -> torch.Tensor:
    return v.flip(1).cumsum(1).flip(1)


def _counts(t: int, ndim: int, like: torch.Tensor) -> torch.Tensor:
    """``[1, T, 1, ...]`` prefix lengths ``1..T``."""
    n = torch.arange(1, t + 1, dtype=like.dtype, device=like.device)
    return n.reshape(1, t, *([1] * (ndim - 2)))


def _centered_energy(v: torch.Tensor, prefix: bool) -> torch.Tensor:
    """``nu_t(v)`` along dim 1 (Eq. 61): prefix version ``[B, T, ...]`` or full-sequence ``[B, ...]``.

    The first element is subtracted first (variance is shift-invariant; it curbs cancellation) and
    negative rounding residuals are clamped to 0 (App. O). A length-1 prefix gives exactly 0.
    """
    v = v - v[:, :1]
    if prefix:
        p = v.cumsum(1)
        return (((v * v).cumsum(1)) - p * p / _counts(v.shape[1], v.dim(), v)).clamp_(min=0)
    p = v.sum(1)
    return ((v * v).sum(1) - p * p / v.shape[1]).clamp_(min=0)


def _prefix_pair_squares(x: torch.Tensor, rx: torch.Tensor, ry: torch.Tensor, causal: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(p1^2, p1 p2, p2^2)`` of the prefix sums ``p_t = sum_{u<=t} x_u (rx_u, ry_u)`` (or the full-sequence
    sum, as a length-1 token axis, without M) for ``x [1, B, T, dc]`` and rotated directions ``[B or 1, T, h]``;
    each result is ``[h, B, T or 1, dc]``."""
    p = []
    for r in (rx, ry):
        y = x * r.permute(2, 0, 1)[..., None]
        p.append(y.cumsum(2) if causal else y.sum(2, keepdim=True))
    return p[0] * p[0], p[0] * p[1], p[1] * p[1]


def _pair_moments(a: torch.Tensor, b: torch.Tensor, mode: str, centered: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """2x2 moments ``sum (a, b)(a, b)^T`` along the token axis of ``[B, T, H, m/2]`` pair coordinates.

    ``mode``: ``prefix`` (``u <= t``, Eq. 42), ``suffix`` (``t >= u``, Eq. 43) or ``total`` (kept as a
    length-1 token axis for broadcasting). ``centered``: unnormalized prefix covariance (Eq. 66) instead of
    the raw second moment (prefix/total only), computed from first-element-shifted values.
    """
    if centered:
        a, b = a - a[:, :1], b - b[:, :1]
    if mode == "prefix":
        acc = lambda v: v.cumsum(1)  # noqa: E731
        n: Any = _counts(a.shape[1], a.dim(), a)
    elif mode == "suffix":
        acc = _suffix_sum
        n = None
    else:
        acc = lambda v: v.sum(1, keepdim=True)  # noqa: E731
        n = a.shape[1]
    v11, v12, v22 = acc(a * a), acc(a * b), acc(b * b)
    if centered:
        p1, p2 = acc(a), acc(b)
        v11 = (v11 - p1 * p1 / n).clamp_(min=0)
        v12 = v12 - p1 * p2 / n
        v22 = (v22 - p2 * p2 / n).clamp_(min=0)
    return v11, v12, v22


class QKChunk:
    """Per-chunk activations shared by all variants of one update (computed lazily, float64)."""

    def __init__(self, stats: QKStats, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.st = stats
        self.x = x
        self.B, self.T, _ = x.shape
        self.rope_in = rope

    @cached_property
    def x2(self) -> torch.Tensor:
        return self.x * self.x

    @cached_property
    def ex(self) -> torch.Tensor:
        """``||X_j:||^2`` per sequence, ``[B, d]``."""
        return self.x2.sum(1)

    def _project(self, w: torch.Tensor, b: torch.Tensor | None, heads: int) -> torch.Tensor:
        """``X W^T (+ b)`` split into heads, ``[B, T, heads, head_dim]``."""
        y = self.x @ w.T
        if b is not None:
            y = y + b
        return y.reshape(self.B, self.T, heads, self.st.head_dim)

    @cached_property
    def q(self) -> torch.Tensor:
        return self._project(self.st.Wq, self.st.bq, self.st.n_heads)

    @cached_property
    def k(self) -> torch.Tensor:
        return self._project(self.st.Wk, self.st.bk, self.st.n_kv_heads)

    def grouped(self, v: torch.Tensor) -> torch.Tensor:
        """Sum a per-query-head quantity ``[B, T, H_Q, ...]`` over each key head's group -> ``[B, T, H_K, ...]``."""
        st = self.st
        return v.reshape(self.B, self.T, st.n_kv_heads, st.group_size, *v.shape[3:]).sum(3)

    @cached_property
    def q2g(self) -> torch.Tensor:
        """``sum_{h in H_g} Q_it^2`` as ``[B, T, H_K, m]``."""
        return self.grouped(self.q * self.q)

    @cached_property
    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        st = self.st
        rope = self.rope_in if self.rope_in is not None else st.rope
        if rope is None:
            raise SecateurError("RoPE-aware QK-Wanda variants need the rotary cos/sin tables (rope=(cos, sin))")
        return normalize_tables(rope, self.B, self.T, st.head_dim, st.dtype, st.device)

    @cached_property
    def kr(self) -> torch.Tensor:
        return apply_rope(self.k, *self.tables)

    @cached_property
    def qr_pairs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Grouped rotated-query pair products ``A_t = sum_h q~_t[P_a] q~_t[P_a]^T`` as 3 x ``[B,T,H_K,m/2]``."""
        qr = apply_rope(self.q, *self.tables)
        h = qr.shape[-1] // 2
        a, b = qr[..., :h], qr[..., h:]
        return self.grouped(a * a), self.grouped(a * b), self.grouped(b * b)


class QKStats(Accumulator):
    """Streaming QK-Wanda statistics for one attention block (float64 by default).

    ``update(x[B, T, d])``: each row of ``x`` is one independent calibration sequence (the q/k input after
    the pre-attention norm). Sequences in different updates may have different lengths. For R variants
    pass the model's rotary tables ``rope=(cos, sin)`` (``[T, m]``, ``[1, T, m]`` or ``[B, T, m]``, HF
    layout) at construction or per update.

    State per variant: ``A_K`` (query-side factor, indexed by key row ``g*m + i``) and ``A_Q`` (key-side
    factor), both ``[H_K*m, d]``, summed over sequences; ``n_seqs`` is the ``N`` of the ``1/N`` average.
    ``chunk_elems`` bounds the transient ``[m/2, B_chunk, T, d_chunk]`` tensors of the centered post-RoPE key
    factor (Eq. 68; the default keeps them in cache), the only factor that is not a plain matmul of
    per-token quantities with ``X^2``.
    Cost per chunk: two ``[B*T, d] x [d, H*m]`` projections plus one ``[H_K*m, B*T] x [B*T, d]`` matmul per
    factor; the RC/MRC key factor adds about 7 ``O(B T d m/2)`` elementwise passes and ``O(B T d H_K m)`` flops.
    """

    name = "qk"
    STATE = ("A_K", "A_Q", "n_seqs", "n_tokens")

    def __init__(self, Wq: torch.Tensor, Wk: torch.Tensor, bq: torch.Tensor | None, bk: torch.Tensor | None,
                 geometry: Any, variants: str | QKVariant | Iterable[str | QKVariant] = "base",
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None, *, dtype: torch.dtype = torch.float64,
                 device: torch.device | str | None = None, chunk_elems: int = 2 ** 16) -> None:
        self.n_heads, self.n_kv_heads, self.head_dim = check_qk_geometry(geometry)
        self.group_size = self.n_heads // self.n_kv_heads
        self.variants = _parse_variants(variants)
        if Wq.dim() != 2 or Wk.dim() != 2 or Wq.shape[1] != Wk.shape[1]:
            raise SecateurError(f"W_q {tuple(Wq.shape)} and W_k {tuple(Wk.shape)} must be [out, d] with one d")
        m = self.head_dim
        if Wq.shape[0] != self.n_heads * m or Wk.shape[0] != self.n_kv_heads * m:
            raise SecateurError(f"W_q {tuple(Wq.shape)} / W_k {tuple(Wk.shape)} do not match {self.n_heads} "
                                f"query heads, {self.n_kv_heads} key heads of width {m}")
        for name, b, w in (("b_q", bq, Wq), ("b_k", bk, Wk)):
            if b is not None and tuple(b.shape) != (w.shape[0],):
                raise SecateurError(f"{name} has shape {tuple(b.shape)}; expected ({w.shape[0]},)")
        if any(v.rope for v in self.variants):
            if m % 2:
                raise SecateurError(f"RoPE-aware variants need an even head_dim, got {m}")
            if getattr(geometry, "rope", True) is False:
                raise SecateurError("RoPE-aware QK-Wanda variants need a rotary model; this one has none")
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else Wq.device
        conv = dict(dtype=dtype, device=self.device)
        self.Wq = Wq.detach().to(**conv)
        self.Wk = Wk.detach().to(**conv)
        self.bq = bq.detach().to(**conv) if bq is not None else None
        self.bk = bk.detach().to(**conv) if bk is not None else None
        self.rope = rope
        self.chunk_elems = int(chunk_elems)
        self.d = Wq.shape[1]
        dk = self.n_kv_heads * m
        self.A_K = {v: torch.zeros(dk, self.d, **conv) for v in self.variants}
        self.A_Q = {v: torch.zeros(dk, self.d, **conv) for v in self.variants}
        self.n_seqs = 0
        self.n_tokens = 0

    # --- accumulation ---------------------------------------------------------------------------
    def update(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        if x.dim() == 2:
            x = x[None]
        if x.dim() != 3 or x.shape[-1] != self.d:
            raise SecateurError(f"QK statistics expect inputs [B, T, {self.d}], got {tuple(x.shape)}")
        if x.shape[0] == 0 or x.shape[1] == 0:
            return
        check_finite(x, "the QK-Wanda statistics")
        c = QKChunk(self, x.detach().to(dtype=self.dtype, device=self.device), rope)
        for v in self.variants:
            self.A_K[v] += self._query_factor(c, v)
            self.A_Q[v] += self._key_factor(c, v)
        self.n_seqs += c.B
        self.n_tokens += c.B * c.T

    def _query_factor(self, c: QKChunk, v: QKVariant) -> torch.Tensor:
        """``sum_s sum_t X_jt^2 f_{g,i}(t)``: ``f`` = key energy seen by a query at ``t`` (Eqs. 31/14/37/62/67)."""
        if not v.rope:
            if not v.causal:  # f independent of t: ||K_i:||^2 (base) or nu_T(K_i:) (C)
                e = _centered_energy(c.k, prefix=False) if v.centered else (c.k * c.k).sum(1)
                return _outer(e.reshape(c.B, -1), c.ex)
            f = _centered_energy(c.k, prefix=True) if v.centered else (c.k * c.k).cumsum(1)  # Eq. 23 / 62
            return _contract(f, c.x2)
        h = self.head_dim // 2
        kr = c.kr
        mom = _pair_moments(kr[..., :h], kr[..., h:], "prefix" if v.causal else "total", v.centered)
        f = rotated_diag(*mom, *c.tables)  # [R_t^T V_K(t) R_t]_bb, Eq. 44 / 67
        if v.centered:
            f = f.clamp_(min=0)
        return _contract(f, c.x2)

    def _key_factor(self, c: QKChunk, v: QKVariant) -> torch.Tensor:
        """``sum_s sum_u ...``: grouped query energy seen by a key at ``u`` (Eqs. 32/15/38/63/68)."""
        if not v.rope:
            if not v.centered:
                if not v.causal:
                    return _outer(c.q2g.sum(1).reshape(c.B, -1), c.ex)
                return _contract(_suffix_sum(c.q2g), c.x2)  # U_Q X_2^T, Eqs. 24/26
            # Eq. 63: sum_t [sum_h Q_it^2] nu_t(X_j:), prefixes -> full sequences without M
            if not v.causal:
                return _outer(c.q2g.sum(1).reshape(c.B, -1), _centered_energy(c.x, prefix=False))
            return _contract(c.q2g, _centered_energy(c.x, prefix=True))
        if not v.centered:
            return self._key_factor_rope(c, v.causal)
        return self._key_factor_rope_centered(c, v.causal)

    @staticmethod
    def _key_factor_rope(c: QKChunk, causal: bool) -> torch.Tensor:
        """Eq. 45: ``sum_u X_ju^2 [R_u^T V_Q(u) R_u]_bb`` with ``V_Q(u)`` the suffix (M) or total sum of ``A_t``."""
        a11, a12, a22 = c.qr_pairs
        acc = _suffix_sum if causal else (lambda t: t.sum(1, keepdim=True))
        return _contract(rotated_diag(acc(a11), acc(a12), acc(a22), *c.tables), c.x2)

    def _key_factor_rope_centered(self, c: QKChunk, causal: bool) -> torch.Tensor:
        """Eq. 68: ``sum_t <A_t, V_t(y)>`` with ``A_t = sum_h q~_t q~_t^T`` (pair block) and ``V_t(y)`` the
        prefix covariance of ``y_u = X_ju R_u e_b`` (full-sequence covariance and ``sum_t A_t`` without M).

        Factored as ``V_t = sum_{u<=t} y_u y_u^T - p_t p_t^T / t`` with ``p_t = sum_{u<=t} y_u``:

        * the first part is ``sum_u X_ju^2 r_u^T (sum_{t>=u} A_t) r_u``: the uncentered key factor (Eq. 45),
          one matmul with ``X^2``;
        * the second is ``sum_t p_t^T (A_t / t) p_t``: the prefix sums ``p_t`` of ``X_ju r_u`` (one cumsum per
          component) contracted with ``A_t / t`` over sequences and tokens, one batched matmul per moment.

        ``V_t`` is never formed, so the only ``O(B T d m)`` work is 2 products, 2 cumsums and 3 squares per
        chunk (HF tables, whose two halves agree, so column 1 is column 0 turned by 90 degrees: ``r1 = J r0``;
        other tables take both columns separately). Each ``<A_t, V_t>`` is >= 0; the sum is clamped at 0
        against rounding (App. O). The transient ``[m/2, B_chunk, T, d_chunk]`` tensors are bounded by
        ``chunk_elems``.
        """
        B, T, d = c.x.shape
        hk, h = self.n_kv_heads, self.head_dim // 2
        a11, a12, a22 = c.qr_pairs  # [B, T, Hk, h]
        first = self._key_factor_rope(c, causal)  # [Hk*m, d]
        cos, sin = c.tables
        cols = pair_columns(cos, sin)  # ((r0x, r0y), (r1x, r1y)), each [B or 1, T, h]
        turned = bool(torch.equal(cos[..., :h], cos[..., h:]) and torch.equal(sin[..., :h], sin[..., h:]))
        if causal:  # A_t / t as [h, Hk, B, T]
            n = torch.arange(1, T + 1, dtype=self.dtype, device=self.device)
            A = [(t / n[None, :, None, None]).permute(3, 2, 0, 1) for t in (a11, a12, a22)]
        else:  # sum_t A_t / T as [h, Hk, B, 1]; p_T is a plain per-sequence sum
            A = [(t.sum(1) / T).permute(2, 1, 0)[..., None] for t in (a11, a12, a22)]
        # weights of (P1^2, P1 P2, P2^2) for column 0 and, when turned, column 1 (J^T A J = [[a22, -a12], [-a12, a11]])
        w0 = (A[0], 2 * A[1], A[2])
        w1 = (A[2], -2 * A[1], A[0])
        second = torch.zeros(h, 2, hk, d, dtype=self.dtype, device=self.device)
        tt = T if causal else 1
        dc = max(1, min(d, self.chunk_elems // max(1, T * h)))
        bc = max(1, self.chunk_elems // max(1, T * dc * h))
        for s0 in range(0, B, bc):
            s1 = min(B, s0 + bc)
            nb = s1 - s0
            wt = [[w[:, :, s0:s1].reshape(h, hk, nb * tt) for w in ws] for ws in (w0, w1)]
            # turned: both columns from column 0's moments, one matmul per moment ([h, 2 Hk, Bc T]); otherwise
            # each column's own moments with the same weights
            wt = [[torch.cat((u, v), 1) for u, v in zip(*wt)]] if turned else [wt[0], wt[0]]
            for j0 in range(0, d, dc):
                j1 = min(d, j0 + dc)
                xj = c.x[None, s0:s1, :, j0:j1]  # [1, Bc, T, dc]

                for b, ws in enumerate(wt):
                    rx, ry = (r if r.shape[0] == 1 else r[s0:s1] for r in cols[b])
                    mom = _prefix_pair_squares(xj, rx, ry, causal)
                    res = sum(torch.bmm(w, v.reshape(h, nb * tt, j1 - j0)) for w, v in zip(ws, mom))
                    if turned:  # [h, 2 Hk, dc]
                        second[:, :, :, j0:j1] += res.reshape(h, 2, hk, j1 - j0)
                    else:
                        second[:, b, :, j0:j1] += res
        second = second.permute(2, 1, 0, 3).reshape(hk * 2 * h, d)  # raw coordinate order g*m + b*h + a
        return (first - second).clamp_(min=0)

    def fresh(self) -> QKStats:
        """Empty statistics for the same weights, variants and tables (they are shared, not copied)."""
        acc = copy.copy(self)
        acc.A_K = {v: torch.zeros_like(t) for v, t in self.A_K.items()}
        acc.A_Q = {v: torch.zeros_like(t) for v, t in self.A_Q.items()}
        acc.n_seqs = acc.n_tokens = 0
        return acc

    def merge(self, other: Accumulator) -> None:
        if not isinstance(other, QKStats) or other.variants != self.variants:
            raise SecateurError("can only merge QKStats collected for the same variants")
        if not (torch.equal(other.Wq.to(self.device), self.Wq) and torch.equal(other.Wk.to(self.device), self.Wk)
                and same_bias(other.bq, self.bq) and same_bias(other.bk, self.bk)):
            raise SecateurError("can only merge QKStats collected with the same q/k weights and biases")
        for v in self.variants:
            self.A_K[v] += other.A_K[v].to(self.device)
            self.A_Q[v] += other.A_Q[v].to(self.device)
        self.n_seqs += other.n_seqs
        self.n_tokens += other.n_tokens

    # --- results ----------------------------------------------------------------------------------
    def _variant(self, variant: str | QKVariant | None) -> QKVariant:
        if variant is None:
            if len(self.variants) != 1:
                raise SecateurError(f"these statistics hold {len(self.variants)} variants; name one")
            return self.variants[0]
        v = QKVariant.parse(variant)
        if v not in self.variants:
            raise SecateurError(f"variant {v.code} was not collected (have {[u.code for u in self.variants]})")
        return v

    def factors(self, variant: str | QKVariant | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Interaction factors ``(G_Q [H_Q*m, d], G_K [H_K*m, d])`` with ``S = W^2 * G`` (sequence means).

        ``G_Q`` repeats each key head's block for every query head of its group (the query-side factor
        depends on the head only through its key head).
        """
        v = self._variant(variant)
        if self.n_seqs == 0:
            raise SecateurError("no calibration sequences reached the QK statistics")
        m, d = self.head_dim, self.d
        gk = self.A_K[v] / self.n_seqs
        gq = gk.reshape(self.n_kv_heads, 1, m, d).expand(-1, self.group_size, -1, -1).reshape(-1, d)
        return gq, self.A_Q[v] / self.n_seqs

    def scores(self, variant: str | QKVariant | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(S_Q, S_K)`` for the weights the statistics were collected with."""
        gq, gk = self.factors(variant)
        return self.Wq * self.Wq * gq, self.Wk * self.Wk * gk


class ProjectedQKStats(QKStats):
    """:class:`QKStats` fed with q/k projection outputs: taken from the model's own forward
    (:meth:`update_projected`) or recomputed in the model's dtype from ``proj = (W_q, b_q, W_k, b_k)``
    (:meth:`update`), as the model itself computes them.

    Base variant fast path (Alg. 1 steps 2-3, spec §5-6): per-sequence energies ``e_X``, ``e_K`` and grouped
    ``e~_Q`` in float32 (or the inputs' wider dtype), summed as ``A_K += e_K e_X^T``, ``A_Q += e~_Q e_X^T``
    in float64 -- the same factors as :class:`QKStats` (Eqs. 31-32) without its float64 token-level copies.
    Other variants go through :class:`QKStats`'s own per-chunk code with the given projections.
    """

    def __init__(self, *args, proj: tuple | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._proj = proj
        self._base_only = self.variants == (QKVariant(),)

    def update(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        if self._proj is None or rope is not None:
            return super().update(x, rope)
        Wq, bq, Wk, bk = self._proj
        with torch.no_grad():
            self.update_projected(x, F.linear(x, Wq, bq), F.linear(x, Wk, bk))

    def update_projected(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Same as ``update(x)`` with ``Q = W_q x + b_q``, ``K = W_k x + b_k`` given (``[B, T, D_Q]``,
        ``[B, T, D_K]``, pre-RoPE). The engine has already checked ``x`` for non-finite values."""
        B, T = x.shape[0], x.shape[1]
        if B == 0 or T == 0:
            return
        if self._base_only:
            ct = torch.promote_types(x.dtype, torch.float32)

            def energy(t: torch.Tensor) -> torch.Tensor:  # per-sequence squared row norms over tokens, [B, D]
                return t.detach().to(ct).square().sum(1)

            conv = dict(device=self.device, dtype=self.dtype)
            ex = energy(x).to(**conv)  # ||X_j:||^2, [B, d]
            ek = energy(k).to(**conv)  # ||K_i:||^2, [B, D_K]
            eq = (energy(q).reshape(B, self.n_kv_heads, self.group_size, self.head_dim).sum(2)
                  .reshape(B, -1).to(**conv))  # sum_{h in H_g} ||Q_i:||^2, [B, D_K]
            v = self.variants[0]
            self.A_K[v] += ek.T @ ex
            self.A_Q[v] += eq.T @ ex
        else:
            conv = dict(dtype=self.dtype, device=self.device)
            c = QKChunk(self, x.detach().to(**conv), None)
            c.__dict__["q"] = q.detach().to(**conv).reshape(B, T, self.n_heads, self.head_dim)
            c.__dict__["k"] = k.detach().to(**conv).reshape(B, T, self.n_kv_heads, self.head_dim)
            for v in self.variants:
                self.A_K[v] += self._query_factor(c, v)
                self.A_Q[v] += self._key_factor(c, v)
        self.n_seqs += B
        self.n_tokens += B * T


def same_bias(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        other = b if a is None else a
        return other is None or not bool(other.any())
    return torch.equal(a.to(b.device, b.dtype), b)


def check_qk_geometry(geometry: Any) -> tuple[int, int, int]:
    try:
        hq, hk, m = int(geometry.n_heads), int(geometry.n_kv_heads), int(geometry.head_dim)
    except AttributeError:
        raise SecateurError("geometry must provide n_heads, n_kv_heads and head_dim") from None
    if hq <= 0 or hk <= 0 or m <= 0 or hq % hk:
        raise SecateurError(f"need n_heads ({hq}) to be a positive multiple of n_kv_heads ({hk})")
    if getattr(geometry, "qk_norm", False):
        raise SecateurError("QK-Wanda scores assume affine q/k projections; models with q/k norms (Qwen3) "
                            "are not supported")
    group_of = getattr(geometry, "kv_group_of_head", None)
    if callable(group_of) and any(group_of(h) != h // (hq // hk) for h in range(hq)):
        raise SecateurError("QK-Wanda supports only the contiguous (Hugging Face) query-head grouping")
    return hq, hk, m


class QKOutputGrams(Accumulator):
    """CORP Q/K statistics: per-sequence Grams (:class:`PerSampleGram`) of the q and k projection outputs,
    computed in float32 from the shared input ``X`` with the projections' current weights and biases."""

    name = "corp_qk"

    def __init__(self, q: LinearRef, k: LinearRef, n_heads: int, n_kv: int, d_h: int) -> None:
        self.q, self.k = q, k
        self.qa, self.ka = PerSampleGram(d_h, n_heads), PerSampleGram(d_h, n_kv)

    def update(self, x: torch.Tensor) -> None:
        x = x if x.dim() == 3 else x[None]
        for ref, acc in ((self.q, self.qa), (self.k, self.ka)):
            b = None if ref.bias is None else ref.bias.detach().float()
            acc.update(F.linear(x.float(), ref.weight.detach().float(), b))

    def fresh(self) -> QKOutputGrams:
        acc = copy.copy(self)
        acc.qa, acc.ka = self.qa.fresh(), self.ka.fresh()
        return acc

    def state(self) -> dict:
        return {"qa": self.qa.state(), "ka": self.ka.state()}

    def with_state(self, state: dict) -> QKOutputGrams:
        acc = copy.copy(self)
        acc.qa, acc.ka = self.qa.with_state(state["qa"]), self.ka.with_state(state["ka"])
        return acc

    def merge(self, other: QKOutputGrams) -> None:
        self.qa.merge(other.qa)
        self.ka.merge(other.ka)
