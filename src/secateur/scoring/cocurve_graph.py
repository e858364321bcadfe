"""The co-pruning graph: ``H`` (nodes ``H_uu``, signed edges ``H_uv``), unit costs and layers.

Surrogate (cocurve.md §2/§4, the paper's "R_lambda(s) = 1/2 sum_u H_uu s_u + lambda sum_{u<v} H_uv s_u s_v"):

    H_lambda = diag(H) + lambda (H - diag(H))          (PSD for lambda in [0, 1])
    R_lambda(S) = 1/2 sum_{u in S} H_uu + lambda sum_{u<v in S} H_uv

Saved as one ``.npz`` (``H``, ``costs``, ``layer_of``, ``is_attn``, ``ablated``, ``kl_single`` and a JSON
``meta``); :func:`array_sha256` hashes ``H``'s bytes (content hash, stable across re-saves), the file
hash covers the container.
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

        return cls(H=get("H"), costs=get("costs"), layer_of=get("layer_of"), is_attn=get("is_attn"),
                   n_layers=int(z["n_layers"]), ablated=get("ablated"), kl_single=get("kl_single"),
                   meta=json.loads(str(z["meta"])))
