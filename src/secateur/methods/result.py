"""What every method runner returns, and what a whole prune returns (a leaf: the registry, every composition module
and the API import it)."""

from __future__ import annotations

from collections.abc import Mapping
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


@dataclass(frozen=True)
class PruneResult(Mapping):
    """What :func:`secateur.api.prune` returns: the run's ``report`` (plain JSON-able data, as written to
    ``secateur-report.json``), the pruned ``model`` and its ``tokenizer``. Reads as the report
    (``result["method"]``, ``dict(result)``), so code that took the report keeps working."""

    report: dict
    model: torch.nn.Module
    tokenizer: object

    def __getitem__(self, key: str):
        return self.report[key]

    def __iter__(self):
        return iter(self.report)

    def __len__(self) -> int:
        return len(self.report)
