"""CoCurve end to end (cocurve.md §7, the paper's Algorithm 2), composed with the structured pipeline.

    inv    = cocurve_inventory(adapter)                       # KV groups + 16 FFN groups per layer
    graph  = build_graph(model, adapter, calib_ids, cfg, inv)  # single-unit sweep -> H (rho-independent)
    result = select(graph, inv, rho, adapter, HeldoutKL(model, heldout_ids), cfg)   # lambda family + KL
    apply_selection(model, adapter, result.selection)          # physical slicing (secateur.structured)

``H`` does not depend on ``rho``: build it once and call :func:`select` for every budget. Units in the
protected layers (first/last two) are never eligible, so by default they are not ablated (their rows of
``H`` are zero); ``ablate_protected=True`` measures them too. ``diagonal=True`` is the lambda = 0 control
(structured KL-Fisher OBD analogue, method ``cocurve-diag``).

Selection (issue 45). The candidate family is the paper's breakpoint family (its Proposition 7): every distinct
greedy mask for lambda in [0, 1], found at the exact breakpoints where a step's choice changes
(:func:`secateur.budgets.greedy.breakpoint_path`; ``family='grid'``: the earlier 22-value grid); at most
``max_candidates`` (32) of them are measured, the lambda = 0 mask and the widest pieces of the path. Each is scored
by full-vocabulary teacher KL on the held-out windows, per sequence, and chosen by the paired one-SE rule against
the diagonal (:func:`secateur.budgets.heldout.paired_choice`: a lambda > 0 only when its mean KL is below the
diagonal's by more than the SE of the per-sequence differences; ``choice='min'``: the plain argmin). Every
candidate's per-sequence KLs, paired difference and paired SE are in the report's ``candidates``.
``split='fixed'`` is the paper's fixed-split arm ("edges, fixed split", its Table 29): the diagonal mask's numbers
of attention and FFN units are held, the edges only reorder units within each kind (same counts, so the same
budget as the diagonal for uniform per-kind unit costs; ``budget_vs_diagonal`` in the report states it in units).

Split-half diagnostic: the sweep also builds ``H`` from the even and the odd graph windows; the agreement of their
diagonals (Spearman) and normalized edges (Pearson), and at the chosen mask of their per-unit edge sums, is in the
report (``split_half``, :mod:`secateur.scoring.cocurve_graph`); below ``EDGE_AGREEMENT_MIN`` (0.5) ``--method
cocurve`` prints one ``secateur: note:`` line that the edge term is not to be trusted.

Registered methods (``secateur prune --method cocurve|cocurve-diag``): the last ``heldout`` (16) rows
of the calibration set are the disjoint held-out split C', the others build ``H`` - pass
``--nsamples 144`` for the paper's 128 + 16. Method knobs (:class:`CoCurveOptions`): ``heldout``,
``positions`` (``all`` by default; N: the paper's evenly spaced subsample, 128), ``top_r`` (256),
``cocurve_lambdas`` (breakpoints | grid), ``cocurve_max_candidates`` (32; 0: all), ``cocurve_split`` (joint |
fixed), ``cocurve_choice`` (paired | min), ``unit_batch``, ``seqs_per_block``, ``n_ffn_groups`` (16),
``bisect_depth`` (0, grid only), ``ablate_protected`` (CLI: ``--heldout``, ``--positions``, ``--top-r``,
``--ffn-groups``, ``--cocurve-lambdas``, ``--cocurve-max-candidates``, ``--cocurve-split``). ``--compensation``
(any of the structured pipeline's, with its knobs) runs after the selection on the dense Grams of the graph
windows, then the model is sliced (:func:`secateur.methods.materialize.materialize_selection`). The output folder
gets ``cocurve_graph.npz`` (H, its two halves, costs, layers, ...), ``cocurve_mask.npz`` (the chosen mask, its
lambda and every candidate) and ``secateur_selection.json``; their sha256 are in the report. Before the sweep its
memory plan (:func:`secateur.scoring.cocurve_sweep.memory_plan`: hidden states, teacher, the per-unit features,
logits, ...) is checked against the memory available and kept in the graph's ``meta``.
"""

