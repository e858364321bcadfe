"""COEC's anchored alignment penalty on o_proj (COEC Sec. 4.5): the value projection expanded to the query-head
layout, the alignment term A(Q_r) and its gradient, built from the dense weight's top-r_p right singular
directions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from secateur.errors import SecateurError
from secateur.linalg import (
    det_sum,
    orth,
    safe_svd,
)


def expand_value_to_query_heads(w_v: torch.Tensor, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """Expand a value projection ``[n_kv_heads * m, d]`` to the query-head layout ``[n_heads * m, d]``
    that ``o_proj`` reads (Hugging Face ``repeat_kv``: query head h uses KV head ``h // (n_heads //
    n_kv_heads)``). Row ``h*m + t`` of the result is row ``(h // g)*m + t`` of ``w_v``. Works for any
    trailing shape (a bias ``[n_kv_heads * m]`` too). MHA (``n_heads == n_kv_heads``) returns a copy."""
    if n_kv_heads <= 0 or n_heads % n_kv_heads:
        raise SecateurError(f"n_heads={n_heads} must be a positive multiple of n_kv_heads={n_kv_heads}")
    if w_v.shape[0] % n_kv_heads:
        raise SecateurError(f"value projection has {w_v.shape[0]} rows, not a multiple of {n_kv_heads} heads")
    m = w_v.shape[0] // n_kv_heads
    g = n_heads // n_kv_heads
    idx = ((torch.arange(n_heads) // g)[:, None] * m + torch.arange(m)[None, :]).flatten()
    return w_v[idx.to(w_v.device)]


@dataclass(frozen=True)
class ValueProjection:
    """The dense (unpruned) value projection feeding an ``o_proj``: weight ``[n_kv_heads * m, d_model]``
    (HF ``[out, in]``) and the head counts. Pass it to :func:`coec` for ``o_proj`` to enable the
    anchored alignment penalty; leave it out for ``down_proj`` (lambda_a = 0 on the MLP, COEC Sec. 4.5)."""

    weight: torch.Tensor
    n_heads: int
    n_kv_heads: int

    def in_o_space(self, kept: torch.Tensor) -> torch.Tensor:
        """Effective value map read by the kept o_proj columns: ``expand(W_v)[K]`` (``k x d_model``),
        i.e. ``E W_v,pruned`` of coec.md [A3] for kept whole KV groups."""
        return expand_value_to_query_heads(self.weight, self.n_heads, self.n_kv_heads)[kept.to(self.weight.device)]


@dataclass
class Alignment:
    """Precomputed pieces of ``A(R) = ||U_v^T (R_1^T R_1 - Pi_anchor) U_v||_F^2 / r_p^2`` (COEC Sec. 4.5).

    u_v: ``k x r`` leading left singular vectors of the value map in o_proj input space.
    n_anchor: ``U_v^T Pi_anchor U_v`` (``r x r``).
    r_norm: the ``r_p`` in the normalization (effective rank used, ``<= r_p``).
    """

    u_v: torch.Tensor
    n_anchor: torch.Tensor
    r_norm: int

    @property
    def r(self) -> int:
        return self.u_v.shape[1]

    def value(self, r1: torch.Tensor) -> float:
        m = r1 @ self.u_v
        d = m.mT @ m - self.n_anchor
        return float(det_sum(d * d)) / self.r_norm**2

    def grad(self, r1: torch.Tensor) -> torch.Tensor:
        """``dA/dR_1 = (4 / r_p^2) R_1 U_v D U_v^T``, ``D = U_v^T (R_1^T R_1 - Pi_anchor) U_v``."""
        m = r1 @ self.u_v
        d = m.mT @ m - self.n_anchor
        return (4.0 / self.r_norm**2) * (m @ d) @ self.u_v.mT

    def of_weight(self, w: torch.Tensor) -> float:
        """A evaluated at the leading right singular frame of a weight (coec.md Sec. 5 line 10)."""
        _, s, vh = safe_svd(w)
        b = int((s > 1e-12 * s[0]).sum()) if s.numel() and s[0] > 0 else 0
        return self.value(vh[: min(self.r, b)])


def build_alignment(w0: torch.Tensor, kept: torch.Tensor, value: ValueProjection, r_p: int = 16,
                    dtype: torch.dtype = torch.float64) -> Alignment:
    """Anchor and value frame of COEC Sec. 4.5.

    ``V_anchor = orth(V_full,r_p[K, :])`` with ``V_full,r_p`` the top-r_p right singular vectors of the
    unpruned ``W0`` (= o_proj); ``U_v`` = top-r_p left singular vectors of the value map expanded to the
    query-head layout and restricted to K (GQA, coec.md [A3]). ``r = min(r_p, k)``.
    """
    w = w0.to(dtype)
    k = kept.numel()
    r = min(r_p, k)
    _, _, vh = safe_svd(w)
    v_anchor = orth(vh[:r].mT[kept])  # k x r_a (r_a <= r)
    wv = value.in_o_space(kept).to(w.device, dtype)
    if wv.shape[0] != k:
        raise SecateurError("value projection rows do not match the o_proj input width")
    u, _, _ = safe_svd(wv)
    u_v = u[:, :r]
    c = v_anchor.mT @ u_v
    return Alignment(u_v=u_v, n_anchor=c.mT @ c, r_norm=r)
