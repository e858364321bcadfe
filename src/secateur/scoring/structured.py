"""Structured selection scores: pure functions of (weights, accumulator statistics).

Column scores are computed for the input channels ``j`` of a residual-writing projection (``o_proj`` /
``down_proj`` as an ``[out, in]`` matrix ``W``) from the statistics of its input ``X`` (the engine's
``attn_out`` / ``mlp_out`` group accumulators). Higher score = more important (removed last).

Notation: ``E_j = sum_t X_jt^2`` over all calibration tokens (so ``||X_j||_2 = sqrt(E_j)``), ``Var_j`` the
population variance over tokens, ``mu_j`` the mean. Any of ``SumSq``, ``MeanVar`` or ``Gram`` supplies
``E``; ``Var``/``mu`` need ``MeanVar`` or ``Gram`` (see :class:`Moments`). The token-count scale of
``||X_j||`` does not change any ranking inside one pool; for cross-layer pools it is the same for every
layer (same calibration tokens).

Column scores (baselines.md §1, 3, 4, 5; corp.md §2):

* ``magnitude``      ``||W_:,j||_2``                                    (FLAP repo mag-sp)
* ``wanda_sp``       ``'l2'``: ``||W_:,j||_2 ||X_j||_2`` (COEC/RCPU definition, COEC Eq. in §3.1);
                     ``'l1mean'``: ``mean_i |W_ij| ||X_j||_2`` (FLAP's implementation).
* ``flap``           ``WIFV_j = Var_j ||W_:,j||_2^2`` (FLAP default), ``IFV_j = Var_j``,
                     ``WIFN_j = mean_i |W_ij| ||X_j||_2``; the attention metric is squared per column before
                     aggregation (FLAP code: ``metrics[...] ** 2`` for o_proj).
* ``rcpu``           ``gamma_j = ||W_:,j||_2 ||X_j||_2 Var_j``                (RCPU / COEC §9)
* ``corp``           MLP channels: ``E[h_i^2] ||W2_:,i||_2`` (CORP §3.3 "combined", paper default);
                     ``weight_factor='in_row_out_col'`` multiplies by the input-row norms instead of
                     nothing (public-code variant, corp.md [A1]).

Unit scores: KV group / head = sum of its columns' scores (baselines.md §3 [R]); head slot (one query head
of every KV group, :mod:`secateur.structured.units`) = the same sum over its heads' columns, after
:func:`~secateur.structured.units.rank_slots` has assigned each group's ``j``-th lowest-scored head (by that
per-head sum) to slot ``j``; the sum, not the mean, because a slot is costed as the sum of its heads (so
``score / cost`` under global allocation is the same per-parameter density as a KV group's) and every slot of a
layer has ``n_kv`` heads (sum and mean rank one layer's slots alike); FFN group = sum of its
channels' scores; ``magnitude_unit`` = Frobenius norm over every weight the unit owns (q/k/v rows + o
columns, gate/up rows + down columns; CoCurve baseline [R]); ``random`` = i.i.d. uniform scores from a
seeded generator (so a ranking-based allocator picks a uniform random subset; head slots: i.i.d. per-head
scores drawn after the units' from the same generator, ranked and summed as above, so the other units'
draws do not depend on whether slots are present); ``shortgpt`` = block
influence ``BI_i = 1 - mean cos(x_i, x_{i+1})`` (baselines.md §8). FLAP's adaptive (AL-AM) unit scores
are per-layer standardized instead, see :func:`flap_alam_scores`.

Disagreement noted: FLAP's public code estimates the "sample variance" with an in-place update that
aliases the old mean and skips the first sample; we use the exact population variance (``MeanVar``).
Only the scale differs materially, and FLAP removes scale by standardization (AL-AM) or compares within
one layer (UL-UM).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from secateur.calib.stats import Accumulator, BlockInfluence, Gram, MeanVar, SumSq
from secateur.errors import SecateurError
from secateur.models import hetero
from secateur.models.adapters import Adapter
from secateur.models.families import layout_of
from secateur.scoring.corp import corp_mlp_scores
from secateur.structured.units import ATTN_KINDS, MLP_KINDS, Inventory, Pool, rank_slots

StatsLike = Accumulator | Mapping[str, Accumulator]


# --- statistics ---------------------------------------------------------------------------------------

@dataclass
class Moments:
    """Per-feature ``energy`` (sum of squares), ``mean``, ``var`` (population) and token count ``n``,
    derived from whichever accumulators are present (``SumSq`` > ``MeanVar`` > ``Gram`` for energy)."""

    n: int
    energy: torch.Tensor
    mean: torch.Tensor | None
    var: torch.Tensor | None

    @property
    def norm(self) -> torch.Tensor:
        """``||X_j||_2`` over all calibration tokens."""
        return self.energy.clamp_min(0).sqrt()

    def need_var(self, what: str) -> torch.Tensor:
        if self.var is None:
            raise SecateurError(f"{what} needs the input variance: collect a 'meanvar' or 'gram' accumulator")
        return self.var


def moments(stats: StatsLike) -> Moments:
    accs = {"x": stats} if isinstance(stats, Accumulator) else dict(stats)
    ss = next((a for a in accs.values() if isinstance(a, SumSq)), None)
    mv = next((a for a in accs.values() if isinstance(a, MeanVar)), None)
    gr = next((a for a in accs.values() if isinstance(a, Gram)), None)
    mean = var = None
    n = 0
    if mv is not None and mv.n:
        mean, var, n = mv.mean, mv.var, mv.n
    elif gr is not None and gr.n:
        mean = gr.mean
        var = (gr.G.diagonal().to(torch.float64) / gr.n - mean**2).clamp_min(0)
        n = gr.n
    if ss is not None:
        energy, n = ss.sumsq.to(torch.float64), ss.n_tokens
    elif mv is not None and mv.n:
        energy = mv.n * (mv.var + mv.mean**2)
    elif gr is not None:
        energy = gr.G.diagonal().to(torch.float64)
    else:
        raise SecateurError("no usable statistics: need a 'sumsq', 'meanvar' or 'gram' accumulator")
    return Moments(n, energy, mean, var)


# --- column scores (pure) -------------------------------------------------------------------------------

def _w(w: torch.Tensor) -> torch.Tensor:
    """float64 on the CPU, where the statistics are (a model on a GPU scores the same)."""
    return w.detach().to("cpu", torch.float64)


def magnitude(w: torch.Tensor) -> torch.Tensor:
    """``||W_:,j||_2`` (FLAP repo mag-sp)."""
    return _w(w).norm(dim=0)


def wanda_sp(w: torch.Tensor, stats: StatsLike, norm: str = "l2") -> torch.Tensor:
    """Wanda-sp: ``'l2'`` ``||W_:,j|| ||X_j||`` (COEC §3.1 / RCPU), ``'l1mean'`` ``mean_i|W_ij| ||X_j||``
    (FLAP ``prune_wanda_sp``). They coincide for a single output row (baselines.md B2)."""
    x = moments(stats).norm
    if norm == "l2":
        return _w(w).norm(dim=0) * x
    if norm == "l1mean":
        return _w(w).abs().mean(dim=0) * x
    raise SecateurError(f"wanda_sp norm must be 'l2' or 'l1mean', not {norm!r}")


def flap(w: torch.Tensor, stats: StatsLike, metric: str = "wifv") -> torch.Tensor:
    """FLAP fluctuation metrics (baselines.md §4): WIFV ``Var_j ||W_:,j||^2``, IFV ``Var_j``,
    WIFN ``mean_i |W_ij| ||X_j||``."""
    mo = moments(stats)
    if metric == "wifv":
        return mo.need_var("FLAP WIFV") * _w(w).pow(2).sum(dim=0)
    if metric == "ifv":
        return mo.need_var("FLAP IFV").clone()
    if metric == "wifn":
        return _w(w).abs().mean(dim=0) * mo.norm
    raise SecateurError(f"FLAP metric must be wifv, ifv or wifn, not {metric!r}")


def rcpu(w: torch.Tensor, stats: StatsLike) -> torch.Tensor:
    """RCPU variance-aware score ``||W_:,j|| ||X_j|| Var(X_j)`` (COEC §9 / baselines.md §5)."""
    mo = moments(stats)
    return _w(w).norm(dim=0) * mo.norm * mo.need_var("the RCPU score")


def vbp(stats: StatsLike) -> torch.Tensor:
    """VBP (Berisha et al., ICCV 2025; arXiv 2507.12988): the variance ``Var(h_i)`` of MLP neuron ``i``'s
    post-activation output over the calibration tokens (population variance, Welford-merged in float64 by
    :class:`~secateur.calib.stats.MeanVar`); the weights take no part. Its compensation is the mean shift: the
    removed neurons' means times their output columns folded into the next layer's bias (``--compensation bias``)."""
    return moments(stats).need_var("the VBP score").clone()


def corp_mlp(w_down: torch.Tensor, stats: StatsLike, w_in: list[torch.Tensor] | None = None,
             weight_factor: str = "out_col") -> torch.Tensor:
    """CORP MLP channel score ``E[h_i^2] ||W2_:,i||`` (CORP §3.3, combined = paper default) from the
    down_proj input statistics: :func:`secateur.scoring.corp.corp_mlp_scores` with ``E[h_i^2]`` read
    from ``stats`` (``weight_factor='in_row_out_col'``: the public code's variant, corp.md [A1])."""
    mo = moments(stats)
    return corp_mlp_scores(_w(w_down), mo.energy / max(mo.n, 1), weight_factor=weight_factor,
                           w_in=[_w(w) for w in (w_in or [])])


# --- block influence (ShortGPT): the accumulator and its pass live in secateur.calib -----------------------

# --- unit scores ----------------------------------------------------------------------------------------

def group_stats(stats, layer: int, group: str) -> StatsLike:
    """``stats[layer][group]`` (engine layout) or ``stats[(layer, group)]``."""
    try:
        return stats[layer][group]
    except (KeyError, IndexError, TypeError):
        pass
    try:
        return stats[(layer, group)]
    except (KeyError, TypeError):
        raise SecateurError(f"no statistics for layer {layer} group {group!r}") from None


def _out_weight(adapter: Adapter, layer: nn.Module, group: str) -> torch.Tensor:
    role = {"attn_out": "o", "mlp_out": "down"}[group]
    return adapter.role_refs(layer)[role].weight


def _in_weights(adapter: Adapter, layer: nn.Module) -> list[torch.Tensor]:
    refs = adapter.role_refs(layer)
    return [refs[r].weight for r in ("gate", "up") if r in refs]


def _qkv(fam: str, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v weights as ``[out, in]`` (a fused q|k|v projection, GPT-2's ``c_attn``, split in thirds)."""
    layout = layout_of(fam)
    attn = hetero.attention_module(fam, layer)
    ws = [hetero.weight_oi(layout, getattr(attn, name)) for name in layout.qkv]
    if layout.fused_qkv:  # rows [q; k; v], q as wide as the output projection's input
        qw = hetero.in_features(layout, getattr(attn, layout.out))
        kvw = (ws[0].shape[0] - qw) // 2
        return ws[0][:qw], ws[0][qw:qw + kvw], ws[0][qw + kvw:]
    return tuple(ws)


def _segment_sum(values: torch.Tensor, pool: Pool) -> torch.Tensor:
    """Sum member values into their units (values indexed by member id)."""
    out = torch.zeros(pool.n, dtype=torch.float64)
    return out.index_add_(0, pool.unit_of_member, values[pool.members].to(torch.float64))


def _segment_mean(values: torch.Tensor, pool: Pool) -> torch.Tensor:
    return _segment_sum(values, pool) / pool.ptr.diff().to(torch.float64)


def _head_sums(col: torch.Tensor, m: int) -> torch.Tensor:
    return col.view(-1, m).sum(dim=1)


def _column_fn(method: str, opts: dict) -> Callable[[Adapter, nn.Module, int, str, object], torch.Tensor]:
    norm, metric = opts.get("norm", "l2"), opts.get("metric", "wifv")
    wf = opts.get("weight_factor", "out_col")

    def fn(adapter: Adapter, layer: nn.Module, i: int, group: str, stats) -> torch.Tensor:
        w = _out_weight(adapter, layer, group)
        if method == "magnitude":
            return magnitude(w)
        st = group_stats(stats, i, group)
        if method == "wanda_sp":
            return wanda_sp(w, st, norm)
        if method == "flap":
            c = flap(w, st, metric)
            return c.pow(2) if group == "attn_out" else c  # FLAP squares the attention metric
        if method == "rcpu":
            return rcpu(w, st)
        if method == "vbp":
            if group == "attn_out":
                raise SecateurError("VBP ranks MLP neurons only (--units channel)")
            return vbp(st)
        if method == "corp":
            if group == "attn_out":
                raise SecateurError("CORP scores MLP channels only (--units channel); its Q/K score prunes "
                                    "head dimensions: --method corp-qk")
            return corp_mlp(w, st, _in_weights(adapter, layer), wf)
        raise AssertionError(method)

    return fn


COLUMN_METHODS = ("magnitude", "wanda_sp", "flap", "rcpu", "corp", "vbp")
_SCORERS: dict[str, Callable[..., torch.Tensor]] = {}


def register_scorer(name: str, fn: Callable[..., torch.Tensor]) -> None:
    """Add a unit scorer ``fn(inventory, adapter, stats, **opts) -> Tensor[len(inventory)]`` (higher =
    keep) under ``name``, for a selection score that lives outside this module (an extension point: the
    built-in scores are dispatched above)."""
    _SCORERS[name] = fn


def _magnitude_unit(inv: Inventory, adapter: Adapter) -> torch.Tensor:
    fam = adapter.family
    out = torch.zeros(len(inv), dtype=torch.float64)
    m = inv.head_dim
    for p in inv.pools:
        layer = adapter.layers[p.layer]
        if p.kind in ATTN_KINDS:
            wq, wk, wv = (_w(t) for t in _qkv(fam, layer))
            wo = _w(_out_weight(adapter, layer, "attn_out"))
            per_head = wq.pow(2).sum(1).view(-1, m).sum(1) + wo.pow(2).sum(0).view(-1, m).sum(1)
            if p.kind == "head_slot":  # the KV heads belong to no slot
                rank_slots(p, per_head)
                sq = _segment_sum(per_head, p)
            else:
                per_kv = (wk.pow(2).sum(1) + wv.pow(2).sum(1)).view(-1, m).sum(1)
                sq = _segment_sum(per_head, p) + per_kv[p.kv]
        elif p.kind in MLP_KINDS:
            rows = sum(_w(w).pow(2).sum(1) for w in _in_weights(adapter, layer))
            sq = _segment_sum(rows + _w(_out_weight(adapter, layer, "mlp_out")).pow(2).sum(0), p)
        else:
            sq = torch.tensor([sum(float(_w(t).pow(2).sum()) for t in layer.parameters())])
        out[p.offset:p.offset + p.n] = sq.sqrt()
    return out


def unit_scores(inv: Inventory, adapter: Adapter, method: str, stats=None, *, seed: int = 0,
                layers: set[int] | None = None, **opts) -> torch.Tensor:
    """Scores (float64, higher = keep) of every unit of ``inv``.

    ``method``: ``random`` (``seed``), ``magnitude``, ``magnitude_unit``, ``wanda_sp`` (``norm='l2'|
    'l1mean'``), ``flap`` (``metric='wifv'|'ifv'|'wifn'``; uniform-structure aggregation = sum of squared
    column metrics), ``rcpu``, ``corp`` (MLP units; ``weight_factor``), ``shortgpt`` (block units; ``stats``
    = a per-layer BI tensor or a list of :class:`BlockInfluence`; score = BI), or a registered scorer.
    ``stats``: per-layer group accumulators, ``stats[layer]['attn_out'|'mlp_out']`` -> accumulator or
    ``{name: accumulator}`` (what the calibration engine hands to ``Handler.on_group``). ``layers``: score
    only the pools of these layers (the others stay 0; a block-streamed run scores each block while it is
    loaded, :func:`secateur.methods.structured.streamed_scores`); each pool's scores are those of a full call.
    """
    if method in _SCORERS:
        out = _SCORERS[method](inv, adapter, stats, seed=seed, **opts).to(torch.float64)
        if any(not p.ranked for p in inv.pools):
            raise SecateurError(f"scorer {method!r} gives no per-query-head scores, which head_slot units need to "
                                "form their slots (structured.units.rank_slots); use kv_group units")
        return out
    if method == "random":
        g = torch.Generator().manual_seed(seed)
        out = torch.rand(len(inv), generator=g, dtype=torch.float64)
        for p in inv.pools:
            if p.kind == "head_slot":
                heads = torch.rand(p.members.numel(), generator=g, dtype=torch.float64)
                rank_slots(p, heads)
                out[p.offset:p.offset + p.n] = _segment_sum(heads, p)
        return out
    if method == "magnitude_unit":
        return _magnitude_unit(inv, adapter)
    if method == "shortgpt":
        return _block_scores(inv, stats)
    if method not in COLUMN_METHODS:
        raise SecateurError(f"unknown selection score {method!r}; choose from random, magnitude_unit, "
                            f"shortgpt, {', '.join(COLUMN_METHODS)}, {', '.join(_SCORERS)}")
    col = _column_fn(method, opts)
    out = torch.zeros(len(inv), dtype=torch.float64)
    for p in inv.pools:
        if layers is not None and p.layer not in layers:
            continue
        if p.kind == "block":
            raise SecateurError(f"{method} does not score whole blocks; use shortgpt")
        c = col(adapter, adapter.layers[p.layer], p.layer, p.group, stats)
        if p.kind in ATTN_KINDS:
            c = _head_sums(c, inv.head_dim)
        if p.kind == "head_slot":
            rank_slots(p, c)
        out[p.offset:p.offset + p.n] = _segment_sum(c, p)
    return out


def _block_scores(inv: Inventory, stats) -> torch.Tensor:
    if stats is None:
        raise SecateurError("shortgpt needs block influence: pass block_influence(...) as stats")
    bi = stats if torch.is_tensor(stats) else torch.tensor(
        [a.bi if isinstance(a, BlockInfluence) else float(a) for a in stats], dtype=torch.float64)
    out = torch.zeros(len(inv), dtype=torch.float64)
    for p in inv.pools:
        if p.kind != "block":
            raise SecateurError("shortgpt scores whole blocks only; build the inventory with kinds=('block',)")
        out[p.offset] = float(bi[p.layer])
    return out


def _standardize(x: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / std`` with the unbiased std, as FLAP's ``standarlization``; a constant vector -> 0."""
    if x.numel() < 2:
        return torch.zeros_like(x)
    sd = x.std()
    return (x - x.mean()) / sd if sd > 0 else torch.zeros_like(x)


def flap_alam_scores(inv: Inventory, adapter: Adapter, stats, metric: str = "wifv",
                     layers: set[int] | None = None) -> torch.Tensor:
    """FLAP adaptive (AL-AM) unit scores (baselines.md §4, FLAP ``prune_flap``).

    Per layer, the o_proj per-column metric (squared) is standardized over the layer's columns and
    averaged over each unit's columns; the MLP per-channel metric is standardized over the layer's
    channels (FFN groups average their channels). Scores are then comparable across layers and modules
    and feed :func:`secateur.budgets.allocate.allocate_weighted_threshold`. ``layers``: as :func:`unit_scores`.
    """
    col = _column_fn("flap", {"metric": metric})
    out = torch.zeros(len(inv), dtype=torch.float64)
    m = inv.head_dim
    for p in inv.pools:
        if layers is not None and p.layer not in layers:
            continue
        if p.kind == "block":
            raise SecateurError("FLAP does not score whole blocks")
        z = _standardize(col(adapter, adapter.layers[p.layer], p.layer, p.group, stats))
        if p.kind in ATTN_KINDS:
            z = z.view(-1, m).mean(dim=1)  # per query head; a KV group (or head slot) averages its heads
        if p.kind == "head_slot":
            rank_slots(p, z)
        out[p.offset:p.offset + p.n] = _segment_mean(z, p)
    return out


def ffn_order_from_scores(adapter: Adapter, method: str = "wanda_sp", stats=None, **opts) -> dict[int, torch.Tensor]:
    """Per-layer channel permutation by descending channel score (stable), for CoCurve's
    ``ffn_grouping=sorted`` ablation (cocurve.md [A1]): pass it as ``inventory(..., ffn_order=...)``."""
    from secateur.structured.units import inventory

    inv = inventory(adapter, ("channel",))
    s = unit_scores(inv, adapter, method, stats, **opts)
    return {p.layer: p.members[torch.argsort(-s[p.offset:p.offset + p.n], stable=True)] for p in inv.pools}
