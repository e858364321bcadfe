"""The co-pruning graph: ``H`` (nodes ``H_uu``, signed edges ``H_uv``), unit costs and layers.

Surrogate (cocurve.md §2/§4, the paper's "R_lambda(s) = 1/2 sum_u H_uu s_u + lambda sum_{u<v} H_uv s_u s_v"):

    H_lambda = diag(H) + lambda (H - diag(H))          (PSD for lambda in [0, 1])
    R_lambda(S) = 1/2 sum_{u in S} H_uu + lambda sum_{u<v in S} H_uv

Saved as one ``.npz`` (``H``, ``costs``, ``layer_of``, ``is_attn``, ``ablated``, ``kl_single``, the split halves
``H_half0`` / ``H_half1`` when the sweep had them, and a JSON ``meta``); :func:`array_sha256` hashes ``H``'s bytes
(content hash, stable across re-saves), the file hash covers the container.

Split-half diagnostic (issue 45; the paper's Appendix E.4 "split-half stability"): the sweep also builds ``H`` from
each half of the graph windows (``H^(0)``: even-numbered windows, ``H^(1)``: odd-numbered, each divided by its own
number of positions), and :func:`split_half_agreement` measures how far the graph is a property of the model rather
than of the windows, over the measured (ablated) units with ``H_uu > 0`` in both halves:

    diagonal   Spearman rank correlation of ``H^(0)_uu`` and ``H^(1)_uu``
    edges      Pearson correlation over pairs u < v of the normalized edges ``H_uv / sqrt(H_uu H_vv)`` (the cosine
               of the two units' Fisher features), ``H^(0)`` against ``H^(1)``
    reliability of the full graph's edges by Spearman-Brown, ``2 r / (1 + r)`` (r: the edge correlation)

and, at a chosen removal set ``S`` (:func:`mask_edge_agreement`): the Pearson correlation of the per-unit edge sums
``e_u = sum_{v in S, v != u} H_uv`` (u in S) between the halves, and each half's (and the full graph's) edge ratio
``sum_{u<v in S} H_uv / (1/2 sum_{u in S} H_uu)`` (the edge term against the diagonal term of R_1(S)). The edge term
is flagged as not to be trusted when the edge correlation is below ``EDGE_AGREEMENT_MIN = 0.5`` (split-half
reliability below 0.67): then the halves disagree on most of what the edges would change.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from secateur.errors import SecateurError
from secateur.linalg import one_thread
from secateur.structured.units import ATTN_KINDS, Inventory


def array_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's values as contiguous little-endian bytes of its dtype."""
    a = np.ascontiguousarray(t.detach().cpu().numpy())
    return hashlib.sha256(a.astype(a.dtype.newbyteorder("<")).tobytes()).hexdigest()


def bytes_sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@dataclass
class CoPruningGraph:
    H: torch.Tensor  # [M, M] float64, symmetric PSD
    costs: torch.Tensor  # [M] int64 removable parameters
    layer_of: torch.Tensor  # [M] int64
    is_attn: torch.Tensor  # [M] bool
    n_layers: int
    ablated: torch.Tensor | None = None  # [M] bool, units whose row of H was measured
    kl_single: torch.Tensor | None = None  # [M] mean KL(p_0 || p_{-u}) at the sampled positions
    meta: dict = field(default_factory=dict)
    halves: tuple[torch.Tensor, torch.Tensor] | None = None  # H of the even / odd graph windows (split-half)

    @classmethod
    def from_inventory(cls, inv: Inventory, H: torch.Tensor, **kw) -> CoPruningGraph:
        is_attn = torch.cat([torch.full((p.n,), p.kind in ATTN_KINDS, dtype=torch.bool) for p in inv.pools])
        return cls(H=H, costs=inv.costs.clone(), layer_of=inv.layer_of.clone(), is_attn=is_attn,
                   n_layers=inv.n_layers, **kw)

    def __len__(self) -> int:
        return self.H.shape[0]

    @property
    def diag(self) -> torch.Tensor:
        return self.H.diagonal().clone()

    def layer_costs(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for li, c in zip(self.layer_of.tolist(), self.costs.tolist()):
            out[li] = out.get(li, 0) + c
        return out

    def h_lambda(self, lam: float) -> torch.Tensor:
        """``diag(H) + lam (H - diag(H))``."""
        d = torch.diag(self.H.diagonal())
        return d + lam * (self.H - d)

    def surrogate(self, removed: torch.Tensor, lam: float) -> float:
        """``R_lambda(S) = 1/2 sum_{u in S} H_uu + lam sum_{u<v in S} H_uv`` (= 1/2 s^T H_lambda s)."""
        s = removed.to(torch.float64)
        d = self.H.diagonal()
        quad = float(s @ self.H @ s)
        node = float((d * s).sum())
        return 0.5 * node + lam * 0.5 * (quad - node)

    def check_psd(self, rel_tol: float = 1e-8) -> float:
        """Raise unless ``H`` is symmetric with ``lambda_min >= -rel_tol * trace``; returns ``lambda_min``."""
        if not torch.equal(self.H, self.H.T):
            raise SecateurError("H is not symmetric")
        if not bool(torch.isfinite(self.H).all()):
            raise SecateurError("H has non-finite entries")
        with one_thread():
            lmin = float(torch.linalg.eigvalsh(self.H).min()) if len(self) else 0.0
        tr = float(self.H.diagonal().sum())
        if lmin < -rel_tol * max(tr, 0.0):
            raise SecateurError(f"H is not PSD: min eigenvalue {lmin:.3e} < -{rel_tol:g} * trace ({tr:.3e})")
        return lmin

    # --- persistence ---------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        arrays = {"H": self.H.numpy(), "costs": self.costs.numpy(), "layer_of": self.layer_of.numpy(),
                  "is_attn": self.is_attn.numpy(), "n_layers": np.array(self.n_layers),
                  "meta": np.array(json.dumps(self.meta, default=str))}
        if self.ablated is not None:
            arrays["ablated"] = self.ablated.numpy()
        if self.kl_single is not None:
            arrays["kl_single"] = self.kl_single.numpy()
        if self.halves is not None:
            arrays["H_half0"], arrays["H_half1"] = (h.numpy() for h in self.halves)
        np.savez(buf, **arrays)
        return buf.getvalue()

    def save(self, path: str | Path) -> dict:
        """Write the ``.npz``; returns ``{"path", "file_sha256", "H_sha256"}``."""
        data = self.to_bytes()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)
        return {"path": str(path), "file_sha256": bytes_sha256(data), "H_sha256": array_sha256(self.H)}

    @classmethod
    def load(cls, path: str | Path) -> CoPruningGraph:
        z = np.load(path, allow_pickle=False)

        def get(k: str) -> torch.Tensor | None:
            return torch.from_numpy(z[k].copy()) if k in z.files else None

        halves = (get("H_half0"), get("H_half1")) if "H_half0" in z.files else None
        return cls(H=get("H"), costs=get("costs"), layer_of=get("layer_of"), is_attn=get("is_attn"),
                   n_layers=int(z["n_layers"]), ablated=get("ablated"), kl_single=get("kl_single"),
                   meta=json.loads(str(z["meta"])), halves=halves)


