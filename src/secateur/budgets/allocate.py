"""Budgets and allocators: which units to remove, given scores (higher = keep) and a target fraction.

Budgets are counted in removable parameters (``Inventory.costs``; CoCurve's ``C = sum_u c_u``); every
allocator reports the realized fraction ``removed / C`` (overall, per unit kind and per layer).

* :func:`allocate_uniform`  same ratio in every (layer, kind) pool: keep ``ceil((1 - rho) n)`` units
  (COEC §1 [A6], verified by its Table 4). This equals FLAP's UL-UM ``n - floor(rho n)`` exactly.
* :func:`allocate_global`   one global pool ranked by ``score / cost`` (or raw score), greedy until the
  removed cost reaches ``rho C`` (CoCurve §5 with ``Delta = score``, i.e. its lambda = 0 diagonal rule,
  used for every baseline under the shared budget solver); overshoot < one unit's cost.
* :func:`allocate_weighted_threshold`  FLAP's AL-AM: sort all units by (standardized) score, keep the
  prefix whose cumulative parameter weight is closest to ``(1 - rho) C``.
* :func:`allocate_blocks`   ShortGPT: remove the ``round(rho L_eff)`` blocks of lowest influence.

Width multiple (``width_multiple = N``, llama.cpp's k-quants need rows of a multiple of 256, q8_0 of 32): every
layer's kept MLP width (its number of kept ``channel`` units) is made a multiple of ``N``, or the layer's full width
``n`` when ``n`` is no multiple of ``N``. It applies to ``channel`` pools only: attention widths are head counts x
head_dim and are never rounded, and ``ffn_group`` units (uneven channel counts) are refused with it
(:func:`check_width_multiple`). Inside a layer the kept channels are still the highest-scored (the lowest-scored
are removed first, ties: lower channel index first). ``N = 1`` leaves every allocator exactly as without it.

* uniform: keep ``min(n, N ceil(k / N))`` with ``k = keep_count(n, rho)``: rounded *up* to the next multiple, so
  no layer loses more than the ratio asks (the realized fraction falls below ``rho`` by under ``N`` channels
  per layer; reported, and named by :func:`shortfall_note`).
* global (``allocate_global``, FLAP's ``allocate_weighted_threshold``): the global ranking runs as without the
  option; then each layer's kept count ``k`` (when no multiple and below ``n``) goes to one of its neighbouring
  widths ``lo = N floor(k / N)`` or ``hi = min(n, lo + N)`` (:func:`round_widths`): every layer starts at
  ``hi``, then layers move down to ``lo`` (removing their next lowest-scored channels), in ascending order of the
  mean ranking key of the channels that would go (ties: earlier layer first), whenever the move brings the
  removed parameters closer to what the ranking removed (the budget) and respects the guard's cap. The realized
  fraction is then within half of one layer's ``N`` channels of the ranking's, in either direction; reported
  (``unrounded_realized``: the ranking's own fraction) and named by :func:`shortfall_note` when it falls short.

Guards (:class:`Guard`) are reusable: protected layers (first/last k or explicit) and a per-layer cap on
the removed fraction of the layer's removable cost; ``Guard.cocurve(rho)`` = layers 0, 1, L-2, L-1
protected, cap ``min(1, 1.5 rho)`` (CoCurve §1). An infeasible budget raises instead of relaxing guards.
Ties are broken by unit order (layer-major; the smaller unit index is removed first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, ROUND_FLOOR, ROUND_HALF_UP, Decimal

import torch

from secateur.errors import SecateurError, check_fraction
from secateur.structured.units import Inventory

_EPS = 1e-9


def keep_count(n: int, rho: float, rounding: str = "ceil") -> int:
    """Units kept out of ``n`` at ratio ``rho``: ``ceil((1 - rho) n)`` by default (COEC; = ``n - floor(rho
    n)``, FLAP/mag-sp), ``floor`` or ``round`` (half up). Evaluated exactly in decimal on ``repr(rho)`` as
    :mod:`secateur.budgets.masks` does (``(1 - 0.7) * 10`` is 3.0000000000000004 in floats: keeps 3, not 4)."""
    # closed: a count (rho = 1 keeps none) is well defined; runs are held to [0, 1) by StructuredConfig
    check_fraction(rho, closed=True, unit="parameters")
    x = (1 - Decimal(repr(float(rho)))) * int(n)
    if rounding == "ceil":
        k = int(x.to_integral_value(rounding=ROUND_CEILING))
    elif rounding == "floor":
        k = int(x.to_integral_value(rounding=ROUND_FLOOR))
    elif rounding == "round":
        k = int(x.to_integral_value(rounding=ROUND_HALF_UP))
    else:
        raise SecateurError(f"rounding must be ceil, floor or round, not {rounding!r}")
    return min(max(k, 0), int(n))


def check_width_multiple(kinds, multiple) -> int:
    """``multiple`` checked (an integer >= 1) against the unit ``kinds`` it would round; returns it. A multiple
    above 1 needs ``channel`` units (the MLP width is their count) and refuses ``ffn_group`` and ``block``."""
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise SecateurError(f"--width-multiple must be an integer >= 1, not {multiple!r}; pass e.g. 32 (q8_0) or 256 "
                            "(k-quants), or omit it")
    if multiple > 1 and "channel" not in kinds:
        why = ("ffn_group units have uneven channel counts" if "ffn_group" in kinds else "whole blocks have no width"
               if "block" in kinds else "attention widths (heads x head_dim) are not rounded")
        raise SecateurError(f"--width-multiple {multiple} rounds the kept MLP width of channel units, and {why}; "
                            f"add channel to --units, or drop --width-multiple")
    return multiple


def width_round(k: int, n: int, multiple: int) -> int:
    """``k`` kept channels of ``n`` rounded up to the next multiple of ``multiple``, capped at ``n`` (the full width
    is allowed when ``n`` is no multiple): never fewer channels kept than asked."""
    return min(int(n), -(-int(k) // multiple) * multiple)


@dataclass(frozen=True)
class Guard:
    """Layer protection and per-layer removal cap (fraction of the layer's removable cost)."""

    protect_first: int = 0
    protect_last: int = 0
    protect: tuple[int, ...] = ()
    cap: float | None = None

    @classmethod
    def cocurve(cls, rho: float) -> Guard:
        """CoCurve §1: first and last two layers protected, per-layer cap ``kappa = 1.5 rho`` (<= 1)."""
        return cls(protect_first=2, protect_last=2, cap=min(1.0, 1.5 * rho))

    def protected(self, n_layers: int) -> set[int]:
        s = set(range(min(self.protect_first, n_layers)))
        s |= set(range(max(n_layers - self.protect_last, 0), n_layers))
        return s | {i % n_layers for i in self.protect}


@dataclass
class Allocation:
    removed: torch.Tensor  # bool [len(inventory)]
    info: dict = field(default_factory=dict)


def report(inv: Inventory, removed: torch.Tensor, rho: float | None = None, **extra) -> dict:
    """Budget arithmetic of a removal mask: totals, realized fraction, per kind and per layer."""
    costs = inv.costs
    total = int(costs.sum())
    rem = int(costs[removed].sum())
    by_kind: dict[str, dict] = {}
    per_layer: dict[int, dict] = {}
    for p in inv.pools:
        r = removed[p.offset:p.offset + p.n]
        k = by_kind.setdefault(p.kind, {"units": 0, "removed_units": 0, "params": 0, "removed_params": 0})
        k["units"] += p.n
        k["removed_units"] += int(r.sum())
        k["params"] += int(p.cost.sum())
        k["removed_params"] += int(p.cost[r].sum())
        pl = per_layer.setdefault(p.layer, {"params": 0, "removed_params": 0})
        pl["params"] += int(p.cost.sum())
        pl["removed_params"] += int(p.cost[r].sum())
    for d in list(by_kind.values()) + list(per_layer.values()):
        d["realized"] = d["removed_params"] / d["params"] if d["params"] else 0.0
    out = {"target": rho, "total_removable": total, "removed_params": rem,
           "realized": rem / total if total else 0.0, "removed_units": int(removed.sum()),
           "by_kind": by_kind, "per_layer": per_layer}
    out.update(extra)
    return out


def _protected_mask(inv: Inventory, guard: Guard | None) -> torch.Tensor:
    prot = guard.protected(inv.n_layers) if guard else set()
    return torch.tensor([int(x) in prot for x in inv.layer_of], dtype=torch.bool) if len(inv) else \
        torch.zeros(0, dtype=torch.bool)


def allocate_uniform(inv: Inventory, scores: torch.Tensor, rho: float, rounding: str = "ceil",
                     guard: Guard | None = None, width_multiple: int = 1) -> Allocation:
    """Remove the ``n - keep_count(n, rho)`` lowest-scored units of every (layer, kind) pool; with
    ``width_multiple`` N > 1 a ``channel`` pool keeps ``width_round(keep_count(n, rho), n, N)`` (rounded up to a
    multiple of N, or all n: module docstring).

    Protected layers lose nothing (the realized fraction then falls below ``rho``; it is reported). The
    per-layer cap does not apply (a uniform ratio never exceeds ``1.5 rho``)."""
    n_mult = check_width_multiple([p.kind for p in inv.pools], width_multiple)
    removed = torch.zeros(len(inv), dtype=torch.bool)
    prot = guard.protected(inv.n_layers) if guard else set()
    unrounded = 0
    for p in inv.pools:
        if p.kind == "block":
            raise SecateurError("uniform allocation does not apply to whole blocks; use allocate_blocks")
        if p.layer in prot:
            continue
        k = keep_count(p.n, rho, rounding)
        s = scores[p.offset:p.offset + p.n]
        order = torch.argsort(s, stable=True)
        unrounded += int(p.cost[order[:p.n - k]].sum())
        if p.kind == "channel" and n_mult > 1:
            k = width_round(k, p.n, n_mult)
        removed[p.offset + order[:p.n - k]] = True
    extra = _width_info(inv, n_mult, unrounded)
    return Allocation(removed, report(inv, removed, rho, allocator="uniform", rounding=rounding, **extra))


def _width_info(inv: Inventory, multiple: int, unrounded_removed: int) -> dict:
    """The report's width-multiple fields (none at 1, so that the default report is unchanged)."""
    if multiple == 1:
        return {}
    total = inv.total_cost
    return {"width_multiple": multiple, "unrounded_removed_params": unrounded_removed,
            "unrounded_realized": unrounded_removed / total if total else 0.0}


def round_widths(inv: Inventory, removed: torch.Tensor, key: torch.Tensor, multiple: int,
                 guard: Guard | None = None) -> torch.Tensor:
    """The global allocators' width rule (module docstring): ``removed`` (a global ranking's) with every
    ``channel`` pool's kept count moved to a neighbouring multiple of ``multiple`` (or the full width), the
    removed parameters kept as close as the moves allow to ``removed``'s; ``key``: the ranking key (higher =
    keep), which orders the channels inside a layer (lowest removed first, stable) and the moves across layers."""
    removed = removed.clone()
    costs = inv.costs
    budget = int(costs[removed].sum())
    cap = guard.cap if guard and guard.cap is not None else None
    layer_cost = inv.layer_costs()
    moves = []
    for p in inv.pools:
        if p.kind != "channel":
            continue
        k = p.n - int(removed[p.offset:p.offset + p.n].sum())
        lo = k // multiple * multiple
        hi = min(p.n, lo + multiple)
        if k in (lo, p.n):
            continue
        order = p.offset + torch.argsort(key[p.offset:p.offset + p.n], stable=True)
        removed[p.offset:p.offset + p.n] = False
        removed[order[:p.n - hi]] = True  # start at hi: the ranking's lowest channels, fewer of them
        chunk = order[p.n - hi:p.n - lo]  # what moving down to lo removes next
        moves.append((float(key[chunk].to(torch.float64).mean()), p.offset, p.layer, chunk))
    done = int(costs[removed].sum())
    rem_layer: dict[int, int] = {}
    for li, c in zip(inv.layer_of[removed].tolist(), costs[removed].tolist(), strict=True):
        rem_layer[li] = rem_layer.get(li, 0) + c
    for _, _, li, chunk in sorted(moves, key=lambda m: (m[0], m[1])):
        delta = int(costs[chunk].sum())
        if abs(done + delta - budget) >= abs(done - budget):
            continue
        if cap is not None and rem_layer.get(li, 0) + delta > cap * layer_cost[li] + _EPS * layer_cost[li]:
            continue
        removed[chunk] = True
        rem_layer[li] = rem_layer.get(li, 0) + delta
        done += delta
    return removed


UNIT_NAMES = {"kv_group": "KV group", "head": "attention head", "head_slot": "query-head slot",
              "channel": "MLP channel", "ffn_group": "FFN group", "block": "block"}


def shortfall_note(info: dict, rho: float, tol: float = 0.01) -> str | None:
    """A one-line note when an allocation realized visibly less than ``rho`` of the removable parameters
    (``info``: :func:`report`'s fields): which unit kinds fell short and why, e.g. a model with 2 KV groups per
    layer at 20% keeps ``ceil(0.8 x 2) = 2`` groups under uniform allocation, so no attention is pruned; when KV
    groups fell short it names ``head_slot`` units (one query head of every group: ``g`` units per layer)."""
    realized = info.get("realized")
    if realized is None or rho - realized <= tol:
        return None
    kinds = ", ".join(f"{UNIT_NAMES.get(k, k)}s {d['realized']:.3f} ({d['removed_units']} of {d['units']} units)"
                      for k, d in (info.get("by_kind") or {}).items())
    kv = (info.get("by_kind") or {}).get("kv_group")
    slots = ("--units head_slot,channel (one query head of every KV group per unit: the group size drops, the KV "
             "heads stay), " if kv and rho - kv["realized"] > tol else "")
    mult, unrounded = info.get("width_multiple"), info.get("unrounded_realized")
    width = (f"--width-multiple {mult} keeps every layer's MLP width a multiple of {mult} (the selection before it "
             f"removed {unrounded:.4f})" if mult and unrounded is not None and unrounded - realized > _EPS else None)
    if width and rho - unrounded <= tol:  # the width multiple alone
        return (f"realized {realized:.4f} of the removable parameters against --sparsity {rho}: {kinds}; {width}: "
                f"use a smaller --width-multiple or a higher --sparsity")
    return (f"realized {realized:.4f} of the removable parameters against --sparsity {rho}: {kinds}; per-layer "
            f"rounding keeps ceil((1 - rho) n) of each layer's n units, so few large units (KV groups) may not be "
            f"removed at all{'; ' + width if width else ''}: use {slots}a global allocation (--allocation "
            f"flap-global with flap) or a higher --sparsity")


def uniform_reach(inv: Inventory, rounding: str = "ceil", width_multiple: int = 1) -> float:
    """The largest fraction of the removable parameters :func:`allocate_uniform` can remove at any ``rho < 1``:
    ``ceil`` keeps at least one unit of every pool (``min(n, N)`` channels of a channel pool under a width
    multiple ``N``), ``floor`` and ``round`` may empty a pool."""
    total = int(inv.costs.sum())
    if rounding != "ceil" or not total:
        return 1.0

    def least_kept(p) -> int:
        if p.kind == "channel" and width_multiple > 1:
            return int(p.cost[:min(p.n, width_multiple)].sum())
        return int(p.cost.min())
    return sum(int(p.cost.sum()) - least_kept(p) for p in inv.pools if p.n) / total


def shortfall_bound(inv: Inventory, allocation: str, width_multiple: int = 1) -> float:
    """How far below ``rho`` an allocator's realized fraction may fall by its rounding rule alone: uniform
    (ceil-kept) removes ``> rho n - 1`` units of every pool (one unit per pool); global greedy stops at or
    above ``rho C``; FLAP's nearest prefix is within half a unit (``flap`` rule: 1.5); ShortGPT rounds half up.
    A width multiple ``N`` adds ``N - 1`` channels per channel pool (uniform, rounded up) or half of the largest
    ``N`` channels (global: :func:`round_widths` stops within half a move of the ranking)."""
    total = int(inv.costs.sum())
    if not total or not len(inv):
        return 0.0
    largest = int(inv.costs.max())
    chan = [p for p in inv.pools if p.kind == "channel" and p.n] if width_multiple > 1 else []
    if allocation == "uniform":
        widths = sum((min(width_multiple, p.n) - 1) * int(p.cost.max()) for p in chan)
        return (sum(int(p.cost.max()) for p in inv.pools if p.n) + widths) / total
    widths = width_multiple * max((int(p.cost.max()) for p in chan), default=0) / 2
    return ({"global": 0.0, "flap": 1.5, "blocks": 0.5}.get(allocation, 1.0) * largest + widths) / total


def check_reached(inv: Inventory, info: dict, rho: float, allocation: str) -> None:
    """Refuse a selection that misses ``rho`` by more than its rounding rule allows (before anything is sliced
    or written), naming the realized fraction."""
    realized = float(info.get("realized", rho))
    bound = shortfall_bound(inv, allocation, int(info.get("width_multiple", 1)))
    if rho - realized > bound + _EPS:
        raise SecateurError(
            f"sparsity {rho} cannot be reached: the {allocation} selection removes {realized:.4f} of the removable "
            f"parameters (rounding accounts for at most {bound:.4f}); lower --sparsity")


def allocate_global(inv: Inventory, scores: torch.Tensor, rho: float, guard: Guard | None = None,
                    cost_normalized: bool = True, width_multiple: int = 1) -> Allocation:
    """Greedy global budget (CoCurve §5, ``Delta = score``): repeatedly remove the eligible unit with the
    smallest ``score / cost`` (``cost_normalized``) until the removed cost reaches ``rho C``.

    With static scores the greedy equals one stable ascending sort scanned once, skipping units whose
    layer is protected or whose removal would exceed the layer cap. Result: removed cost in
    ``[rho C, rho C + c_max)``; raises when the guards make the budget infeasible. ``width_multiple`` > 1: the
    ranking's MLP widths are then moved to multiples by :func:`round_widths` (module docstring).
    """
    n_mult = check_width_multiple([p.kind for p in inv.pools], width_multiple)
    costs = inv.costs
    total = int(costs.sum())
    target = rho * total
    key = scores / costs.to(torch.float64) if cost_normalized else scores.to(torch.float64)
    order = torch.argsort(key, stable=True).tolist()
    layer_of = inv.layer_of.tolist()
    cost_l = costs.tolist()
    layer_cost = inv.layer_costs()
    prot = guard.protected(inv.n_layers) if guard else set()
    cap = guard.cap if guard and guard.cap is not None else None
    removed = torch.zeros(len(inv), dtype=torch.bool)
    rem_layer: dict[int, int] = {}
    done = 0
    for u in order:
        if done >= target - _EPS * total:
            break
        li = layer_of[u]
        if li in prot:
            continue
        if cap is not None and rem_layer.get(li, 0) + cost_l[u] > cap * layer_cost[li] + _EPS * layer_cost[li]:
            continue
        removed[u] = True
        rem_layer[li] = rem_layer.get(li, 0) + cost_l[u]
        done += cost_l[u]
    if done < target - _EPS * total:
        raise SecateurError(
            f"budget {rho:.4f} is infeasible under the guards: at most {done / total:.4f} of the removable "
            "parameters can be removed (protected layers / per-layer cap)")
    extra = _width_info(inv, n_mult, done)
    if n_mult > 1:
        removed = round_widths(inv, removed, key, n_mult, guard)
    return Allocation(removed, report(inv, removed, rho, allocator="global", cost_normalized=cost_normalized,
                                      guard=None if guard is None else vars(guard), **extra))


def allocate_weighted_threshold(inv: Inventory, scores: torch.Tensor, rho: float, rule: str = "nearest",
                                guard: Guard | None = None, width_multiple: int = 1) -> Allocation:
    """FLAP AL-AM global allocation (baselines.md §4, FLAP ``prune_flap``).

    Units are sorted by descending score (protected units first); their costs (removable parameters:
    a Llama head weighs ``4 d m``, a channel ``3 d``, i.e. FLAP's ``512/3`` ratio for m = 128; a GQA KV
    group its true ``(2|H_g| + 2) d m``) are accumulated, and the position ``p`` where the cumulative kept
    weight is closest to ``(1 - rho) C`` is found. ``rule='nearest'`` keeps that prefix, so the kept
    weight is within half a unit weight of the target (baselines.md B4). ``rule='flap'`` copies the public
    code: threshold = score at ``p``, keep scores strictly above it (drops position ``p`` and its ties,
    which can miss the target by up to 1.5 unit weights). ``width_multiple`` > 1: the kept MLP widths are then
    moved to multiples by :func:`round_widths` (module docstring; protected layers keep everything).
    """
    n_mult = check_width_multiple([p.kind for p in inv.pools], width_multiple)
    costs = inv.costs.to(torch.float64)
    total = float(costs.sum())
    prot = _protected_mask(inv, guard)
    key = torch.where(prot, torch.full_like(scores, math.inf), scores.to(torch.float64))
    order = torch.argsort(-key, stable=True)
    cum = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(costs[order], 0)])
    target = (1.0 - rho) * total
    p = int(torch.argmin((cum - target).abs()))  # keep the first p units (first minimum on ties)
    keep = torch.zeros(len(inv), dtype=torch.bool)
    if rule == "nearest":
        keep[order[:p]] = True
    elif rule == "flap":
        p = int(torch.argmin((cum[1:] - target).abs()))
        keep = key > key[order[p]]
    else:
        raise SecateurError(f"rule must be 'nearest' or 'flap', not {rule!r}")
    keep |= prot
    removed = ~keep
    extra = _width_info(inv, n_mult, int(inv.costs[removed].sum()))
    if n_mult > 1:
        removed = round_widths(inv, removed, scores.to(torch.float64), n_mult, guard)
        keep = ~removed
    return Allocation(removed, report(inv, removed, rho, allocator="flap_alam", rule=rule,
                                      kept_params=int(costs[keep].sum()), kept_target=target, **extra))