from __future__ import annotations

import io
import json
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from secateur.budgets.allocate import Guard, report
from secateur.budgets.greedy import (
    DEFAULT_LAMBDAS,
    FAMILIES,
    breakpoint_path,
    conditional_greedy,
    kind_counts,
    lambda_path,
)
from secateur.budgets.heldout import RULES, HeldoutKL, select_heldout
from secateur.calib import dist
from secateur.data.windows import token_sha256
from secateur.errors import SecateurError
from secateur.methods.knobs import knob
from secateur.methods.materialize import (
    CompensationConfig,
    CompensationOptions,
    compensation_details,
    materialize_selection,
)
from secateur.methods.result import MethodResult
from secateur.models.adapters import Adapter
from secateur.models.blocks import RESIDENT, Blocks
from secateur.scoring.cocurve_graph import (
    CoPruningGraph,
    array_sha256,
    bytes_sha256,
    mask_edge_agreement,
    split_half_agreement,
)
from secateur.scoring.cocurve_sweep import SweepConfig, ablation_sweep, memory_plan
from secateur.structured.selection import Selection
from secateur.structured.units import Inventory, inventory

KINDS = ("kv_group", "ffn_group")
SPLITS = ("joint", "fixed")
MAX_CANDIDATES = 32


@dataclass(frozen=True)
class CoCurveConfig:
    sweep: SweepConfig = field(default_factory=SweepConfig)
    n_ffn_groups: int = 16
    family: str = "breakpoints"  # the lambda family: breakpoints (Prop. 7) | grid (``lambdas`` + bisection)
    lambdas: tuple[float, ...] = DEFAULT_LAMBDAS
    bisect_depth: int = 0
    max_candidates: int | None = MAX_CANDIDATES  # breakpoint family: most masks measured (None: all)
    choice: str = "paired"  # held-out rule: paired one-SE against lambda = 0 | min
    split: str = "joint"  # joint | fixed (the diagonal's attention/FFN counts held)
    ablate_protected: bool = False
    heldout: int = 16
    protect_first: int = 2
    protect_last: int = 2
    cap_factor: float = 1.5
    deploy: str | None = None  # "vllm": every candidate mask keeps the same query heads per layer (equal_heads)

    def validate(self) -> None:
        if self.family not in FAMILIES:
            raise SecateurError(f"unknown lambda family {self.family!r}; choose from {', '.join(FAMILIES)}")
        if self.split not in SPLITS:
            raise SecateurError(f"unknown CoCurve split {self.split!r}; choose from {', '.join(SPLITS)}")
        if self.choice not in RULES:
            raise SecateurError(f"unknown CoCurve choice {self.choice!r}; choose from {', '.join(RULES)}")
        if self.max_candidates is not None and self.max_candidates < 1:
            raise SecateurError("the lambda family's max_candidates must be >= 1 (or None: all)")
        if self.family == "breakpoints" and self.bisect_depth:
            raise SecateurError("bisect_depth refines the lambda grid; the breakpoint family is exact already")
        if self.deploy not in (None, "vllm"):
            raise SecateurError(f"--deploy takes vllm, not {self.deploy!r}")

    def guard(self, rho: float) -> Guard:
        """CoCurve §1: protected first/last layers and per-layer cap ``min(1, 1.5 rho)``."""
        return Guard(protect_first=self.protect_first, protect_last=self.protect_last,
                     cap=min(1.0, self.cap_factor * rho))

    def to_dict(self) -> dict:
        return {"sweep": self.sweep.to_dict(), "n_ffn_groups": self.n_ffn_groups, "family": self.family,
                "lambdas": list(self.lambdas), "bisect_depth": self.bisect_depth,
                "max_candidates": self.max_candidates, "choice": self.choice, "split": self.split,
                "ablate_protected": self.ablate_protected,
                "heldout": self.heldout, "protect_first": self.protect_first, "protect_last": self.protect_last,
                "cap_factor": self.cap_factor, "ffn_grouping": "contiguous"} \
            | ({"deploy": self.deploy} if self.deploy else {})


