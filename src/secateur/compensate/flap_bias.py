"""FLAP additive bias compensation (An et al. 2023; baselines.md Sec. 4; COEC "FLAP / bias" rows).

    W~ = W0[:, K],   b_new = b + W0[:, P] mu_P      (P = pruned columns, mu = E[x])

The pruned inputs are replaced by their calibration mean, so the mean of the compensated output on the
calibration data equals the dense one exactly (baselines.md B3). Bias-free layers get a new bias.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from secateur.calib.stats import Gram
from secateur.compensate.base import Compensation, InputStats, finish, prepare, pruned_index
from secateur.errors import SecateurError

__all__ = ["flap_bias"]


def flap_bias(w0: torch.Tensor, stats: InputStats | Gram, kept: torch.Tensor | Sequence[int], *,
              bias: torch.Tensor | None = None) -> Compensation:
    """``b_new = b + W0[:, P] mu_P``; weight = kept-column slice (baselines.md Sec. 4)."""
    st, k = prepare(w0, stats, kept, bias)
    if st.mean is None:
        raise SecateurError("FLAP bias compensation needs the input mean (E[x]) in the statistics")
    p = pruned_index(k, w0.shape[1])
    w = w0.to(torch.float64)
    base = torch.zeros(w.shape[0], dtype=torch.float64, device=w.device) if bias is None else bias.to(w)
    b_new = base + w[:, p] @ st.mean.to(w)[p]
    return finish(w0, st, k, w[:, k], b_new, bias, {"method": "flap_bias", "n_pruned": int(p.numel())})
