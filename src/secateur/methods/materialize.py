"""Materialize a structured selection: compensate (:mod:`secateur.methods.compensation`, its Grams from the
statistics passed in or from the per-block pass of :mod:`secateur.methods.compensation_pass`), then slice
(:func:`secateur.structured.slicing.apply_selection`, the compensated weights as replacements; bias-free projections
get a bias where the compensator returns one). The last two stages of every structured method, whatever made the
selection. The compensation names re-exported here are the options' public home for the structured methods.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from secateur.calib.collect import StructuredStats
from secateur.errors import SecateurError
from secateur.methods.compensation import (
    COMPENSATIONS,
    CompensationConfig,
    CompensationOptions,
    compensate_selection,
    compensation_details,
)
from secateur.methods.compensation_pass import MEMORY_FORMULA, BlockCompensation, statistics_memory
from secateur.models.adapters import Adapter
from secateur.models.blocks import RESIDENT, Blocks

__all__ = ["COMPENSATIONS", "MEMORY_FORMULA", "BlockCompensation", "CompensationConfig", "CompensationOptions",
           "compensate_selection", "compensation_details", "materialize_selection", "statistics_memory"]


def materialize_selection(model: nn.Module, adapter: Adapter, sel, cfg: CompensationConfig,
                          stats: StructuredStats | None = None, ids: torch.Tensor | None = None, *,
                          chunk_size: int = 8, device=None, progress: bool = False,
                          blocks: Blocks = RESIDENT) -> tuple[list[dict], dict[str, float], dict | None]:
    """Compensate (``cfg.compensation``, from dense statistics) and slice ``sel`` out of ``model`` in place:
    the last two stages of every structured method, whatever made the selection. The dense Grams come from
    ``stats`` when it holds them (every layer's, reused by the caller), else from one dense engine pass over
    ``ids`` that keeps one block's Grams at a time (:class:`BlockCompensation`). Returns the per-layer
    compensation records, the timings and the ``statistics_memory`` report (None without compensation).
    ``blocks``: the Gram pass's block context (in memory; split over processes, its shard)."""
    from secateur.calib import engine
    from secateur.structured.slicing import apply_selection

    reps, records, comp_s, memory = {}, [], 0.0, None
    timings: dict[str, float] = {}
    if cfg.compensation != "none":
        if stats is not None and stats.groups and stats.has(("gram",)):
            reps, records, comp_s = compensate_selection(model, adapter, sel, stats, cfg)
            memory = statistics_memory(adapter, sel, cfg, stats, per_block=False)
        elif ids is not None:
            t = time.perf_counter()
            h = BlockCompensation(cfg, adapter, sel)
            if h.todo:
                with h.pipelined():
                    engine.run(model, adapter, ids, h, mode="dense", chunk_size=chunk_size, device=device,
                               progress=progress, layers=h.layers, blocks=blocks)
            reps, records, comp_s = h.results.reps, h.results.records, h.results.seconds
            # the walk's own time: the solves (sequential) or the waits for them (pipelined) taken out
            timings["gram_pass_s"] = time.perf_counter() - t - h.waited_s
            timings["compensation_wall_s"] = h.waited_s
            memory = statistics_memory(adapter, sel, cfg, stats, per_block=True, peak_bytes=h.peak_bytes,
                                       workers=h.workers)
        else:
            raise SecateurError(f"compensation {cfg.compensation!r} needs dense calibration statistics")
    t = time.perf_counter()
    apply_selection(model, adapter, sel, reps)
    return records, {"compensation_s": comp_s, **timings, "slice_s": time.perf_counter() - t}, memory