def cocurve_inventory(adapter: Adapter, n_ffn_groups: int = 16, ffn_order: dict | None = None) -> Inventory:
    """KV-aligned attention groups + ``n_ffn_groups`` contiguous FFN channel groups per layer ([A1])."""
    return inventory(adapter, KINDS, n_ffn_groups=n_ffn_groups, ffn_order=ffn_order)


def build_graph(model: nn.Module, adapter: Adapter, ids: torch.Tensor, cfg: CoCurveConfig | None = None,
                inv: Inventory | None = None) -> CoPruningGraph:
    """Single-unit ablation sweep over ``ids`` -> the co-pruning graph (checked symmetric PSD), with its memory plan
    (checked against the memory available first) and split-half diagnostic in ``meta``."""
    cfg = cfg or CoCurveConfig()
    inv = inv or cocurve_inventory(adapter, cfg.n_ffn_groups)
    units = None
    if not cfg.ablate_protected:
        prot = cfg.guard(0.0).protected(inv.n_layers)
        units = torch.tensor([int(li) not in prot for li in inv.layer_of.tolist()], dtype=torch.bool)
    n_ablated = len(inv) if units is None else int(units.sum())
    plan = memory_plan(model, adapter, len(inv), n_ablated, int(ids.shape[-1]), cfg.sweep)
    if cfg.sweep.progress and dist.rank_world()[0] == 0:
        print(f"[cocurve] {plan.describe()}", flush=True)
    if next(model.parameters()).device.type == "cpu":  # on an accelerator most of it is the device's memory
        plan.check()
    t0 = time.perf_counter()
    sw = ablation_sweep(model, adapter, inv, ids, cfg.sweep, units)
    meta = {"config": cfg.to_dict(), "timings": sw.timings, "sweep_wall_s": time.perf_counter() - t0,
            "calibration": {"n": int(ids.shape[0]), "seqlen": int(ids.shape[1]), "sha256": token_sha256(ids)},
            "n_positions": sw.n_positions, "support_mass": sw.support_mass, "n_units": len(inv),
            "n_ablated": int(sw.ablated.sum()),
            "memory_plan": {"total": plan.total, **{k: {"bytes": b, "how": how} for k, (b, how) in plan.terms.items()}}}
    g = CoPruningGraph.from_inventory(inv, sw.H, ablated=sw.ablated, kl_single=sw.kl_single, meta=meta,
                                      halves=sw.halves)
    g.meta["lambda_min"] = g.check_psd()
    g.meta["split_half"] = graph_split_half(g, sw.half_positions)
    if sw.sub_halves is not None:  # SweepConfig.subsample_check: the same diagnostic on fewer positions
        g.meta["split_half_subsample"] = {"positions_per_window": sw.sub_positions,
                                          **split_half_agreement(*sw.sub_halves, g.ablated)}
    return g


def graph_split_half(graph: CoPruningGraph, half_positions: tuple[int, int] | None = None) -> dict:
    """The graph's split-half agreement (:func:`secateur.scoring.cocurve_graph.split_half_agreement`) over its
    measured units, or why there is none."""
    if graph.halves is None:
        return {"available": False, "why": "fewer than 2 graph windows (or a resumed block without its halves)"}
    out = {"available": True, **split_half_agreement(*graph.halves, graph.ablated)}
    if half_positions is not None:
        out["positions"] = list(half_positions)
    return out


def allocation_by_layer(inv: Inventory, removed: torch.Tensor) -> dict[int, dict]:
    """Per layer: removed / total attention units and FFN groups."""
    out: dict[int, dict] = {}
    for p in inv.pools:
        d = out.setdefault(p.layer, {"attn_removed": 0, "attn_units": 0, "ffn_removed": 0, "ffn_units": 0})
        key = "attn" if p.kind in ("kv_group", "head") else "ffn"
        d[f"{key}_units"] += p.n
        d[f"{key}_removed"] += int(removed[p.offset:p.offset + p.n].sum())
    return out


@dataclass
class CoCurveSelection:
    removed: torch.Tensor
    lam: float
    selection: Selection
    candidates: list[dict]
    chosen: int
    one_se_set: list[int]
    info: dict


