"""What every method runner returns (a leaf: the registry and every composition module import it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class MethodResult:
    """``masks`` (unstructured: full module name -> bool mask of the removed weights; empty for sliced models),
    engine ``timings``, report ``details`` and ``extra_files`` (name -> bytes) for the output folder."""

    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    extra_files: dict[str, bytes] = field(default_factory=dict)
