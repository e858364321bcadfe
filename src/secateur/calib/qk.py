"""Accumulators over the q/k input of an attention block that need the block's q/k projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from secateur.calib.stats import Accumulator, PerSampleGram
from secateur.models.linear import LinearRef


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

    def merge(self, other: QKOutputGrams) -> None:
        self.qa.merge(other.qa)
        self.ka.merge(other.ka)