def candidate_family(graph: CoPruningGraph, rho: float, cfg: CoCurveConfig, diagonal: bool = False,
                     guard: Guard | None = None) -> tuple[list, dict]:
    """The candidate masks for budget ``rho`` (the first is always the lambda = 0 mask) and how they were found
    (``guard``: default ``cfg.guard(rho)``; a VLM's joint graph protects each tower's first and last layers)."""
    guard = guard or cfg.guard(rho)
    if diagonal:
        return lambda_path(graph, rho, guard, (0.0,)), {"family": "diagonal"}
    quota = None
    info: dict = {}
    if cfg.split == "fixed":
        quota = kind_counts(graph, conditional_greedy(graph, rho, 0.0, guard).removed)
        info["fixed_split"] = {"attn_units": quota[0], "ffn_units": quota[1]}
    if cfg.family == "breakpoints":
        cands, fam = breakpoint_path(graph, rho, guard, quota=quota, max_candidates=cfg.max_candidates)
    else:
        cands = lambda_path(graph, rho, guard, tuple(cfg.lambdas), cfg.bisect_depth, quota=quota)
        fam = {"family": "grid", "lambdas": list(cfg.lambdas), "bisect_depth": cfg.bisect_depth,
               "distinct_masks": len(cands), "evaluated": len(cands)}
    return cands, {**fam, **info}


def select(graph: CoPruningGraph, inv: Inventory, rho: float, adapter: Adapter | None = None,
           teacher: HeldoutKL | None = None, cfg: CoCurveConfig | None = None, diagonal: bool = False,
           guard: Guard | None = None, masker=None) -> CoCurveSelection:
    """Lambda family + held-out teacher-KL choice (``diagonal``: lambda = 0 only) for budget ``rho``.

    Without a ``teacher`` the family must have a single mask (the diagonal control always does). ``guard``: default
    ``cfg.guard(rho)``; ``masker(removed)``: the context in which ``teacher.evaluate()`` sees a mask (default the
    adapter's column masks, :func:`secateur.budgets.heldout.masked`; a VLM's joint inventory masks both towers)."""
    cfg = cfg or CoCurveConfig()
    cfg.validate()
    if len(graph) != len(inv):
        raise SecateurError(f"graph has {len(graph)} units, the inventory {len(inv)}")
    guard = guard or cfg.guard(rho)
    t0 = time.perf_counter()
    cands, fam = candidate_family(graph, rho, cfg, diagonal, guard)
    costs = graph.costs
    deployed = {}
    if cfg.deploy is not None:  # every candidate made servable before the held-out choice measures it
        from secateur.budgets.allocate import equal_heads

        for c in cands:
            c.removed, deployed = equal_heads(inv, c.removed, graph.diag, guard)
            c.realized = int(costs[c.removed].sum()) / int(costs.sum())
    t_path = time.perf_counter() - t0
    rows = []
    for c in cands:
        na, nf = kind_counts(graph, c.removed)
        row = {"lambdas": c.lambdas, "lambda": c.lam, "realized": c.realized,
               "surrogate": graph.surrogate(c.removed, c.lam), "removed_units": int(c.removed.sum()),
               "removed_params": int(costs[c.removed].sum()), "attn_units": na, "ffn_units": nf}
        if c.intervals:
            row["intervals"], row["measure"] = [list(iv) for iv in c.intervals], c.measure
        rows.append(row)
    chosen, one_se, t_sel, choice = 0, [0], 0.0, {"rule": cfg.choice, "chosen": 0, "best": 0}
    if teacher is not None:
        if adapter is None and masker is None:
            raise SecateurError("held-out selection needs the adapter")
        t1 = time.perf_counter()
        res = select_heldout(adapter, inv, [c.removed for c in cands], teacher, rule=cfg.choice, masker=masker)
        t_sel = time.perf_counter() - t1
        chosen, one_se = res["chosen"], res["one_se_set"]
        p = res["paired"]
        for k, r in enumerate(rows):
            r["heldout_kl"], r["heldout_se"] = res["kl"][k], res["se"][k]
            r["heldout_per_sequence"] = res["per_sequence"][k]
            r["paired_diff"], r["paired_se"] = p["diff"][k], p["paired_se"][k]
            r["beats_diagonal"] = p["beats_reference"][k]
        choice = {"rule": cfg.choice, "chosen": chosen, "best": res["best"], "reference": 0,
                  "n_sequences": len(res["per_sequence"][0])}
        if cfg.choice == "paired":
            choice["paired_rule"] = "lambda > 0 only if its mean KL - the diagonal's < -(SE of the differences)"
    elif len(cands) > 1:
        raise SecateurError("the lambda family has several masks: held-out sequences are needed to choose one")
    best = cands[chosen]
    name = "cocurve-diag" if diagonal else "cocurve"
    alloc = report(inv, best.removed, rho, allocator=name, guard=vars(guard), lam=best.lam)
    diff = int(costs[best.removed].sum()) - int(costs[cands[0].removed].sum())
    info = {"method": name, "kinds": list(KINDS), "lambda": best.lam, "n_candidates": len(cands),
            "lambda_family": fam, "split": "fixed" if cfg.split == "fixed" and not diagonal else "joint",
            "choice": choice, "path_s": t_path, "heldout_s": t_sel,
            "budget_vs_diagonal": {"removed_params": diff, "units": diff / int(costs.max())},
            "split_half": chosen_split_half(graph, best.removed),
            "allocation_by_layer": allocation_by_layer(inv, best.removed), **alloc,
            **{k: v for k, v in deployed.items() if k != "undeployed_realized"}}
    sel = Selection.from_removed(inv, best.removed, info)
    return CoCurveSelection(best.removed, best.lam, sel, rows, chosen, one_se, info)


