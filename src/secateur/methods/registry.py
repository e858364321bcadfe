"""Method registry: each runner composes adapter -> calibration -> stats -> scores -> budget -> compensate
-> materialize, and returns the masks plus details for the report.

A runner is ``fn(model, adapter, calib_ids, opts) -> MethodResult``; ``needs_calibration`` says whether
the CLI must build a calibration set first. New methods register here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class MethodResult:
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    extra_files: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "unstructured" | "structured"
    needs_calibration: bool
    run: Callable[..., MethodResult]
    help: str


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    METHODS[method.name] = method
    return method


def _unstructured(name: str, help_: str) -> Method:
    def run(model, adapter, calib_ids, opts) -> MethodResult:
        from secateur.prune.unstructured import UnstructuredConfig, parse_targets, prune_unstructured

        cfg = UnstructuredConfig(method=name, sparsity=opts.sparsity, pattern=opts.pattern_nm,
                                 budget=opts.budget or "row", rounding=opts.rounding,
                                 targets=parse_targets(opts.targets))
        res = prune_unstructured(model, adapter, calib_ids, cfg, mode=opts.mode, chunk_size=opts.chunk_size,
                                 device=opts.device, progress=not opts.quiet)
        return MethodResult(masks=res.masks, timings=res.timings)

    return Method(name, "unstructured", name != "magnitude", run, help_)


register(_unstructured("magnitude", "|W| per layer (no data)"))
register(_unstructured("wanda", "|W| * ||X|| per output row (Sun et al. 2024)"))
register(_unstructured("sparsegpt", "OBS pruning with reconstruction (Frantar & Alistarh 2023)"))
