"""Compensation of a structured selection, one projection at a time: its options, the solve, the guard, and the
results store that ``--resume`` reloads (shared by the score-based selections of :mod:`secateur.methods.structured`
and CoCurve's, :mod:`secateur.methods.cocurve`).

Compensation of every ``o_proj`` / ``down_proj`` that lost columns, from the dense weight ``W0`` and the dense
statistics (:func:`secateur.compensate.compensate`): ``none`` (slice), ``bias`` (FLAP: ``b + W0[:, P] mu_P``),
``ls`` (ridge ``G_yx (G_xx + lambda I)^-1``, COEC Sec. 3.2), ``rcpu`` (left rotation + global scale), ``coec``
(COEC Alg. 1; the value projection is passed for ``o_proj`` so the anchored alignment of Sec. 4.5 acts there
only), ``corp`` (CORP's ridge-affine refit, ``W2[:, S] + W2[:, P] B`` with bias ``b2 + W2[:, P] c``; on
``o_proj`` this generic affine refit is a toolkit extension - CORP's own attention pruning shrinks Q/K head
dimensions, which RoPE forbids). Statistics that already hold every layer's Gram (a benchmark's cache) are
compensated here as they are (:func:`compensate_selection`); otherwise the per-block pass of
:mod:`secateur.methods.compensation_pass` collects them one block at a time.

Safeguard **[impl]** (``no_worse=True``, default): the relative calibration reconstruction error
``E||W0 x + b - W~ x_K - b~||^2 / E||W0 x||^2`` (untempered, from the same dense statistics) of every
compensated projection is compared with the slice-only error; a compensator that would raise it (COEC
optimizes the *tempered* metric, ridge solutions are not monotone in lambda) is replaced by the plain
slice and the fallback is reported. Neither paper states this rule; the report counts how often it fired.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from secateur.calib.collect import GROUP_ROLE, StructuredStats
from secateur.calib.dist import Owners as dist_owners
from secateur.compensate import COECOptions, coec_ablation_options
from secateur.compensate.coec import COEC_ABLATION_STAGES
from secateur.errors import SecateurError
from secateur.methods.knobs import MethodOptions, knob
from secateur.models.adapters import Adapter

#: compensation name (``--compensation``) -> registered compensator (secateur.compensate.COMPENSATORS)
COMPENSATIONS: dict[str, str] = {"none": "none", "bias": "flap_bias", "ls": "ls", "rcpu": "rcpu", "coec": "coec",
                                 "corp": "corp_mlp", "grail": "ls"}
#: GRAIL's ridge (Tang et al., CPAL 2026; code TWWinde/GRAIL_Compensation, ``_B_from_gram``): ``lambda = 1e-3 *
#: mean(diag G_KK)`` over the uncentered Gram of the kept inputs, the consumer refit ``W' = W G[:, K] (G_KK +
#: lambda I)^{-1}`` with its bias unchanged: secateur's ``ls`` solve (COEC Sec. 3.2) with that ridge rule
GRAIL_LAMBDA_REL = 1e-3


@dataclass
class CompensationConfig:
    """How the kept columns are repaired: ``compensation`` (one of :data:`COMPENSATIONS`), ``coec``
    (:class:`secateur.compensate.COECOptions`, None = paper defaults; ``coec_align`` passes the value
    projection to o_proj), ``ls_lambda_rel`` (ridge ``lambda = ls_lambda_rel * mean(diag G_xx)``, baselines.md
    Sec. 6 [A]) and ``no_worse`` (the slice-only fallback of the module docstring)."""

    compensation: str = "none"
    coec: Any = None  # COECOptions (None = paper defaults)
    coec_align: bool = True
    ls_lambda_rel: float = 0.01
    no_worse: bool = True

    def validate(self) -> None:
        if self.compensation not in COMPENSATIONS:
            raise SecateurError(f"unknown compensation {self.compensation!r}; choose from "
                                f"{', '.join(COMPENSATIONS)}")

    @property
    def needs_gram(self) -> bool:
        return self.compensation != "none"


@dataclass
class CompensationOptions(MethodOptions):
    """``--compensation`` and its knobs (every structured method takes them)."""

    CLI_GROUP = "structured pruning (secateur.methods.structured; every default below is None = unset)"

    compensation: str | None = knob("repair o_proj/down_proj after selection (default: the method's own: bias for "
                                    "flap and vbp, rcpu for rcpu, corp for corp, none otherwise; grail: ls with "
                                    "GRAIL's ridge)", choices=COMPENSATIONS)
    coec_stage: str | None = knob("COEC Table 3 preset (cumulative components); the knobs below override it",
                                  choices=COEC_ABLATION_STAGES)
    coec_alpha: float | None = knob("COEC Gram tempering exponent (default 0.9)", type=float)
    coec_no_left: bool | None = knob("COEC without the left rotation", action="store_true")
    coec_rescale: str | None = knob("COEC rescale (default gcv)", choices=("gcv", "global", "none"))
    coec_right: str | None = knob("COEC right rotation solver (default reduced)", choices=("reduced", "full", "none"))
    coec_align: bool | None = knob("COEC anchored alignment on o_proj (default on)", action="boolean_optional")
    coec_rounds: int | None = knob("COEC alternation rounds (default 50)", type=int)
    ls_lambda: float | None = knob("ridge lambda relative to mean(diag G_xx) for --compensation ls (default 0.01)",
                                   type=float)
    no_worse: bool | None = knob("the slice-only fallback (default on)", flag=None, action="store_true")

    @property
    def needs_calibration(self) -> bool:
        return self.compensation not in (None, "none")

    def compensation_fields(self, default: str = "none") -> dict[str, Any]:
        """The :class:`CompensationConfig` fields (``compensation`` unset: ``default``, the method's native one)."""
        coec = coec_ablation_options(self.coec_stage) if self.coec_stage else COECOptions()
        over: dict[str, Any] = {}
        if self.coec_alpha is not None:
            over["alpha"] = float(self.coec_alpha)
        if self.coec_no_left:
            over["left_rotation"] = False
        if self.coec_rescale is not None:
            over["rescale"] = self.coec_rescale
        if self.coec_right is not None:
            over["right_solver"] = self.coec_right
            if self.coec_right == "none" and self.coec_rounds is None:
                over["max_rounds"] = 0
        if self.coec_rounds is not None:
            over["max_rounds"] = int(self.coec_rounds)
        return {"compensation": self.compensation or default, "coec": dataclasses.replace(coec, **over),
                "coec_align": True if self.coec_align is None else bool(self.coec_align),
                "ls_lambda_rel": 0.01 if self.ls_lambda is None else float(self.ls_lambda),
                "no_worse": True if self.no_worse is None else bool(self.no_worse)}

    def compensation_config(self, default: str = "none") -> CompensationConfig:
        return CompensationConfig(**self.compensation_fields(default))


# --- the stage -------------------------------------------------------------------------------------------

def _value_projection(adapter: Adapter, index: int):
    """The dense value projection read by layer ``index``'s o_proj (COEC Sec. 4.5 alignment)."""
    from secateur.compensate import ValueProjection
    from secateur.structured.units import layer_shape

    refs = adapter.role_refs(adapter.layers[index])
    if "v" not in refs:
        return None
    shape = layer_shape(adapter, index)
    return ValueProjection(refs["v"].weight.detach().clone(), shape.n_heads, shape.n_kv_heads)


def _options(cfg: CompensationConfig, group: str, adapter: Adapter, index: int) -> dict:
    if cfg.compensation == "coec":
        opts: dict[str, Any] = {"options": cfg.coec or COECOptions()}
        if group == "attn_out" and cfg.coec_align and opts["options"].lambda_align > 0:
            opts["value"] = _value_projection(adapter, index)
        return opts
    if cfg.compensation == "ls":
        return {"lam_rel": cfg.ls_lambda_rel}
    if cfg.compensation == "grail":
        return {"lam_rel": GRAIL_LAMBDA_REL}
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


def _solve(cfg: CompensationConfig, adapter: Adapter, i: int, group: str, w0, st, kept, bias,
           opts: dict | None = None):
    """One compensator call on projection ``(i, group)``. COEC with ``alpha != 1`` runs as ``alpha = 1`` on the
    tempered Gram ``G^alpha`` (the same computation: ``G^alpha`` is taken before slicing, COEC Alg. 1 l. 1),
    taken here and freed when the call returns: never cached across projections (memory, module docstring)."""
    from secateur.compensate import InputStats, compensate
    from secateur.compensate.base import ReconError
    from secateur.linalg import psd_power

    fn = COMPENSATIONS[cfg.compensation]
    opts = dict(_options(cfg, group, adapter, i) if opts is None else opts)
    if fn != "coec" or opts["options"].alpha == 1.0:
        return compensate(fn, w0, st, kept, bias=bias, **opts)
    alpha = opts["options"].alpha
    g_alpha = psd_power(st.second_moment, alpha)
    opts["options"] = dataclasses.replace(opts["options"], alpha=1.0)
    comp = compensate(fn, w0, InputStats(g_alpha, st.mean, st.n), kept, bias=bias, **opts)
    del g_alpha
    recon = ReconError(w0, st)  # the untempered metric: what the guard and the record compare
    comp.diagnostics.update(alpha=alpha, recon_before=recon.before(kept), recon_after=recon.relative(kept, comp.weight))
    return dataclasses.replace(comp, recon=recon)


def _guarded(cfg: CompensationConfig, comp, rec: dict, w0, st, kept, bias):
    """Apply the no-worse guard to ``comp`` and record the error of what is actually written."""
    from secateur.compensate.base import ReconError

    d = comp.diagnostics
    if cfg.no_worse and d["recon_after"] > d["recon_before"]:
        # [impl] never return a layer worse than the plain slice on the calibration statistics
        rec.update(guard="slice", recon_rejected=d["recon_after"], recon_after=d["recon_before"])
        return dataclasses.replace(comp, weight=w0[:, kept].clone(), bias=None)
    # the weights are cast to the model dtype: report the error of what is actually written
    db = None if comp.bias is None else comp.bias.double() - (
        torch.zeros_like(comp.bias, dtype=torch.float64) if bias is None else bias.double())
    recon = comp.recon if comp.recon is not None else ReconError(w0, st)
    rec["recon_after"] = recon.relative(kept, comp.weight, db)
    return comp


@dataclass(frozen=True)
class _Frozen:
    """What a solve reads of a projection and its block, copied when the block ends (a pipelined solve runs while
    the walk has moved on, and a block read from disk or another device may be gone by then)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    opts: dict

    @classmethod
    def of(cls, cfg: CompensationConfig, adapter: Adapter, i: int, group: str, ref) -> _Frozen:
        return cls(ref.weight.detach().cpu().clone(), None if ref.bias is None else ref.bias.detach().cpu().clone(),
                   _options(cfg, group, adapter, i))


def _compensate_one(cfg: CompensationConfig, adapter: Adapter, i: int, group: str, ref, kept,
                    st) -> tuple[Any, dict]:
    """``(Compensation or None, record)`` of one projection that lost columns (None: nothing kept), from its
    dense input statistics ``st`` (:class:`secateur.compensate.InputStats`; unused when nothing is kept).
    ``ref``: the projection, or its :class:`_Frozen` copy."""
    w0 = ref.weight.detach().cpu()  # compensators solve on the CPU, next to the statistics
    bias = None if ref.bias is None else ref.bias.detach().cpu()
    rec: dict[str, Any] = {"layer": i, "group": group, "kept": int(kept.numel()), "width": int(w0.shape[1])}
    if kept.numel() == 0:  # everything removed: nothing to compensate into
        rec.update(method=COMPENSATIONS[cfg.compensation], recon_before=1.0, recon_after=1.0, seconds=0.0,
                   skipped="no kept columns")
        return None, rec
    t = time.perf_counter()
    comp = _solve(cfg, adapter, i, group, w0, st, kept, bias, opts=ref.opts if isinstance(ref, _Frozen) else None)
    dt = time.perf_counter() - t
    rec.update({k: _summary(comp.diagnostics[k]) for k in _KEEP_DIAG if k in comp.diagnostics}, seconds=dt)
    comp = _guarded(cfg, comp, rec, w0, st, kept, bias)
    # only what slicing reads is kept until the end of the stage (diagnostics may hold solver tensors)
    return dataclasses.replace(comp, diagnostics={}, recon=None), rec


def _to_compensate(adapter: Adapter, sel):
    """``(layer, group, projection ref, kept columns)`` of every projection that lost columns."""
    for i in sorted(sel.layers):
        refs = adapter.role_refs(adapter.layers[i])
        for group, role in GROUP_ROLE.items():
            kept = sel.kept_columns(i, group)
            if kept is not None and kept.numel() != refs[role].weight.shape[1]:
                yield i, group, refs[role], kept


class _Results:
    """The compensations of a stage and their records; with an active checkpoint (``--resume``) every
    compensated projection is saved as it is done (``comp<k>-<layer>-<group>.pt``) and reloaded instead of
    solved again."""

    def __init__(self) -> None:
        from secateur.calib import resume

        self.reps: dict = {}
        self.records: list[dict] = []
        self.ck = resume.current()
        self.stage = self.ck.stage("comp") if self.ck is not None else ""

    def _name(self, i: int, group: str) -> str:
        return f"{self.stage}-{i}-{group}.pt"

    def _saved(self, i: int, group: str) -> bool:
        return self.ck is not None and self.ck.has(self._name(i, group))

    def restore(self, i: int, group: str) -> bool:
        """Reload a checkpointed projection; False when it must be solved."""
        from secateur.compensate.base import Compensation

        name = self._name(i, group)
        if self.ck is None or not self.ck.has(name):
            return False
        got = self.ck.load(name)
        self.reps[(i, group)] = Compensation(got["weight"], got["bias"], got["kept"])
        self.records.append(got["rec"])
        return True

    def add(self, i: int, group: str, comp, rec: dict) -> None:
        self.records.append(rec)
        if comp is None:
            return
        self.reps[(i, group)] = comp
        if self.ck is not None:
            self.ck.save(self._name(i, group), {"weight": comp.weight.clone(), "rec": rec, "kept": comp.kept.clone(),
                                                "bias": None if comp.bias is None else comp.bias.clone()})

    def _pend(self, i: int, group: str) -> str:
        return f"{self.stage}-pend-{i}-{group}.pt"

    def save_pending(self, i: int, group: str, kept: torch.Tensor, st) -> None:
        """The statistics of a projection whose solve is still running when its block is checkpointed."""
        if self.ck is not None and st is not None:
            self.ck.save(self._pend(i, group), {"kept": kept.clone(), "second_moment": st.second_moment,
                                                "mean": st.mean, "n": int(st.n)})

    def load_pending(self, i: int, group: str):
        """:class:`secateur.compensate.InputStats` saved by :meth:`save_pending`, or None."""
        from secateur.compensate import InputStats

        if self.ck is None or not self.ck.has(self._pend(i, group)):
            return None
        got = self.ck.load(self._pend(i, group))
        return InputStats(second_moment=got["second_moment"], mean=got["mean"], n=int(got["n"]))

    def drop_pending(self, i: int, group: str) -> None:
        if self.ck is not None:
            self.ck.delete(self._pend(i, group))

    @property
    def seconds(self) -> float:
        return sum(r.get("seconds", 0.0) for r in self.records)


def compensate_selection(model: nn.Module, adapter: Adapter, sel, stats: StructuredStats,
                         cfg: CompensationConfig) -> tuple[dict, list[dict], float]:
    """Replacements ``{(layer, group): Compensation}`` for every projection that lost columns, the
    per-layer records and the total compensation time (seconds), from statistics that already hold every
    layer's Gram (``stats``, e.g. cached by a benchmark across sparsities: ``L`` Grams in memory, the caller's
    choice; :func:`materialize_selection` without them keeps one block's). Checkpointed like the per-block
    pass (:class:`_Results`)."""
    from secateur.compensate import InputStats

    res = _Results()
    todo = [(i, group, ref, kept) for i, group, ref, kept in _to_compensate(adapter, sel) if not res._saved(i, group)]
    for i, group, _, _ in todo:
        if "gram" not in stats.groups.get(i, {}).get(group, {}):
            raise SecateurError(f"compensation {cfg.compensation!r} needs the input Gram of layer {i} {group}")

    def solve(job):  # on its owner rank (calib.dist.owned_map): every projection's solve in parallel
        i, group, ref, kept = job
        return _compensate_one(cfg, adapter, i, group, ref, kept,
                               InputStats.from_gram(stats.groups[i][group]["gram"]))

    solved = dict(zip([(i, g) for i, g, _, _ in todo], dist_owners("compensation").map(todo, solve), strict=True))
    for i, group, _, _ in _to_compensate(adapter, sel):
        if not res.restore(i, group):
            res.add(i, group, *solved[(i, group)])
    return res.reps, res.records, res.seconds


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



def compensation_details(cfg: CompensationConfig, records: list[dict], seconds: float,
                         memory: dict | None = None) -> dict:
    """The report fields of a compensation stage (shared by every structured method)."""
    return {"statistics_memory": memory,
        "compensation": cfg.compensation, "compensation_seconds": seconds,
        "compensation_summary": _aggregate(records), "per_layer": records,
        "coec_options": None if cfg.compensation != "coec" else _summary(
            {k: str(v) if isinstance(v, torch.dtype) else v for k, v in dataclasses.asdict(cfg.coec).items()}),
        "coec_align": cfg.coec_align if cfg.compensation == "coec" else None,
        "no_worse_guard": cfg.no_worse,
    }