def chosen_split_half(graph: CoPruningGraph, removed: torch.Tensor) -> dict:
    """The graph's split-half agreement plus, at the chosen mask, that of its per-unit edge sums."""
    out = dict(graph.meta.get("split_half") or graph_split_half(graph))
    if graph.halves is not None:
        out["at_chosen_mask"] = mask_edge_agreement(*graph.halves, graph.H, removed)
    return out


def split_half_note(info: dict) -> str | None:
    """The one line saying the edge term is not to be trusted (None when the halves agree or are unknown)."""
    sh = info.get("split_half") or {}
    if not sh.get("available") or sh.get("edges_trusted"):
        return None
    r = sh.get("edge_pearson")
    at = (sh.get("at_chosen_mask") or {}).get("edge_sum_pearson")
    tail = f"; at the chosen mask (lambda {info['lambda']:g}) their edge sums agree with Pearson {at:.2f}" \
        if at is not None else ""
    return (f"CoCurve's graph edges disagree between the two halves of the graph windows (normalized edges: Pearson "
            f"{'undefined' if r is None else f'{r:.2f}'} < {sh['threshold']}{tail}): the edge term (lambda > 0) is not "
            "to be trusted; more graph windows (--nsamples) or every position (--positions all) steady it")


def mask_bytes(result: CoCurveSelection, candidates: list[torch.Tensor] | None = None) -> bytes:
    buf = io.BytesIO()
    arrays = {"removed": result.removed.numpy(), "lambda": np.array(result.lam),
              "candidate_lambdas": np.array([c["lambda"] for c in result.candidates])}
    if candidates is not None:
        arrays["candidates"] = torch.stack(candidates).numpy()
    np.savez(buf, **arrays)
    return buf.getvalue()


def artifacts(graph: CoPruningGraph, result: CoCurveSelection) -> tuple[dict[str, bytes], dict]:
    """Files for the output folder and their hashes (``H_sha256`` hashes H's values, stable across saves)."""
    gb, mb = graph.to_bytes(), mask_bytes(result)
    sb = json.dumps(result.selection.to_dict(), indent=1).encode()
    files = {"cocurve_graph.npz": gb, "cocurve_mask.npz": mb, "secateur_selection.json": sb}
    hashes = {name: bytes_sha256(b) for name, b in files.items()}
    hashes["H_sha256"] = array_sha256(graph.H)
    hashes["mask_sha256"] = array_sha256(result.removed)
    return files, hashes


