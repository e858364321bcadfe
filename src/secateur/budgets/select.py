"""Score-then-allocate for the structured selections: ``select_units`` scores every unit of an inventory
(:mod:`secateur.scoring.structured`) and hands the scores to one allocator (:mod:`secateur.budgets.allocate`),
returning the :class:`~secateur.structured.selection.Selection` that compensation and slicing consume."""

from __future__ import annotations

from secateur.budgets.allocate import (
    Guard,
    allocate_blocks,
    allocate_global,
    allocate_uniform,
    allocate_weighted_threshold,
    check_reached,
    check_width_multiple,
    equal_heads,
    report,
)
from secateur.errors import SecateurError
from secateur.models.adapters import Adapter
from secateur.scoring.structured import flap_alam_scores, unit_scores
from secateur.structured.selection import Selection
from secateur.structured.units import inventory

#: the allocators select_units runs (the CLI's --allocation names map onto them: secateur.methods.structured)
ALLOCATORS = ("uniform", "global", "flap", "blocks")


def selection_scores(inv, adapter: Adapter, method: str, stats=None, *, allocation: str = "uniform",
                     seed: int = 0, layers: set[int] | None = None, **score_opts):
    """The unit scores :func:`select_units` allocates from (FLAP's standardized AL-AM scores for ``allocation
    'flap'``); ``layers``: only the pools of these layers (the others 0), for a block-streamed run that scores
    each block while it is loaded and passes the assembled vector back as ``select_units(scores=...)``."""
    if allocation == "flap":
        if method != "flap":
            raise SecateurError("allocation 'flap' (AL-AM) standardizes FLAP metrics; use method='flap'")
        return flap_alam_scores(inv, adapter, stats, score_opts.get("metric", "wifv"), layers=layers)
    return unit_scores(inv, adapter, method, stats, seed=seed, layers=layers, **score_opts)


def select_units(adapter: Adapter, method: str, rho: float, stats=None, *,
                 kinds: tuple[str, ...] = ("kv_group", "channel"), allocation: str = "uniform",
                 guard: Guard | None = None, rounding: str = "ceil", seed: int = 0, n_ffn_groups: int = 16,
                 ffn_order: dict | None = None, cost_normalized: bool | None = None, rule: str = "nearest",
                 scores=None, inv=None, width_multiple: int = 1, deploy: str | None = None,
                 **score_opts) -> Selection:
    """Score the units of ``kinds`` with ``method`` and allocate a removal budget ``rho``.

    ``allocation``: ``uniform`` (ceil-kept per (layer, kind) pool, COEC), ``global`` (greedy under the
    removable-parameter budget with ``guard``; CoCurve's shared solver), ``flap`` (FLAP AL-AM: per-layer
    standardized scores + weighted global threshold; ``method`` must be ``flap``), ``blocks``
    (ShortGPT; ``kinds=('block',)``, ``method='shortgpt'``, ``stats`` = block influences).
    ``cost_normalized`` (global): rank by ``score / cost`` (CoCurve's rule; default) or by raw score;
    the default is raw for ``random``, so that every unit is equally likely whatever its size.
    ``score_opts`` go to the scorer (``norm``, ``metric``, ``weight_factor``). ``scores``, ``inv``: the unit
    scores already computed by :func:`selection_scores` and the inventory they were computed on (its ``head_slot``
    pools ranked by them); nothing is scored here. The allocation report (realized fraction etc.) is
    ``selection.info``. ``width_multiple`` N: every layer's kept MLP width (``channel`` units) a multiple of N or
    the full width, by each allocator's rule (:mod:`secateur.budgets.allocate`; ``blocks`` refuses N > 1).
    ``deploy`` ``"vllm"``: then every layer that keeps attention keeps the same query heads
    (:func:`secateur.budgets.allocate.equal_heads`), so that vLLM's DeciLM format holds the result.
    """
    if allocation not in ALLOCATORS:
        raise SecateurError(f"allocation must be one of {', '.join(ALLOCATORS)}, not {allocation!r}")
    if (scores is None) != (inv is None):
        raise SecateurError("pass the scores together with the inventory they were computed on (scores=, inv=)")
    check_width_multiple(kinds, width_multiple)
    if inv is None:
        inv = inventory(adapter, kinds, n_ffn_groups=n_ffn_groups, ffn_order=ffn_order)
    if scores is None:
        scores = selection_scores(inv, adapter, method, stats, allocation=allocation, seed=seed, **score_opts)
    if allocation == "flap":
        alloc = allocate_weighted_threshold(inv, scores, rho, rule=rule, guard=guard,
                                            width_multiple=width_multiple)
    elif allocation == "uniform":
        alloc = allocate_uniform(inv, scores, rho, rounding=rounding, guard=guard, width_multiple=width_multiple)
    elif allocation == "global":
        norm = cost_normalized if cost_normalized is not None else method != "random"
        alloc = allocate_global(inv, scores, rho, guard=guard, cost_normalized=norm, width_multiple=width_multiple)
    else:
        alloc = allocate_blocks(inv, scores, rho, guard=guard)
    if guard is None:  # protected layers lower the realized fraction on purpose (reported, not refused)
        check_reached(inv, alloc.info, rho, allocation)
    if deploy is not None:
        removed, extra = equal_heads(inv, alloc.removed, scores, guard, rebalance=width_multiple == 1)
        kept = {k: v for k, v in alloc.info.items() if k not in ("target", "total_removable", "removed_params",
                                                                  "realized", "removed_units", "by_kind", "per_layer")}
        alloc.removed, alloc.info = removed, {**kept, **report(inv, removed, rho), **extra}
    info = {"method": method, "allocation": allocation, "kinds": list(kinds), "seed": seed,
            "score_opts": score_opts, **alloc.info}
    return Selection.from_removed(inv, alloc.removed, info)