def allocate_blocks(inv: Inventory, scores: torch.Tensor, rho: float, guard: Guard | None = None,
                    n: int | None = None) -> Allocation:
    """ShortGPT: remove the ``n`` blocks with the smallest score (BI); default ``n = round(rho L)``, half up
    (baselines.md §8 [R]: ``L_eff = C / mean block cost``, which is L when C is the blocks' own cost, as in
    this inventory). Ties: lower layer first. Protected layers are never removed."""
    block = torch.tensor([p.kind == "block" for p in inv.pools for _ in range(p.n)], dtype=torch.bool)
    if not bool(block.all()):
        raise SecateurError("allocate_blocks needs an inventory of whole blocks (kinds=('block',))")
    if n is None:
        n = math.floor(rho * len(inv) + 0.5 + _EPS)
    prot = _protected_mask(inv, guard)
    cand = [u for u in torch.argsort(scores, stable=True).tolist() if not prot[u]]
    if n > len(cand):
        raise SecateurError(f"cannot remove {n} blocks: only {len(cand)} are eligible")
    removed = torch.zeros(len(inv), dtype=torch.bool)
    removed[cand[:n]] = True
    return Allocation(removed, report(inv, removed, rho, allocator="shortgpt", n_blocks=n))


DEPLOY_TARGETS = ("vllm",)  # --deploy: the engines whose per-layer format constrains the selection