def prune(model: nn.Module, adapter: Adapter, calib_ids: torch.Tensor, heldout_ids: torch.Tensor | None,
          rho: float, cfg: CoCurveConfig | None = None, *, diagonal: bool = False,
          graph: CoPruningGraph | None = None, materialize: str = "slice", out_dir: str | Path | None = None,
          tokenizer=None, overwrite: bool = False) -> dict:
    """Graph (unless given) -> selection -> ``materialize`` (``slice`` | ``mask`` | ``none``) -> optional
    export to ``out_dir`` (structured ``save_pruned`` + the CoCurve artifacts). Returns the report."""
    from secateur.structured.slicing import apply_selection, mask_selection

    cfg = cfg or CoCurveConfig()
    inv = cocurve_inventory(adapter, cfg.n_ffn_groups)
    t0 = time.perf_counter()
    if graph is None:
        graph = build_graph(model, adapter, calib_ids, cfg, inv)
    t_graph = time.perf_counter() - t0
    teacher = HeldoutKL(model, heldout_ids) if heldout_ids is not None else None
    res = select(graph, inv, rho, adapter, teacher, cfg, diagonal)
    files, hashes = artifacts(graph, res)
    if materialize == "slice":
        apply_selection(model, adapter, res.selection)
    elif materialize == "mask":
        mask_selection(model, adapter, res.selection)
    elif materialize != "none":
        raise SecateurError(f"materialize must be slice, mask or none, not {materialize!r}")
    rep = {"method": res.info["method"], "rho": rho, "lambda": res.lam, "realized": res.info["realized"],
           "candidates": res.candidates, "chosen": res.chosen, "one_se_set": res.one_se_set,
           "graph": {k: v for k, v in graph.meta.items() if k != "config"}, "config": cfg.to_dict(),
           "graph_s": t_graph, "hashes": hashes, "allocation_by_layer": res.info["allocation_by_layer"],
           "selection_info": {k: v for k, v in res.info.items() if k != "allocation_by_layer"},
           "split_half": res.info["split_half"], "split_half_note": None if diagonal else split_half_note(res.info)}
    if out_dir is not None:
        if materialize != "slice":
            raise SecateurError("export needs materialize='slice'")
        from secateur.export.sliced import save_pruned

        # the report and the artifacts go inside the same atomic folder: an interrupted export leaves nothing
        saved = save_pruned(model, out_dir, tokenizer, overwrite=overwrite,
                            extra_files={"cocurve_report.json": json.loads(json.dumps(rep, default=str)), **files})
        rep["export"] = saved
    rep["_result"] = res
    rep["_graph"] = graph
    rep["_files"] = files  # the exact bytes whose sha256 are in rep["hashes"]
    return rep


# --- the registered methods (--method cocurve|cocurve-diag) ---------------------------------------------------

def positions_value(v) -> int | str:
    """``--positions``: ``all`` or a whole number >= 1 (evenly spaced positions per graph window)."""
    if isinstance(v, str) and v.strip().lower() == "all":
        return "all"
    if isinstance(v, bool) or isinstance(v, float) and not v.is_integer():
        raise SecateurError(f"--positions: {v!r} is not 'all' or a whole number; pass e.g. all or 128")
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise SecateurError(f"--positions: {v!r} is not 'all' or a whole number; pass e.g. all or 128") from None
    if n < 1:
        raise SecateurError(f"--positions must be 'all' or >= 1, not {n}")
    return n


