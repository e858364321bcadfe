"""A uniform [out, in] view of a projection, whatever its storage layout.

Hugging Face stores ``nn.Linear`` weights as ``[out, in]`` and GPT-2's ``Conv1D`` as ``[in, out]``; fused
projections (GPT-2 ``c_attn``) hold q, k and v as row blocks of one matrix. Scorers and compensators
only ever see ``[out, in]`` matrices through :class:`LinearRef`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LinearRef:
    """One logical projection of a block.

    name: qualified name inside the block (``self_attn.q_proj``); role: one of q, k, v, qkv, o, gate, up,
    down; rows: for a logical slice of a fused projection, the output rows it owns.
    """

    name: str
    role: str
    module: nn.Module
    conv1d: bool = False
    rows: slice | None = None

    @property
    def weight(self) -> torch.Tensor:
        """The weight as ``[out, in]`` (a view: in-place edits reach the module)."""
        w = self.module.weight
        w = w.T if self.conv1d else w
        return w[self.rows] if self.rows is not None else w

    def set_weight(self, w_oi: torch.Tensor) -> None:
        with torch.no_grad():
            self.weight.copy_(w_oi.to(self.module.weight.dtype))

    @property
    def bias(self) -> torch.Tensor | None:
        b = getattr(self.module, "bias", None)
        if b is None:
            return None
        return b[self.rows] if self.rows is not None else b

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]
