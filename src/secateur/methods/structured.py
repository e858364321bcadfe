"""End-to-end structured pruning with compensation (issues 5 and 6).

One dense calibration pass -> selection -> per-layer compensation -> physical slicing::

    stats  = collect_stats(model, adapter, ids, cfg)          # engine mode "dense": one dense forward
    res    = prune_structured(model, adapter, ids, cfg, stats=stats)

1. **Statistics** (:func:`collect_stats`): the calibration engine in ``dense`` mode (COEC Sec. 3.1 "a
   single forward pass accumulates all Grams"; CORP Alg. 1 "global" schedule) with accumulators on the
   inputs of ``o_proj`` (``attn_out``) and ``down_proj`` (``mlp_out``): ``sumsq`` + ``meanvar`` for every
   selection score (so the selection never depends on the compensator), plus the uncentered ``gram``
   ``C = E[x x^T]`` (with the mean) when a compensator runs. ShortGPT adds one dense pass for the block
   influence. Structured selection from a dense pass does not depend on the sparsity, so one
   :class:`StructuredStats` serves every sparsity and compensator (the benchmarks cache it).
2. **Selection** (:func:`secateur.structured.select_units`): units ``kv_group`` / ``head`` (attention) and
   ``channel`` (MLP), ``uniform`` allocation (keep ``ceil((1 - rho) n)`` per layer and kind, COEC Sec. 1)
   or ``flap-global`` (FLAP AL-AM). Scores: ``wanda_sp`` (COEC's L2 form), ``flap`` (WIFV), ``rcpu``,
   ``magnitude`` (mag-sp), ``random`` (seeded), ``shortgpt`` (whole blocks), ``corp`` (MLP channels).
3. **Compensation** of every ``o_proj`` / ``down_proj`` that lost columns, from the dense weight ``W0``
   and the dense statistics (:func:`secateur.compensate.compensate`): ``none`` (slice), ``bias`` (FLAP:
   ``b + W0[:, P] mu_P``), ``ls`` (ridge ``G_yx (G_xx + lambda I)^-1``, COEC Sec. 3.2), ``rcpu`` (left
   rotation + global scale), ``coec`` (COEC Alg. 1; the value projection is passed for ``o_proj`` so the
   anchored alignment of Sec. 4.5 acts there only), ``corp`` (CORP's ridge-affine refit,
   ``W2[:, S] + W2[:, P] B`` with bias ``b2 + W2[:, P] c``; on ``o_proj`` this generic affine refit is a
   toolkit extension - CORP's own attention pruning shrinks Q/K head dimensions, which RoPE forbids).
4. **Materialization**: :func:`secateur.structured.apply_selection` with the compensated weights as
   replacements (bias-free projections get a bias where the compensator returns one). Steps 3-4 are
   :func:`materialize_selection`, which any structured selection reuses (CoCurve's runner calls it for
   ``--method cocurve --compensation X``).

Safeguard **[impl]** (``no_worse=True``, default): the relative calibration reconstruction error
``E||W0 x + b - W~ x_K - b~||^2 / E||W0 x||^2`` (untempered, from the same dense statistics) of every
compensated projection is compared with the slice-only error; a compensator that would raise it (COEC
optimizes the *tempered* metric, ridge solutions are not monotone in lambda) is replaced by the plain
slice and the fallback is reported. Neither paper states this rule; the report counts how often it fired.

Details for the report (:class:`StructuredResult.details`): per-layer reconstruction error before/after,
the chosen GCV lambda and alternation rounds (COEC), the compensation time, realized fractions (overall,
per unit kind, per layer), parameter counts before/after.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from secateur.calib import engine
from secateur.calib.collect import StatsCollector
from secateur.calib.stats import Accumulator
from secateur.errors import SecateurError
from secateur.models.adapters import Adapter

# --- names ---------------------------------------------------------------------------------------------

#: registry method name -> unit score (secateur.scoring.structured)
SELECTIONS: dict[str, str] = {
    "wanda-sp": "wanda_sp", "flap": "flap", "rcpu": "rcpu", "magnitude-sp": "magnitude", "random": "random",
    "shortgpt": "shortgpt", "corp": "corp",
}
#: ``--structured`` maps these unstructured method names to their structured counterpart
STRUCTURED_ALIASES: dict[str, str] = {"magnitude": "magnitude-sp", "wanda": "wanda-sp"}
#: compensation name -> registered compensator (secateur.compensate.COMPENSATORS)
COMPENSATIONS: dict[str, str] = {"none": "none", "bias": "flap_bias", "ls": "ls", "rcpu": "rcpu", "coec": "coec",
                                 "corp": "corp_mlp"}
#: the compensation each selection method ships with (COEC Table 1 "native")
NATIVE: dict[str, str] = {"wanda-sp": "none", "flap": "bias", "rcpu": "rcpu", "magnitude-sp": "none",
                          "random": "none", "shortgpt": "none", "corp": "corp"}
ALLOCATIONS = {"uniform": "uniform", "flap-global": "flap"}
UNIT_CHOICES = ("kv_group", "head", "channel")
GROUP_ROLE = {"attn_out": "o", "mlp_out": "down"}
SCORE_STATS = ("sumsq", "meanvar")

#: compensation knobs (CLI ``extra``): read by every structured selection, including CoCurve's
COMPENSATION_KNOBS = ("compensation", "coec_alpha", "coec_no_left", "coec_rescale", "coec_right", "coec_align",
                      "coec_rounds", "coec_stage", "ls_lambda", "no_worse")
#: knobs only the score-based structured methods read; any of them set on another method is an error
STRUCTURED_KNOBS = ("units", "allocation", *COMPENSATION_KNOBS)
#: structured selections with their own runner (secateur.methods.cocurve) that still take ``--compensation``
OWN_SELECTION = ("cocurve", "cocurve-diag")
#: CoCurve's own knobs (secateur.methods.cocurve.config_from_options)
COCURVE_KNOBS = ("heldout", "positions", "top_r", "n_ffn_groups")


@dataclass
class StructuredConfig:
    """What to prune and how to repair it.

    score: unit score (``wanda_sp``, ``flap``, ``rcpu``, ``magnitude``, ``random``, ``shortgpt``, ``corp``).
    units: unit kinds (``kv_group`` or ``head``, and/or ``channel``); ``shortgpt`` always uses blocks.
    allocation: ``uniform`` (COEC) or ``flap-global`` (FLAP AL-AM, score ``flap`` only).
    compensation: one of :data:`COMPENSATIONS`.
    coec: :class:`secateur.compensate.COECOptions`; ``coec_align`` passes the value projection to o_proj.
    ls_lambda_rel: ridge ``lambda = ls_lambda_rel * mean(diag G_xx)`` (baselines.md Sec. 6 [A]).
    no_worse: the slice-only fallback of the module docstring.
    """

    score: str = "rcpu"
    sparsity: float = 0.3
    units: tuple[str, ...] = ("kv_group", "channel")
    allocation: str = "uniform"
    compensation: str = "none"
    rounding: str = "ceil"
    seed: int = 0
    score_opts: dict = field(default_factory=dict)
    coec: Any = None  # COECOptions (None = paper defaults)
    coec_align: bool = True
    ls_lambda_rel: float = 0.01
    no_worse: bool = True

    def validate(self) -> None:
        if self.score not in SELECTIONS.values():
            raise SecateurError(f"unknown structured score {self.score!r}; choose from {sorted(SELECTIONS)}")
        if self.compensation not in COMPENSATIONS:
            raise SecateurError(f"unknown compensation {self.compensation!r}; choose from "
                                f"{', '.join(COMPENSATIONS)}")
        if self.allocation not in ALLOCATIONS:
            raise SecateurError(f"allocation must be one of {', '.join(ALLOCATIONS)}, not {self.allocation!r}")
        if not 0.0 <= float(self.sparsity) < 1.0:
            raise SecateurError(f"sparsity must be in [0, 1), got {self.sparsity}")
        bad = [u for u in self.units if u not in UNIT_CHOICES]
        if bad or not self.units:
            raise SecateurError(f"--units takes a comma list of {', '.join(UNIT_CHOICES)}, not {bad or 'nothing'}")
        if "kv_group" in self.units and "head" in self.units:
            raise SecateurError("choose one attention unit: kv_group or head")
        if self.allocation == "flap-global" and self.score != "flap":
            raise SecateurError("--allocation flap-global is FLAP's AL-AM allocation; use it with --method flap")
        if self.score == "shortgpt" and self.compensation != "none":
            raise SecateurError("shortgpt removes whole blocks: there are no kept columns to compensate "
                                "(use --compensation none)")
        if self.score == "corp" and any(u != "channel" for u in self.units):
            raise SecateurError("corp ranks MLP channels only (its Q/K head-dimension pruning needs a non-RoPE "
                                "model); use --units channel, or compensate another selection with "
                                "--compensation corp")

    @property
    def kinds(self) -> tuple[str, ...]:
        return ("block",) if self.score == "shortgpt" else tuple(self.units)

    @property
    def needs_gram(self) -> bool:
        return self.compensation != "none"


@dataclass
class StructuredStats:
    """Dense calibration statistics: ``groups[layer][group] = {name: accumulator}`` and, for ShortGPT,
    the per-block influence; ``n_tokens`` and the engine timings for the report."""

    groups: dict[int, dict[str, dict[str, Accumulator]]] = field(default_factory=dict)
    block_influence: torch.Tensor | None = None
    n_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    def has(self, kinds: tuple[str, ...] | set[str]) -> bool:
        return all(k in accs for g in self.groups.values() for accs in g.values() for k in kinds) and \
            bool(self.groups)


@dataclass
class StructuredResult:
    selection: Any
    details: dict
    timings: dict[str, float]


# --- statistics ------------------------------------------------------------------------------------------

def stat_kinds(cfg: StructuredConfig) -> tuple[str, ...]:
    """The accumulators ``cfg`` reads: the score's (none for magnitude, random and ShortGPT, whose block
    influence is its own forward) plus the Grams when compensating."""
    score = () if cfg.score in ("magnitude", "random", "shortgpt") else SCORE_STATS
    return score + (("gram",) if cfg.needs_gram else ())


def collect_stats(model: nn.Module, adapter: Adapter, ids: torch.Tensor, kinds: tuple[str, ...] = SCORE_STATS,
                  block_influence: bool = False, chunk_size: int = 8, device=None,
                  progress: bool = False) -> StructuredStats:
    """One dense engine pass collecting ``kinds`` on the o_proj / down_proj inputs of every layer (plus
    one dense forward for ShortGPT's block influence when asked)."""
    from secateur.scoring.structured import block_influence as bi_fn

    st = StructuredStats()
    if kinds:  # ShortGPT alone needs no accumulators: its block influence is the forward below
        h = StatsCollector(tuple(kinds), tuple(GROUP_ROLE))
        t = time.perf_counter()
        rep = engine.run(model, adapter, ids, h, mode="dense", chunk_size=chunk_size, device=device,
                         progress=progress)
        st = StructuredStats(h.stats, None, rep.n_tokens, {"stats_s": time.perf_counter() - t,
                                                             **{f"engine_{k}": v for k, v in rep.timings.items()}})
    if block_influence:
        t = time.perf_counter()
        # the decoder alone (no lm_head): BI only reads the blocks' inputs and outputs
        st.block_influence = bi_fn(getattr(model, "base_model", model), adapter, ids, batch_size=chunk_size)
        st.timings["block_influence_s"] = time.perf_counter() - t
        st.n_tokens = st.n_tokens or int(ids.numel())
    return st


# --- compensation -----------------------------------------------------------------------------------------

def _value_projection(adapter: Adapter, index: int):
    """The dense value projection read by layer ``index``'s o_proj (COEC Sec. 4.5 alignment)."""
    from secateur.compensate import ValueProjection
    from secateur.structured.units import layer_shape

    refs = adapter.role_refs(adapter.layers[index])
    if "v" not in refs:
        return None
    shape = layer_shape(adapter, index)
    return ValueProjection(refs["v"].weight.detach().clone(), shape.n_heads, shape.n_kv_heads)


def _options(cfg: StructuredConfig, group: str, adapter: Adapter, index: int) -> dict:
    if cfg.compensation == "coec":
        from secateur.compensate import COECOptions

        opts: dict[str, Any] = {"options": cfg.coec or COECOptions()}
        if group == "attn_out" and cfg.coec_align and opts["options"].lambda_align > 0:
            opts["value"] = _value_projection(adapter, index)
        return opts
    if cfg.compensation == "ls":
        return {"lam_rel": cfg.ls_lambda_rel}
    return {}


def _summary(value) -> Any:
    """JSON-friendly copy of a diagnostic (no tensors, no long histories)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if torch.is_tensor(value):
        return value.tolist() if value.numel() <= 8 else f"tensor{tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return [_summary(v) for v in value[:64]]
    if isinstance(value, dict):
        return {k: _summary(v) for k, v in value.items()}
    return value


_KEEP_DIAG = ("method", "recon_before", "recon_after", "gcv_lambda", "gcv_lambda_rel", "rounds", "scale",
              "lambda", "rho_sh", "fallback", "objective_before", "objective_after", "right_iters",
              "gcv_clamped", "solve_method")


def _tempered(stats: StructuredStats, layer: int, group: str, st, alpha: float) -> torch.Tensor:
    """``C^alpha`` (COEC Sec. 4.4) of one projection input, cached on ``stats`` (in memory only)."""
    from secateur.linalg import psd_power

    cache = stats.__dict__.setdefault("tempered", {})
    key = (layer, group, float(alpha))
    if key not in cache:
        cache[key] = psd_power(st.second_moment, alpha)
    return cache[key]


def compensate_selection(model: nn.Module, adapter: Adapter, sel, stats: StructuredStats,
                         cfg: StructuredConfig) -> tuple[dict, list[dict], float]:
    """Replacements ``{(layer, group): Compensation}`` for every projection that lost columns, the
    per-layer records and the total compensation time (seconds)."""
    from secateur import resume
    from secateur.compensate import InputStats, compensate, relative_recon_error
    from secateur.compensate.base import Compensation

    fn = COMPENSATIONS[cfg.compensation]
    reps: dict = {}
    records: list[dict] = []
    total = 0.0
    ck = resume.current()  # --resume: every compensated projection is checkpointed as it is done
    stage = ck.stage("comp") if ck is not None else ""
    for i in sorted(sel.layers):
        layer = adapter.layers[i]
        refs = adapter.role_refs(layer)
        for group, role in GROUP_ROLE.items():
            kept = sel.kept_columns(i, group)
            if kept is None:
                continue
            ref = refs[role]
            w0 = ref.weight.detach().cpu()  # compensators solve on the CPU, next to the statistics
            if kept.numel() == w0.shape[1]:
                continue
            accs = stats.groups.get(i, {}).get(group, {})
            if "gram" not in accs:
                raise SecateurError(f"compensation {cfg.compensation!r} needs the input Gram of layer {i} {group}")
            st = InputStats.from_gram(accs["gram"])
            bias = None if ref.bias is None else ref.bias.detach().cpu()
            rec: dict[str, Any] = {"layer": i, "group": group, "kept": int(kept.numel()), "width": int(w0.shape[1])}
            if kept.numel() == 0:  # everything removed: nothing to compensate into
                rec.update(method=fn, recon_before=1.0, recon_after=1.0, seconds=0.0, skipped="no kept columns")
                records.append(rec)
                continue
            name = f"{stage}-{i}-{group}.pt"
            if ck is not None and ck.has(name):
                got = ck.load(name)
                reps[(i, group)] = Compensation(got["weight"], got["bias"], got["kept"])
                records.append(got["rec"])
                total += got["rec"].get("seconds", 0.0)
                continue
            t = time.perf_counter()
            opts = _options(cfg, group, adapter, i)
            if fn == "coec" and opts["options"].alpha != 1.0:
                # temper once per (layer, group, alpha) and reuse across selections/sparsities: COEC with
                # alpha = 1 on G^alpha is the same computation (G^alpha is taken before slicing, Alg. 1 l. 1)
                alpha = opts["options"].alpha
                g_alpha = _tempered(stats, i, group, st, alpha)
                opts["options"] = dataclasses.replace(opts["options"], alpha=1.0)
                comp = compensate(fn, w0, InputStats(g_alpha, st.mean, st.n), kept, bias=bias, **opts)
                comp.diagnostics.update(alpha=alpha, recon_before=relative_recon_error(w0, st, kept, w0[:, kept]),
                                        recon_after=relative_recon_error(w0, st, kept, comp.weight))
            else:
                comp = compensate(fn, w0, st, kept, bias=bias, **opts)
            dt = time.perf_counter() - t
            total += dt
            d = comp.diagnostics
            rec.update({k: _summary(d[k]) for k in _KEEP_DIAG if k in d}, seconds=dt)
            if cfg.no_worse and d["recon_after"] > d["recon_before"]:
                # [impl] never return a layer worse than the plain slice on the calibration statistics
                rec.update(guard="slice", recon_rejected=d["recon_after"], recon_after=d["recon_before"])
                comp = dataclasses.replace(comp, weight=w0[:, kept].clone(), bias=None)
            else:
                # the weights are cast to the model dtype: report the error of what is actually written
                db = None if comp.bias is None else comp.bias.double() - (
                    torch.zeros_like(comp.bias, dtype=torch.float64) if bias is None else bias.double())
                rec["recon_after"] = relative_recon_error(w0, st, kept, comp.weight, db)
            reps[(i, group)] = comp
            records.append(rec)
            if ck is not None:
                ck.save(name, {"weight": comp.weight.clone(), "rec": rec, "kept": comp.kept.clone(),
                               "bias": None if comp.bias is None else comp.bias.clone()})
    return reps, records, total


# --- the runner -------------------------------------------------------------------------------------------

def _aggregate(records: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for g in GROUP_ROLE:
        rs = [r for r in records if r["group"] == g and "skipped" not in r]
        if not rs:
            continue
        lam = [r["gcv_lambda_rel"] for r in rs if isinstance(r.get("gcv_lambda_rel"), float)]
        out[g] = {"layers": len(rs), "recon_before_mean": sum(r["recon_before"] for r in rs) / len(rs),
                  "recon_after_mean": sum(r["recon_after"] for r in rs) / len(rs),
                  "guard_fired": sum(r.get("guard") == "slice" for r in rs),
                  "seconds": sum(r["seconds"] for r in rs)}
        rounds = [r["rounds"] for r in rs if isinstance(r.get("rounds"), int)]
        if rounds:
            out[g]["rounds_mean"] = sum(rounds) / len(rounds)
            out[g]["rounds_max"] = max(rounds)
        if lam:
            out[g]["gcv_lambda_rel_median"] = sorted(lam)[len(lam) // 2]
    return out


def materialize_selection(model: nn.Module, adapter: Adapter, sel, cfg: StructuredConfig,
                          stats: StructuredStats | None) -> tuple[list[dict], dict[str, float]]:
    """Compensate (``cfg.compensation``, from the dense ``stats``) and slice ``sel`` out of ``model`` in place:
    the last two stages of every structured method, whatever made the selection. Returns the per-layer
    compensation records and the timings."""
    from secateur.structured.slicing import apply_selection

    reps, records, comp_s = ({}, [], 0.0)
    if cfg.compensation != "none":
        if stats is None:
            raise SecateurError(f"compensation {cfg.compensation!r} needs dense calibration statistics")
        reps, records, comp_s = compensate_selection(model, adapter, sel, stats, cfg)
    t = time.perf_counter()
    apply_selection(model, adapter, sel, reps)
    return records, {"compensation_s": comp_s, "slice_s": time.perf_counter() - t}


def compensation_details(cfg: StructuredConfig, records: list[dict], seconds: float) -> dict:
    """The report fields of a compensation stage (shared by every structured method)."""
    return {
        "compensation": cfg.compensation, "compensation_seconds": seconds,
        "compensation_summary": _aggregate(records), "per_layer": records,
        "coec_options": None if cfg.compensation != "coec" else _summary(
            {k: str(v) if isinstance(v, torch.dtype) else v for k, v in dataclasses.asdict(cfg.coec).items()}),
        "coec_align": cfg.coec_align if cfg.compensation == "coec" else None,
        "no_worse_guard": cfg.no_worse,
    }


def prune_structured(model: nn.Module, adapter: Adapter, ids: torch.Tensor | None, cfg: StructuredConfig,
                     stats: StructuredStats | None = None, chunk_size: int = 8, device=None,
                     progress: bool = False) -> StructuredResult:
    """Select, compensate and slice ``model`` in place (see the module docstring); ``stats`` may be
    reused across calls (it must hold :func:`stat_kinds` of ``cfg``)."""
    from secateur.budgets.select import select_units
    from secateur.eval.efficiency import count_params

    cfg.validate()
    if cfg.compensation == "coec" and cfg.coec is None:
        from secateur.compensate import COECOptions

        cfg = dataclasses.replace(cfg, coec=COECOptions())
    timings: dict[str, float] = {}
    t_all = time.perf_counter()
    need_bi = cfg.score == "shortgpt"
    kinds = stat_kinds(cfg)
    if stats is not None:  # reused statistics must hold what this config reads
        missing = [k for k in kinds if not stats.has((k,))]
        if missing:
            raise SecateurError(f"the statistics passed lack {', '.join(missing)} (needed by score {cfg.score!r} "
                                f"with compensation {cfg.compensation!r}); collect them with stat_kinds(cfg)")
    else:
        if (kinds or need_bi) and ids is None:
            raise SecateurError(f"structured score {cfg.score!r} needs calibration data")
        stats = collect_stats(model, adapter, ids, kinds, need_bi, chunk_size, device, progress) if (
            kinds or need_bi) else StructuredStats()
        timings.update(stats.timings)
    if need_bi and stats.block_influence is None:
        if ids is None:
            raise SecateurError("shortgpt needs calibration data for the block influence")
        stats.block_influence = collect_stats(model, adapter, ids, (), True, chunk_size, device).block_influence
    params_before = count_params(model)
    t = time.perf_counter()
    score_stats = stats.block_influence if need_bi else stats.groups
    sel = select_units(adapter, cfg.score, cfg.sparsity, score_stats, kinds=cfg.kinds,
                       allocation="blocks" if need_bi else ALLOCATIONS[cfg.allocation], rounding=cfg.rounding,
                       seed=cfg.seed, **cfg.score_opts)
    timings["select_s"] = time.perf_counter() - t
    records, mt = materialize_selection(model, adapter, sel, cfg, stats)
    timings.update(mt)
    comp_s = mt["compensation_s"]
    timings["total_s"] = time.perf_counter() - t_all
    params_after = count_params(model)
    info = sel.info
    details = {
        "structured": True, "score": cfg.score, "units": list(cfg.kinds),
        "allocation": "blocks" if need_bi else cfg.allocation, "target_sparsity": cfg.sparsity,
        "realized": info.get("realized"), "by_kind": info.get("by_kind"),
        "per_layer_realized": {str(k): v["realized"] for k, v in (info.get("per_layer") or {}).items()},
        "removed_blocks": list(sel.removed_blocks),
        "params_before": params_before, "params_after": params_after,
        "params_removed_fraction": 1 - params_after / params_before if params_before else 0.0,
        "calibration_tokens": stats.n_tokens, **compensation_details(cfg, records, comp_s),
    }
    return StructuredResult(sel, details, timings)


# --- options from the CLI / API ---------------------------------------------------------------------------

def structured_method_name(method: str, structured: bool) -> str:
    """``--structured`` maps ``magnitude``/``wanda`` to ``magnitude-sp``/``wanda-sp``; structured names
    pass through; anything else is an error."""
    from secateur.methods.registry import METHODS

    if not structured:
        return method
    name = STRUCTURED_ALIASES.get(method, method)
    if name not in METHODS or METHODS[name].kind != "structured":
        structured_names = sorted(n for n, m in METHODS.items() if m.kind == "structured")
        raise SecateurError(f"--structured: {method!r} has no structured form; choose from "
                            f"{', '.join(structured_names)}")
    return name


def check_options(method: str, opts) -> None:
    """Model-free validation for ``secateur prune`` (runs before anything is loaded or written)."""
    from secateur.methods.registry import METHODS

    extra = getattr(opts, "extra", {}) or {}
    given = [k for k in STRUCTURED_KNOBS if extra.get(k) is not None]
    cocurve_given = [k for k in COCURVE_KNOBS if extra.get(k) is not None]
    if cocurve_given and method not in OWN_SELECTION:
        raise SecateurError(f"{', '.join('--' + k.replace('_', '-') for k in cocurve_given)} only apply to "
                            f"--method {' / '.join(OWN_SELECTION)}")
    if method in OWN_SELECTION:  # its own selection; any compensator may follow it
        if bad := [k for k in given if k not in COMPENSATION_KNOBS]:
            raise SecateurError(f"{', '.join('--' + k.replace('_', '-') for k in bad)} choose units or allocation "
                                f"of the score-based structured methods; {method} selects its own units")
        compensation_config(opts).validate()
        return
    if method not in SELECTIONS:
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            kind = METHODS[method].kind if method in METHODS else "unknown"
            raise SecateurError(f"{flags} only apply to the structured pipeline (--structured with "
                                f"{', '.join(SELECTIONS)}); {method!r} is a {kind} method")
        return
    if getattr(opts, "pattern", None):
        raise SecateurError("structured pruning takes no --pattern (N:M is unstructured)")
    if getattr(opts, "targets", None):
        raise SecateurError("structured pruning takes no --targets; choose units with --units")
    config_from_options(method, opts).validate()


def check_reachable(method: str, adapter: Adapter, opts) -> None:
    """Refuse, from the model's shapes alone (before calibration), a uniform target above what the rounding
    rule can deliver: ``ceil`` keeps at least one unit of every (layer, kind) pool."""
    if method not in SELECTIONS or method == "shortgpt":
        return
    cfg = config_from_options(method, opts)
    if ALLOCATIONS[cfg.allocation] != "uniform":
        return
    from secateur.budgets.allocate import UNIT_NAMES, uniform_reach
    from secateur.structured.units import inventory

    reach = uniform_reach(inventory(adapter, cfg.kinds), cfg.rounding)
    if cfg.sparsity > reach:
        kept = " and one ".join(UNIT_NAMES.get(k, k) for k in cfg.kinds)
        raise SecateurError(f"--sparsity {cfg.sparsity} cannot be reached with --structured {method}: at most "
                            f"{reach:.4f} of the removable parameters can go, because at least one {kept} per layer "
                            f"are kept (ceil rounding); use --sparsity {math.floor(reach * 1000) / 1000} or less")


def _units(value) -> tuple[str, ...]:
    if value is None:
        return ("kv_group", "channel")
    if isinstance(value, str):
        return tuple(u.strip() for u in value.split(",") if u.strip())
    return tuple(value)


def compensation_config(opts, default: str = "none", **fields) -> StructuredConfig:
    """The compensation part of a :class:`StructuredConfig` from ``PruneOptions.extra`` (``--compensation``,
    else ``default``; the COEC knobs, ``--ls-lambda``); ``fields`` set the selection part."""
    from secateur.compensate import COECOptions, coec_ablation_options

    extra = getattr(opts, "extra", {}) or {}
    coec = coec_ablation_options(extra["coec_stage"]) if extra.get("coec_stage") else COECOptions()
    over: dict[str, Any] = {}
    if extra.get("coec_alpha") is not None:
        over["alpha"] = float(extra["coec_alpha"])
    if extra.get("coec_no_left"):
        over["left_rotation"] = False
    if extra.get("coec_rescale") is not None:
        over["rescale"] = extra["coec_rescale"]
    if extra.get("coec_right") is not None:
        over["right_solver"] = extra["coec_right"]
        if extra["coec_right"] == "none":
            over["max_rounds"] = 0 if extra.get("coec_rounds") is None else over.get("max_rounds", 0)
    if extra.get("coec_rounds") is not None:
        over["max_rounds"] = int(extra["coec_rounds"])
    if over:
        coec = dataclasses.replace(coec, **over)
    align = extra.get("coec_align")
    return StructuredConfig(
        compensation=extra.get("compensation") or default, coec=coec, coec_align=True if align is None else bool(align),
        ls_lambda_rel=0.01 if extra.get("ls_lambda") is None else float(extra["ls_lambda"]),
        no_worse=True if extra.get("no_worse") is None else bool(extra["no_worse"]),
        sparsity=float(opts.sparsity), seed=int(getattr(opts, "seed", 0) or 0), **fields)


def config_from_options(method: str, opts) -> StructuredConfig:
    """Build the :class:`StructuredConfig` of a registry method from ``PruneOptions`` (+ its ``extra``)."""
    extra = getattr(opts, "extra", {}) or {}
    units = _units(extra.get("units"))
    if extra.get("units") is None and method == "corp":
        units = ("channel",)
    # no --compensation: the method as its paper ships it (FLAP's bias, RCPU's rotation, CORP's ridge)
    return compensation_config(opts, NATIVE[method], score=SELECTIONS[method], units=units,
                               allocation=extra.get("allocation") or "uniform",
                               rounding=getattr(opts, "rounding", "ceil") or "ceil")


def run_method(method: str, model: nn.Module, adapter: Adapter, calib_ids: torch.Tensor | None, opts):
    """Registry runner: prune in place; the selection travels as ``secateur_selection.json``."""
    import json

    from secateur.methods.registry import MethodResult

    cfg = config_from_options(method, opts)
    res = prune_structured(model, adapter, calib_ids, cfg, chunk_size=getattr(opts, "chunk_size", 8),
                           device=getattr(opts, "device", None), progress=not getattr(opts, "quiet", True))
    d = res.details
    details = {"method": method, **d, "realized_sparsity": {
        "targeted": d["realized"], "of_all_parameters": d["params_removed_fraction"],
        "pruned_weights": d["params_before"] - d["params_after"], "targeted_weights": res.selection.info.get(
            "total_removable"), "per_module": d["per_layer_realized"]}}
    files = {"secateur_selection.json": json.dumps(res.selection.to_dict(), indent=1).encode()}
    return MethodResult(masks={}, timings=res.timings, details=details, extra_files=files)


def save_structured(model: nn.Module, tokenizer, out, report: dict, extra_files: dict[str, bytes] | None = None,
                    overwrite: bool = False) -> dict:
    """Write a sliced model with :func:`secateur.export.sliced.save_pruned` (stock config when every
    layer has the same widths, else the heterogeneous classes; one ``from_pretrained(dir)`` reloads it),
    plus ``secateur-report.json`` and ``extra_files``, all in one atomic folder. No masks: the removed
    units are gone from the tensors."""
    import json
    import os

    from secateur.export.folder import REPORT_NAME, atomic_dir, export_size
    from secateur.export.sliced import save_pruned

    with atomic_dir(out, overwrite, need=export_size(model)) as tmp:
        info = save_pruned(model, tmp / "model", tokenizer)
        for f in sorted((tmp / "model").iterdir()):
            os.replace(f, tmp / f.name)
        (tmp / "model").rmdir()
        for name, data in (extra_files or {}).items():
            if name == "secateur_hetero.py" and (tmp / name).exists():
                continue  # the exporter already wrote the current copy
            (tmp / name).write_bytes(data)
        report["export_route"] = info["route"]
        (tmp / REPORT_NAME).write_text(json.dumps(report, indent=2, default=str))
    return {"path": str(out), "route": info["route"]}