@dataclass
class CoCurveOptions(CompensationOptions):
    """CoCurve's knobs (and any compensator after its selection)."""

    CLI_GROUP = ("CoCurve (--method cocurve|cocurve-diag; the last --heldout calibration windows choose lambda, the "
                 "others build the graph)")

    heldout: int | None = knob("held-out windows for the lambda choice (default 16)", type=int)
    positions: int | str | None = knob("positions of each graph window whose features enter H: all (default) or N "
                                       "evenly spaced (the paper: 128)", type=positions_value, metavar="all|N",
                                       example="all")
    top_r: int | None = knob("teacher top-r support of the features (default 256)", type=int)
    n_ffn_groups: int | None = knob("FFN channel groups per layer (default 16)", flag="--ffn-groups", type=int)
    unit_batch: int | None = knob("units ablated per forward (default 8)", flag=None, type=int)
    seqs_per_block: int | None = knob("graph windows per sweep block (default 1)", flag=None, type=int)
    bisect_depth: int | None = knob("lambda-grid bisection depth (default 0; --cocurve-lambdas grid)", flag=None,
                                    type=int)
    ablate_protected: bool | None = knob("also ablate the protected layers' units", flag=None,
                                         action="store_true")
    # issue 45 (declared last: the options record of runs before keeps its order)
    cocurve_lambdas: str | None = knob("lambda family: breakpoints (every distinct greedy mask on [0, 1], the paper's "
                                       "Prop. 7; default) or grid (22 values)", choices=FAMILIES)
    cocurve_max_candidates: int | None = knob(f"most masks of the breakpoint family measured on the held-out windows "
                                              f"(default {MAX_CANDIDATES}; 0: all)", type=int,
                                              metavar="N")
    cocurve_split: str | None = knob("joint (default) or fixed: the diagonal's attention/FFN unit counts held, the "
                                     "edges reorder units within each kind (the paper's fixed-split arm)",
                                     choices=SPLITS)
    cocurve_choice: str | None = knob("held-out rule: paired (default; lambda > 0 only if it beats lambda = 0 by "
                                      "more than its paired SE) or min", flag=None, choices=RULES)
    deploy: str | None = knob("vllm: every candidate mask keeps the same query heads in every layer that keeps "
                              "attention (vLLM's DeciLM; secateur export vllm), the FFN groups making up the budget",
                              choices=("vllm",))
    # issue 47 (API only): the guard, for small models (a tiny VLM's towers) and ablations of the paper's guard
    cocurve_protect: int | None = knob("layers protected at each end of the model (of each tower of a VLM); default 2",
                                       flag=None, type=int)
    cocurve_cap: float | None = knob("per-layer removal cap as a multiple of the budget, at most 1 (default 1.5)",
                                     flag=None, type=float)
    cocurve_graph: str | None = knob("a cocurve_graph.npz of a --towers joint run on the same VLM and pairs, reused "
                                     "instead of the sweep (H does not depend on the budget)", flag=None, type=str)


def cocurve_config(opts) -> tuple[CoCurveConfig, CompensationConfig]:
    """CoCurve's configuration and the compensation after it, from ``PruneOptions`` and its
    :class:`CoCurveOptions` (unset knobs: the paper's values)."""
    o: CoCurveOptions = opts.method_options
    pos = None if o.positions in (None, "all") else int(o.positions)
    sweep = SweepConfig(positions_per_seq=pos,
                        top_r=256 if o.top_r is None else int(o.top_r),
                        unit_batch=8 if o.unit_batch is None else int(o.unit_batch),
                        seqs_per_block=1 if o.seqs_per_block is None else int(o.seqs_per_block),
                        progress=not opts.run.quiet)
    if o.cocurve_max_candidates is not None and o.cocurve_max_candidates < 0:
        raise SecateurError("--cocurve-max-candidates must be >= 0 (0: every mask of the breakpoint family)")
    family = o.cocurve_lambdas or "breakpoints"
    if family == "breakpoints" and o.bisect_depth:
        raise SecateurError("bisect_depth refines the lambda grid: pass --cocurve-lambdas grid with it")
    cfg = replace(CoCurveConfig(), sweep=sweep, n_ffn_groups=16 if o.n_ffn_groups is None else int(o.n_ffn_groups),
                  bisect_depth=0 if o.bisect_depth is None else int(o.bisect_depth),
                  heldout=16 if o.heldout is None else int(o.heldout), ablate_protected=bool(o.ablate_protected),
                  family=family, split=o.cocurve_split or "joint", choice=o.cocurve_choice or "paired",
                  max_candidates=MAX_CANDIDATES if o.cocurve_max_candidates is None
                  else int(o.cocurve_max_candidates) or None, deploy=getattr(o, "deploy", None))
    if o.cocurve_protect is not None:
        if int(o.cocurve_protect) < 0:
            raise SecateurError(f"cocurve_protect must be >= 0 layers, not {o.cocurve_protect}")
        cfg = replace(cfg, protect_first=int(o.cocurve_protect), protect_last=int(o.cocurve_protect))
    if o.cocurve_cap is not None:
        if not float(o.cocurve_cap) > 0:
            raise SecateurError(f"cocurve_cap must be > 0 (a multiple of the budget), not {o.cocurve_cap}")
        cfg = replace(cfg, cap_factor=float(o.cocurve_cap))
    cfg.validate()
    ccfg = o.compensation_config()
    ccfg.validate()
    return cfg, ccfg


