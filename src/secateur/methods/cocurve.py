"""CoCurve end to end (cocurve.md §7, the paper's Algorithm 2), composed with the structured pipeline.

    inv    = cocurve_inventory(adapter)                       # KV groups + 16 FFN groups per layer
    graph  = build_graph(model, adapter, calib_ids, cfg, inv)  # single-unit sweep -> H (rho-independent)
    result = select(graph, inv, rho, adapter, HeldoutKL(model, heldout_ids), cfg)   # lambda path + KL
    apply_selection(model, adapter, result.selection)          # physical slicing (secateur.structured)

``H`` does not depend on ``rho``: build it once and call :func:`select` for every budget. Units in the
protected layers (first/last two) are never eligible, so by default they are not ablated (their rows of
``H`` are zero); ``ablate_protected=True`` measures them too. ``diagonal=True`` is the lambda = 0 control
(structured KL-Fisher OBD analogue, method ``cocurve-diag``).

Registered methods (``secateur prune --method cocurve|cocurve-diag``): the last ``heldout`` (16) rows
of the calibration set are the disjoint held-out split C', the others build ``H`` - pass
``--nsamples 144`` for the paper's 128 + 16. Method knobs (:class:`CoCurveOptions`): ``heldout``,
``positions`` (P_tok, 128), ``top_r`` (256), ``unit_batch``, ``seqs_per_block``, ``n_ffn_groups`` (16),
``bisect_depth`` (0), ``ablate_protected`` (CLI: ``--heldout``, ``--positions``, ``--top-r``,
``--ffn-groups``). ``--compensation`` (any of the structured pipeline's, with its knobs) runs
after the selection on the dense Grams of the graph windows, then the model is sliced
(:func:`secateur.methods.materialize.materialize_selection`). The output folder gets
``cocurve_graph.npz`` (H, costs, layers, ...), ``cocurve_mask.npz`` (the chosen mask, its lambda and
every candidate) and ``secateur_selection.json``; their sha256 are in the report.
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from secateur.budgets.allocate import Guard, report
from secateur.budgets.greedy import DEFAULT_LAMBDAS, lambda_path
from secateur.budgets.heldout import HeldoutKL, select_heldout
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
from secateur.scoring.cocurve_graph import CoPruningGraph, array_sha256, bytes_sha256
from secateur.scoring.cocurve_sweep import SweepConfig, ablation_sweep
from secateur.structured.selection import Selection
from secateur.structured.units import Inventory, inventory

KINDS = ("kv_group", "ffn_group")


@dataclass(frozen=True)
class CoCurveConfig:
    sweep: SweepConfig = field(default_factory=SweepConfig)
    n_ffn_groups: int = 16
    lambdas: tuple[float, ...] = DEFAULT_LAMBDAS
    bisect_depth: int = 0
    ablate_protected: bool = False
    heldout: int = 16
    protect_first: int = 2
    protect_last: int = 2
    cap_factor: float = 1.5

    def guard(self, rho: float) -> Guard:
        """CoCurve §1: protected first/last layers and per-layer cap ``min(1, 1.5 rho)``."""
        return Guard(protect_first=self.protect_first, protect_last=self.protect_last,
                     cap=min(1.0, self.cap_factor * rho))

    def to_dict(self) -> dict:
        return {"sweep": self.sweep.to_dict(), "n_ffn_groups": self.n_ffn_groups, "lambdas": list(self.lambdas),
                "bisect_depth": self.bisect_depth, "ablate_protected": self.ablate_protected,
                "heldout": self.heldout, "protect_first": self.protect_first, "protect_last": self.protect_last,
                "cap_factor": self.cap_factor, "ffn_grouping": "contiguous"}


def cocurve_inventory(adapter: Adapter, n_ffn_groups: int = 16, ffn_order: dict | None = None) -> Inventory:
    """KV-aligned attention groups + ``n_ffn_groups`` contiguous FFN channel groups per layer ([A1])."""
    return inventory(adapter, KINDS, n_ffn_groups=n_ffn_groups, ffn_order=ffn_order)


def build_graph(model: nn.Module, adapter: Adapter, ids: torch.Tensor, cfg: CoCurveConfig | None = None,
                inv: Inventory | None = None) -> CoPruningGraph:
    """Single-unit ablation sweep over ``ids`` -> the co-pruning graph (checked symmetric PSD)."""
    cfg = cfg or CoCurveConfig()
    inv = inv or cocurve_inventory(adapter, cfg.n_ffn_groups)
    units = None
    if not cfg.ablate_protected:
        prot = cfg.guard(0.0).protected(inv.n_layers)
        units = torch.tensor([int(li) not in prot for li in inv.layer_of.tolist()], dtype=torch.bool)
    t0 = time.perf_counter()
    sw = ablation_sweep(model, adapter, inv, ids, cfg.sweep, units)
    meta = {"config": cfg.to_dict(), "timings": sw.timings, "sweep_wall_s": time.perf_counter() - t0,
            "calibration": {"n": int(ids.shape[0]), "seqlen": int(ids.shape[1]), "sha256": token_sha256(ids)},
            "n_positions": sw.n_positions, "support_mass": sw.support_mass, "n_units": len(inv),
            "n_ablated": int(sw.ablated.sum())}
    g = CoPruningGraph.from_inventory(inv, sw.H, ablated=sw.ablated, kl_single=sw.kl_single, meta=meta)
    g.meta["lambda_min"] = g.check_psd()
    return g


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


def select(graph: CoPruningGraph, inv: Inventory, rho: float, adapter: Adapter | None = None,
           teacher: HeldoutKL | None = None, cfg: CoCurveConfig | None = None, diagonal: bool = False
           ) -> CoCurveSelection:
    """Lambda path + held-out teacher-KL choice (``diagonal``: lambda = 0 only) for budget ``rho``.

    Without a ``teacher`` the path must have a single mask (the diagonal control always does)."""
    cfg = cfg or CoCurveConfig()
    if len(graph) != len(inv):
        raise SecateurError(f"graph has {len(graph)} units, the inventory {len(inv)}")
    guard = cfg.guard(rho)
    t0 = time.perf_counter()
    lams = (0.0,) if diagonal else tuple(cfg.lambdas)
    cands = lambda_path(graph, rho, guard, lams, 0 if diagonal else cfg.bisect_depth)
    t_path = time.perf_counter() - t0
    rows = [{"lambdas": c.lambdas, "lambda": c.lam, "realized": c.realized,
             "surrogate": graph.surrogate(c.removed, c.lam), "removed_units": int(c.removed.sum())} for c in cands]
    chosen, one_se, t_sel = 0, [0], 0.0
    if teacher is not None:
        if adapter is None:
            raise SecateurError("held-out selection needs the adapter")
        t1 = time.perf_counter()
        res = select_heldout(adapter, inv, [c.removed for c in cands], teacher)
        t_sel = time.perf_counter() - t1
        chosen, one_se = res["chosen"], res["one_se_set"]
        for r, kl, se in zip(rows, res["kl"], res["se"]):
            r["heldout_kl"], r["heldout_se"] = kl, se
    elif len(cands) > 1:
        raise SecateurError("the lambda path has several masks: held-out sequences are needed to choose one")
    best = cands[chosen]
    alloc = report(inv, best.removed, rho, allocator="cocurve-diag" if diagonal else "cocurve",
                   guard=vars(guard), lam=best.lam)
    info = {"method": "cocurve-diag" if diagonal else "cocurve", "kinds": list(KINDS), "lambda": best.lam,
            "n_candidates": len(cands), "path_s": t_path, "heldout_s": t_sel,
            "allocation_by_layer": allocation_by_layer(inv, best.removed), **alloc}
    sel = Selection.from_removed(inv, best.removed, info)
    return CoCurveSelection(best.removed, best.lam, sel, rows, chosen, one_se, info)


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
           "selection_info": {k: v for k, v in res.info.items() if k != "allocation_by_layer"}}
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

@dataclass
class CoCurveOptions(CompensationOptions):
    """CoCurve's knobs (and any compensator after its selection)."""

    CLI_GROUP = ("CoCurve (--method cocurve|cocurve-diag; the last --heldout calibration windows choose lambda, the "
                 "others build the graph)")

    heldout: int | None = knob("held-out windows for the lambda choice (default 16)", type=int)
    positions: int | None = knob("sampled positions per graph window (default 128)", type=int)
    top_r: int | None = knob("teacher top-r support of the features (default 256)", type=int)
    n_ffn_groups: int | None = knob("FFN channel groups per layer (default 16)", flag="--ffn-groups", type=int)
    unit_batch: int | None = knob("units ablated per forward (default 8)", flag=None, type=int)
    seqs_per_block: int | None = knob("graph windows per sweep block (default 1)", flag=None, type=int)
    bisect_depth: int | None = knob("lambda-path bisection depth (default 0)", flag=None, type=int)
    ablate_protected: bool | None = knob("also ablate the protected layers' units", flag=None,
                                         action="store_true")


def cocurve_config(opts) -> tuple[CoCurveConfig, CompensationConfig]:
    """CoCurve's configuration and the compensation after it, from ``PruneOptions`` and its
    :class:`CoCurveOptions` (unset knobs: the paper's values)."""
    o: CoCurveOptions = opts.method_options
    sweep = SweepConfig(positions_per_seq=128 if o.positions is None else int(o.positions),
                        top_r=256 if o.top_r is None else int(o.top_r),
                        unit_batch=8 if o.unit_batch is None else int(o.unit_batch),
                        seqs_per_block=1 if o.seqs_per_block is None else int(o.seqs_per_block),
                        progress=not opts.run.quiet)
    cfg = replace(CoCurveConfig(), sweep=sweep, n_ffn_groups=16 if o.n_ffn_groups is None else int(o.n_ffn_groups),
                  bisect_depth=0 if o.bisect_depth is None else int(o.bisect_depth),
                  heldout=16 if o.heldout is None else int(o.heldout), ablate_protected=bool(o.ablate_protected))
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