# --- split-half diagnostic -------------------------------------------------------------------------------

EDGE_AGREEMENT_MIN = 0.5  # split-half Pearson of the normalized edges below which the edge term is not trusted


def _pearson(x: np.ndarray, y: np.ndarray) -> float | None:
    """Pearson correlation (None when either side is constant or has fewer than 2 values)."""
    if x.size < 2:
        return None
    x, y = x - x.mean(), y - y.mean()
    den = float(np.sqrt((x * x).sum() * (y * y).sum()))
    return float((x * y).sum()) / den if den > 0 else None


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties given their average rank."""
    order = np.argsort(x, kind="stable")
    r = np.empty(x.size)
    r[order] = np.arange(1, x.size + 1)
    vals, inv = np.unique(x, return_inverse=True)
    if vals.size < x.size:
        r = (np.bincount(inv, weights=r) / np.bincount(inv))[inv]
    return r


def spearman(x: np.ndarray, y: np.ndarray) -> float | None:
    """Spearman rank correlation: the Pearson correlation of the (average-tie) ranks."""
    return _pearson(_ranks(np.asarray(x, dtype=np.float64)), _ranks(np.asarray(y, dtype=np.float64)))


def split_half_agreement(h0: torch.Tensor, h1: torch.Tensor, units: torch.Tensor | None = None) -> dict:
    """Agreement of two graphs of the same units (module docstring); ``units``: bool mask of the units to compare
    (default all; units with ``H_uu <= 0`` in either half are left out)."""
    a, b = h0.to(torch.float64).numpy(), h1.to(torch.float64).numpy()
    da, db = a.diagonal(), b.diagonal()
    keep = (da > 0) & (db > 0)
    if units is not None:
        keep &= units.numpy().astype(bool)
    idx = np.flatnonzero(keep)
    sa, sb = np.sqrt(da[idx]), np.sqrt(db[idx])
    na = a[np.ix_(idx, idx)] / np.outer(sa, sa)
    nb = b[np.ix_(idx, idx)] / np.outer(sb, sb)
    iu = np.triu_indices(idx.size, 1)
    r_edges = _pearson(na[iu], nb[iu])
    reliability = 2 * r_edges / (1 + r_edges) if r_edges is not None and r_edges > -1 else None  # Spearman-Brown
    return {"units": int(idx.size), "diag_spearman": spearman(da[idx], db[idx]), "edge_pearson": r_edges,
            "edge_reliability": reliability, "threshold": EDGE_AGREEMENT_MIN,
            "edges_trusted": r_edges is not None and r_edges >= EDGE_AGREEMENT_MIN}


def edge_ratio(H: torch.Tensor, removed: torch.Tensor) -> float | None:
    """``sum_{u<v in S} H_uv / (1/2 sum_{u in S} H_uu)``: R_1(S)'s edge term over its diagonal term."""
    s = removed.to(torch.bool)
    sub = H[s][:, s].to(torch.float64)
    tr = float(sub.diagonal().sum())
    return 0.5 * (float(sub.sum()) - tr) / (0.5 * tr) if tr > 0 else None


def mask_edge_agreement(h0: torch.Tensor, h1: torch.Tensor, H: torch.Tensor, removed: torch.Tensor) -> dict:
    """At the removal set ``removed``: split-half Pearson of the per-unit edge sums and the edge ratios."""
    s = removed.to(torch.bool)

    def sums(h: torch.Tensor) -> np.ndarray:
        sub = h[s][:, s].to(torch.float64)
        return (sub.sum(1) - sub.diagonal()).numpy()

    return {"units": int(s.sum()), "edge_sum_pearson": _pearson(sums(h0), sums(h1)),
            "edge_ratio": {"half0": edge_ratio(h0, s), "half1": edge_ratio(h1, s), "full": edge_ratio(H, s)}}
