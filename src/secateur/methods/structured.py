"""Structured pruning with compensation (issues 5 and 6): the composition of the score-based selections and
their options.

One dense calibration pass -> selection -> per-layer compensation (a second dense pass, one block's Grams at a
time) -> physical slicing::

    res    = prune_structured(model, adapter, ids, cfg)                      # collects what it needs
    stats  = collect_stats(model, adapter, ids, stat_kinds(cfg))             # or: every layer's statistics, cached
    res    = prune_structured(model, adapter, ids, cfg, stats=stats)         # (same weights, L Grams in memory)

1. **Statistics** (:func:`secateur.calib.collect.collect_stats`): accumulators on the inputs of ``o_proj``
   (``attn_out``) and ``down_proj`` (``mlp_out``): ``sumsq`` + ``meanvar`` for every selection score (so the
   selection never depends on the compensator), kept for every layer (global allocation reads them; 24 d bytes
   per layer and group). The uncentered ``gram`` ``C = E[x x^T]`` (with the mean) a compensator reads is taken
   in the compensation stage, one block at a time (memory formula:
   :mod:`secateur.methods.materialize`), unless the statistics passed in hold every layer's. ShortGPT adds one
   dense pass for the block influence (:func:`add_block_influence`). Structured selection from a dense pass does
   not depend on the sparsity, so one :class:`~secateur.calib.collect.StructuredStats` of :func:`stat_kinds`
   serves every sparsity and compensator (the benchmarks cache it).
2. **Selection** (:func:`secateur.budgets.select.select_units`): units ``kv_group`` / ``head`` / ``head_slot``
   (attention; ``head_slot``: one query head of every KV group, :mod:`secateur.structured.units`) and
   ``channel`` (MLP), ``uniform`` allocation (keep ``ceil((1 - rho) n)`` per layer and kind, COEC Sec. 1)
   or ``flap-global`` (FLAP AL-AM). Scores: ``wanda_sp`` (COEC's L2 form), ``flap`` (WIFV), ``rcpu``,
   ``magnitude`` (mag-sp), ``random`` (seeded), ``shortgpt`` (whole blocks), ``corp`` (MLP channels).
3. **Compensation and materialization** (:func:`secateur.methods.materialize.materialize_selection`, shared
   with CoCurve): every ``o_proj`` / ``down_proj`` that lost columns is repaired from the dense weight and the
   dense statistics, then the units are sliced out.

Details for the report (:class:`StructuredResult.details`): per-layer reconstruction error before/after,
the chosen GCV lambda and alternation rounds (COEC), the compensation time, the statistics' memory
(``statistics_memory``: bytes and formula), realized fractions (overall, per unit kind, per layer), parameter
counts before/after.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from secateur.calib.collect import SCORE_STATS, StructuredStats, block_influence, collect_stats
from secateur.errors import SecateurError, check_fraction
from secateur.methods.knobs import knob
from secateur.methods.materialize import (
    CompensationConfig,
    CompensationOptions,
    compensation_details,
    materialize_selection,
)
from secateur.methods.result import MethodResult
from secateur.models.adapters import Adapter

# --- names ---------------------------------------------------------------------------------------------

#: registry method name -> unit score (secateur.scoring.structured)
SELECTIONS: dict[str, str] = {
    "wanda-sp": "wanda_sp", "flap": "flap", "rcpu": "rcpu", "magnitude-sp": "magnitude", "random": "random",
    "shortgpt": "shortgpt", "corp": "corp",
}
#: ``--structured`` maps these unstructured method names to their structured counterpart
STRUCTURED_ALIASES: dict[str, str] = {"magnitude": "magnitude-sp", "wanda": "wanda-sp"}
#: the compensation each selection method ships with (COEC Table 1 "native")
NATIVE: dict[str, str] = {"wanda-sp": "none", "flap": "bias", "rcpu": "rcpu", "magnitude-sp": "none",
                          "random": "none", "shortgpt": "none", "corp": "corp"}
#: ``--allocation`` name -> allocator of :func:`secateur.budgets.select.select_units`
STRUCTURED_ALLOCATIONS: dict[str, str] = {"uniform": "uniform", "flap-global": "flap"}
UNIT_CHOICES = ("kv_group", "head", "head_slot", "channel")
ATTN_UNITS = ("kv_group", "head", "head_slot")


@dataclass
class StructuredConfig(CompensationConfig):
    """What to prune and how to repair it (the compensation fields: :class:`CompensationConfig`).

    score: unit score (``wanda_sp``, ``flap``, ``rcpu``, ``magnitude``, ``random``, ``shortgpt``, ``corp``).
    units: unit kinds (``kv_group``, ``head`` or ``head_slot``, and/or ``channel``); ``shortgpt`` always uses
    blocks.
    allocation: ``uniform`` (COEC) or ``flap-global`` (FLAP AL-AM, score ``flap`` only).
    width_multiple: every layer's kept MLP width (``channel`` units) a multiple of it, or the full width (uniform:
    rounded up; flap-global: to a neighbouring multiple, nearest the ranking's budget; rules in
    :mod:`secateur.budgets.allocate`); attention widths are not rounded; 1 (default): no rounding.
    """

    score: str = "rcpu"
    sparsity: float = 0.3
    units: tuple[str, ...] = ("kv_group", "channel")
    allocation: str = "uniform"
    rounding: str = "ceil"
    seed: int = 0
    score_opts: dict = field(default_factory=dict)
    width_multiple: int = 1

    def validate(self) -> None:
        if self.score not in SELECTIONS.values():
            raise SecateurError(f"unknown structured score {self.score!r}; choose from {sorted(SELECTIONS)}")
        super().validate()
        if self.allocation not in STRUCTURED_ALLOCATIONS:
            raise SecateurError(f"allocation must be one of {', '.join(STRUCTURED_ALLOCATIONS)}, "
                                f"not {self.allocation!r}")
        check_fraction(self.sparsity, unit="parameters")
        bad = [u for u in self.units if u not in UNIT_CHOICES]
        if bad or not self.units:
            raise SecateurError(f"--units takes a comma list of {', '.join(UNIT_CHOICES)}, not {bad or 'nothing'}; "
                                "pass e.g. kv_group,channel")
        if sum(u in ATTN_UNITS for u in self.units) > 1:
            raise SecateurError(f"--units names two attention units; choose one of {', '.join(ATTN_UNITS)}")
        if self.allocation == "flap-global" and self.score != "flap":
            raise SecateurError("--allocation flap-global is FLAP's AL-AM allocation; use it with --method flap")
        if self.score == "shortgpt" and self.compensation != "none":
            raise SecateurError("shortgpt removes whole blocks: there are no kept columns to compensate "
                                "(use --compensation none)")
        if self.score == "corp" and any(u != "channel" for u in self.units):
            raise SecateurError("corp ranks MLP channels only (its Q/K head-dimension pruning needs a non-RoPE "
                                "model); use --units channel, or compensate another selection with "
                                "--compensation corp")
        from secateur.budgets.allocate import check_width_multiple

        check_width_multiple(self.kinds, self.width_multiple)

    @property
    def kinds(self) -> tuple[str, ...]:
        return ("block",) if self.score == "shortgpt" else tuple(self.units)


@dataclass
class StructuredResult:
    selection: Any
    details: dict
    timings: dict[str, float]


# --- the pipeline -----------------------------------------------------------------------------------------

def selection_kinds(cfg: StructuredConfig) -> tuple[str, ...]:
    """The accumulators the selection of ``cfg`` reads (what its own dense pass collects for every layer; the
    Grams of a compensation come from the per-block pass of :func:`materialize_selection`)."""
    return () if cfg.score in ("magnitude", "random", "shortgpt") else SCORE_STATS


def stat_kinds(cfg: StructuredConfig) -> tuple[str, ...]:
    """The accumulators statistics passed to :func:`prune_structured` must hold for ``cfg``: the score's (none for
    magnitude, random and ShortGPT, whose block influence is its own forward) plus the Grams when compensating
    (every layer's: a cache reused across sparsities; without one the Grams are taken one block at a time)."""
    return selection_kinds(cfg) + (("gram",) if cfg.needs_gram else ())


def add_block_influence(stats: StructuredStats, model: nn.Module, adapter: Adapter, ids: torch.Tensor,
                        chunk_size: int = 8) -> StructuredStats:
    """``stats`` with ShortGPT's block influence (timed as ``block_influence_s``)."""
    t = time.perf_counter()
    stats.block_influence = block_influence(model, adapter, ids, batch_size=chunk_size)
    stats.timings["block_influence_s"] = time.perf_counter() - t
    stats.n_tokens = stats.n_tokens or int(ids.numel())
    return stats


def _statistics(model, adapter, ids, cfg: StructuredConfig, stats, chunk_size, device, progress):
    """The statistics ``cfg`` reads: ``stats`` when given (checked: with every Gram when compensating), else the
    selection's, collected from ``ids``."""
    need_bi = cfg.score == "shortgpt"
    kinds = stat_kinds(cfg)
    if stats is not None:  # reused statistics must hold what this config reads
        missing = [k for k in kinds if not stats.has((k,))]
        if missing:
            raise SecateurError(f"the statistics passed lack {', '.join(missing)} (needed by score {cfg.score!r} "
                                f"with compensation {cfg.compensation!r}); collect them with stat_kinds(cfg)")
        if need_bi and stats.block_influence is None:
            if ids is None:
                raise SecateurError("shortgpt needs calibration data for the block influence")
            stats.block_influence = block_influence(model, adapter, ids, batch_size=chunk_size)
        return stats, {}
    if (kinds or need_bi) and ids is None:
        raise SecateurError(f"structured score {cfg.score!r} needs calibration data")
    stats = collect_stats(model, adapter, ids, selection_kinds(cfg), chunk_size, device, progress)
    if need_bi:
        add_block_influence(stats, model, adapter, ids, chunk_size)
    return stats, dict(stats.timings)


def prepared(cfg: StructuredConfig) -> StructuredConfig:
    """``cfg`` validated, COEC's paper defaults filled in when it compensates with COEC."""
    import dataclasses

    cfg.validate()
    if cfg.compensation == "coec" and cfg.coec is None:
        from secateur.compensate import COECOptions

        cfg = dataclasses.replace(cfg, coec=COECOptions())
    return cfg


def prune_structured(model: nn.Module, adapter: Adapter, ids: torch.Tensor | None, cfg: StructuredConfig,
                     stats: StructuredStats | None = None, chunk_size: int = 8, device=None,
                     progress: bool = False) -> StructuredResult:
    """Select, compensate and slice ``model`` in place (see the module docstring); ``stats`` may be
    reused across calls (it must hold :func:`stat_kinds` of ``cfg``)."""
    from secateur.budgets.select import select_units
    from secateur.eval.efficiency import count_params

    cfg = prepared(cfg)
    t_all = time.perf_counter()
    need_bi = cfg.score == "shortgpt"
    stats, timings = _statistics(model, adapter, ids, cfg, stats, chunk_size, device, progress)
    params_before = count_params(model)
    t = time.perf_counter()
    score_stats = stats.block_influence if need_bi else stats.groups
    sel = select_units(adapter, cfg.score, cfg.sparsity, score_stats, kinds=cfg.kinds,
                       allocation="blocks" if need_bi else STRUCTURED_ALLOCATIONS[cfg.allocation],
                       rounding=cfg.rounding, seed=cfg.seed, width_multiple=cfg.width_multiple, **cfg.score_opts)
    timings["select_s"] = time.perf_counter() - t
    records, mt, memory = materialize_selection(model, adapter, sel, cfg, stats, ids, chunk_size=chunk_size,
                                                device=device, progress=progress)
    timings.update(mt)
    if cfg.needs_gram and ids is not None:
        stats.n_tokens = stats.n_tokens or int(ids.numel())
    timings["total_s"] = time.perf_counter() - t_all
    details = structured_details(cfg, sel, stats, params_before, count_params(model), records, mt, memory)
    return StructuredResult(sel, details, timings)


def structured_details(cfg: StructuredConfig, sel, stats: StructuredStats, params_before: int, params_after: int,
                       records: list[dict], mt: dict, memory: dict | None) -> dict:
    """The report's details of a structured prune (in memory or block-streamed)."""
    info = sel.info
    return {
        "structured": True, "score": cfg.score, "units": list(cfg.kinds),
        "allocation": "blocks" if cfg.score == "shortgpt" else cfg.allocation, "target_sparsity": cfg.sparsity,
        "realized": info.get("realized"), "by_kind": info.get("by_kind"),
        "per_layer_realized": {str(k): v["realized"] for k, v in (info.get("per_layer") or {}).items()},
        "removed_blocks": list(sel.removed_blocks),
        "params_before": params_before, "params_after": params_after,
        "params_removed_fraction": 1 - params_after / params_before if params_before else 0.0,
        "calibration_tokens": stats.n_tokens,
        **{k: info[k] for k in ("width_multiple", "unrounded_realized") if k in info},
        **compensation_details(cfg, records, mt["compensation_s"], memory),
    }


# --- the registered methods (--method wanda-sp|flap|rcpu|magnitude-sp|random|shortgpt|corp) -------------------

def integer(value) -> int:
    """An integral knob value: an int, an integral float or a decimal string (no bool, no fraction)."""
    if isinstance(value, bool):
        raise ValueError("not an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("not an integer")
        return int(value)
    return int(value) if isinstance(value, int) else int(str(value).strip())


@dataclass
class StructuredOptions(CompensationOptions):
    """The score-based structured methods' knobs: the units, the allocation and the compensation."""

    units: str | tuple[str, ...] | None = knob("comma list of kv_group|head|head_slot and/or channel (default: "
                                               "kv_group,channel; head_slot: one query head of every KV group)")
    allocation: str | None = knob("uniform ceil-kept per layer (COEC, default) or FLAP's global AL-AM (with "
                                  "--method flap)", choices=STRUCTURED_ALLOCATIONS)
    width_multiple: int | None = knob("keep every layer's MLP width (kept channels) a multiple of N, or the full "
                                      "width: 256 for llama.cpp's k-quants (Q4_K ...), 32 for q8_0; uniform rounds "
                                      "up, flap-global to the multiple nearest its budget; attention widths are not "
                                      "rounded (default: 1)", type=integer, metavar="N")


def _units(value) -> tuple[str, ...]:
    if value is None:
        return ("kv_group", "channel")
    if isinstance(value, str):
        return tuple(u.strip() for u in value.split(",") if u.strip())
    return tuple(value)


def structured_config(name: str, opts) -> StructuredConfig:
    """The validated :class:`StructuredConfig` of registry method ``name`` from ``PruneOptions`` (its common
    fields and its :class:`StructuredOptions`); no ``--compensation``: the method as its paper ships it
    (FLAP's bias, RCPU's rotation, CORP's ridge)."""
    if opts.pattern:
        raise SecateurError("structured pruning takes no --pattern (N:M is unstructured); "
                            "drop --pattern, or drop --structured")
    if opts.targets:
        raise SecateurError("structured pruning takes no --targets; choose units with --units")
    o: StructuredOptions = opts.method_options
    units = ("channel",) if o.units is None and name == "corp" else _units(o.units)
    cfg = StructuredConfig(**o.compensation_fields(NATIVE[name]), score=SELECTIONS[name], units=units,
                           allocation=o.allocation or "uniform", rounding=opts.rounding or "ceil",
                           sparsity=float(opts.sparsity), seed=int(opts.seed or 0),
                           width_multiple=1 if o.width_multiple is None else o.width_multiple)
    cfg.validate()
    return cfg


def check_reachable(name: str, adapter: Adapter, opts) -> None:
    """Refuse, from the model's shapes alone (before calibration), a uniform target above what the rounding
    rule can deliver: ``ceil`` keeps at least one unit of every (layer, kind) pool."""
    if name == "shortgpt":
        return
    cfg = structured_config(name, opts)
    if STRUCTURED_ALLOCATIONS[cfg.allocation] != "uniform":
        return
    from secateur.budgets.allocate import UNIT_NAMES, uniform_reach
    from secateur.structured.units import inventory

    reach = uniform_reach(inventory(adapter, cfg.kinds), cfg.rounding, cfg.width_multiple)
    if cfg.sparsity > reach:
        kept = " and ".join(f"one {UNIT_NAMES.get(k, k)}" if k != "channel" or cfg.width_multiple == 1 else
                            f"{cfg.width_multiple} MLP channels (--width-multiple)" for k in cfg.kinds)
        raise SecateurError(f"--sparsity {cfg.sparsity} cannot be reached with --structured {name}: at most "
                            f"{reach:.4f} of the removable parameters can go, because at least {kept} per layer "
                            f"are kept (ceil rounding); use --sparsity {math.floor(reach * 1000) / 1000} or less")


def run(name: str, model: nn.Module, adapter: Adapter, calib_ids: torch.Tensor | None, opts) -> MethodResult:
    """Registry runner: prune in place; the selection travels as ``secateur_selection.json``."""
    cfg = structured_config(name, opts)
    if cfg.needs_gram and calib_ids is not None:  # said up front: the compensation's passes are most of the run
        print(f"secateur: note: --compensation {cfg.compensation} takes the calibration set through the model again "
              f"after the statistics pass, block by block, for the Grams of the kept inputs (about 3-4 forwards of "
              f"{calib_ids.shape[0]} x {calib_ids.shape[1]} tokens in all)", file=sys.stderr)
    res = prune_structured(model, adapter, calib_ids, cfg, chunk_size=opts.chunk_size,
                           device=opts.device, progress=not opts.quiet)
    return method_result(name, res)


def method_result(name: str, res: StructuredResult) -> MethodResult:
    """The registry's result of a structured prune; the selection travels as ``secateur_selection.json``."""
    d = res.details
    details = {"method": name, **d,
               "realized_sparsity": res.selection.realized_sparsity(d["params_before"], d["params_after"])}
    files = {"secateur_selection.json": json.dumps(res.selection.to_dict(), indent=1).encode()}
    return MethodResult(masks={}, timings=res.timings, details=details, extra_files=files)