def _compensate(model, adapter, selection, ccfg: CompensationConfig, graph_ids, opts) -> tuple[dict, dict]:
    """Any compensator after CoCurve's selection: dense Grams of the graph windows (one block's at a time), then
    slice. Returns the report fields and the timings."""
    records, timings, memory = materialize_selection(model, adapter, selection, ccfg, None, graph_ids,
                                                     chunk_size=opts.run.chunk_size, progress=not opts.run.quiet)
    timings["comp_stats_s"] = timings.pop("gram_pass_s")
    return compensation_details(ccfg, records, timings["compensation_s"], memory), timings


def run(name: str, model: nn.Module, adapter: Adapter, calib_ids: torch.Tensor, opts,
        blocks: Blocks = RESIDENT) -> MethodResult:
    """``secateur prune --method cocurve|cocurve-diag``: slice in place; artifacts travel as extra files.

    The in-memory model's config is replaced by its export config (stock or heterogeneous, see
    :mod:`secateur.export.sliced`) so that the generic saver writes a folder that one
    ``from_pretrained`` reloads (``blocks``: in memory only, see :data:`secateur.methods.structured.REFUSED`)."""
    from secateur.export.sliced import export_config
    from secateur.models import hetero

    blocks.resident_only(f"--method {name}")
    if opts.method_options.cocurve_graph is not None:
        raise SecateurError("cocurve_graph reuses a vision-language model's joint graph (--towers joint); drop it")
    cfg, ccfg = cocurve_config(opts)
    n = calib_ids.shape[0]
    if n <= cfg.heldout:
        raise SecateurError(f"{name} holds out the last {cfg.heldout} calibration sequences for the lambda choice: "
                            f"pass --nsamples > {cfg.heldout} (the paper: {128 + cfg.heldout})")
    graph_ids, held = calib_ids[:n - cfg.heldout], calib_ids[n - cfg.heldout:]
    compensate = ccfg.compensation != "none"
    n_before = sum(p.numel() for p in model.parameters())
    rep = prune(model, adapter, graph_ids, held, opts.sparsity, cfg, diagonal=name == "cocurve-diag",
                materialize="none" if compensate else "slice")
    result = rep.pop("_result")
    rep.pop("_graph")
    files: dict[str, bytes] = rep.pop("_files")
    if rep["split_half_note"] and not opts.run.quiet and dist.rank_world()[0] == 0:
        print(f"secateur: note: {rep['split_half_note']}", file=sys.stderr)
    comp_timings: dict[str, float] = {}
    if compensate:
        fields, comp_timings = _compensate(model, adapter, result.selection, ccfg, graph_ids, opts)
        rep.update(fields)
    n_after = sum(p.numel() for p in model.parameters())  # sliced in place (tied weights once)
    rep["realized_sparsity"] = result.selection.realized_sparsity(n_before, n_after)
    cfg_out, route = export_config(model)
    model.config = cfg_out
    if route == "hetero":
        files["secateur_hetero.py"] = hetero.standalone_source(adapter.family).encode()
    rep["export_route"] = route
    rep["heldout_sha256"] = token_sha256(held)
    timings = {"graph_s": rep["graph_s"], **{f"sweep_{k}": v for k, v in rep["graph"]["timings"].items()
                                             if isinstance(v, (int, float))}, **comp_timings}
    return MethodResult(masks={}, timings=timings, details=rep, extra_files=files)