def equal_heads(inv: Inventory, removed: torch.Tensor, key: torch.Tensor, guard: Guard | None = None,
                rebalance: bool = True) -> tuple[torch.Tensor, dict]:
    """``--deploy vllm``: ``removed`` changed so that every layer that keeps attention keeps the same number of query
    heads (vLLM's DeciLM, NVIDIA's per-layer format, has one global query-head count; KV heads per layer, MLP widths
    and whole removed attentions are free). Returns ``(removed, report fields)``.

    Every attention pool of the inventory (``kv_group``, ``head`` or ``head_slot``) must hold the same number of units
    of the same number of query heads (a model not yet pruned unevenly); each unit's KV heads then divide the kept
    heads by construction (a kv_group keeps its whole group; a head slot keeps every KV head). Layers whose attention
    the allocation removed entirely stay removed (DeciLM's ``no_op``). The others keep their ``c`` highest-``key``
    units (ties: lower index kept, as everywhere), where ``c`` is the floor or ceiling of their mean kept count,
    whichever leaves the removed parameters nearest the allocation's (ties: the larger ``c``); protected layers
    (``guard``) keep their count, so with one of them keeping attention ``c`` is its count. The parameters that
    moves away from the allocation's budget are then given back or taken by MLP units outside protected layers, in
    the allocation's own ranking order (``key``; lowest removed first, highest restored first), while that brings the
    removed parameters nearer the budget (not with ``width_multiple`` > 1, whose widths would break: the realized
    fraction is then reported as it falls). ``undeployed_realized``: the allocation's fraction."""
    pools = [p for p in inv.pools if p.kind in ("kv_group", "head", "head_slot")]
    if not pools:
        return removed, {"deploy": "vllm"}
    per_unit = {int(d) for p in pools for d in (p.ptr[1:] - p.ptr[:-1]).tolist()}
    if len({p.n for p in pools}) > 1 or len(per_unit) > 1:
        raise SecateurError("--deploy vllm needs the same attention units in every layer (a model whose layers "
                            "already differ cannot be brought to one query-head count); prune the original model")
    n, hpu = pools[0].n, per_unit.pop()
    kept = {p.layer: p.n - int(removed[p.offset:p.offset + p.n].sum()) for p in pools}
    prot = guard.protected(inv.n_layers) if guard else set()
    live = [p for p in pools if kept[p.layer] > 0]
    if not live:
        return removed, {"deploy": "vllm", "deploy_query_heads": 0}
    fixed = {kept[p.layer] for p in live if p.layer in prot}
    if fixed:
        candidates = [max(fixed)]
    else:
        mean = sum(kept[p.layer] for p in live) / len(live)
        candidates = sorted({min(n, max(1, math.floor(mean))), min(n, max(1, math.ceil(mean)))}, reverse=True)
    costs = inv.costs
    target = int(costs[removed].sum())
    best = None
    for c in candidates:
        out = removed.clone()
        for p in live:
            if p.layer in prot:
                continue
            order = p.offset + torch.argsort(key[p.offset:p.offset + p.n], stable=True)
            out[p.offset:p.offset + p.n] = False
            out[order[:p.n - c]] = True
        gap = abs(int(costs[out].sum()) - target)
        if best is None or gap < best[0]:
            best = (gap, c, out)
    _, c, out = best
    if rebalance:
        out = _rebalance_mlp(inv, out, key, target, prot)
    before = target / inv.total_cost if inv.total_cost else 0.0
    return out, {"deploy": "vllm", "deploy_query_heads": c * hpu, "undeployed_realized": before}


def _rebalance_mlp(inv: Inventory, removed: torch.Tensor, key: torch.Tensor, target: int, prot: set[int]
                   ) -> torch.Tensor:
    """MLP units removed (lowest ``key`` first) or restored (highest first) while the removed parameters get nearer
    ``target`` (:func:`equal_heads`)."""
    costs = inv.costs
    mlp = torch.zeros(len(inv), dtype=torch.bool)
    for p in inv.pools:
        if p.kind in ("channel", "ffn_group") and p.layer not in prot:
            mlp[p.offset:p.offset + p.n] = True
    done = int(costs[removed].sum())
    if done < target:
        cand = torch.nonzero(mlp & ~removed).flatten()
        cand = cand[torch.argsort(key[cand], stable=True)]
    else:
        cand = torch.nonzero(mlp & removed).flatten()
        cand = cand[torch.argsort(key[cand], stable=True, descending=True)]
    removed = removed.clone()
    for u in cand.tolist():
        step = int(costs[u]) if done < target else -int(costs[u])
        if abs(done + step - target) >= abs(done - target):
            break
        removed[u] = done < target
        done += step
    return removed
