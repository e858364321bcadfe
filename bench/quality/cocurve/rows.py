"""CoCurve bench, the row stages: masks-only rows (CoCurve, its diagonal control, baselines), COEC rows, zero-shot."""

from __future__ import annotations

import copy
import dataclasses
import time
from types import SimpleNamespace

import torch

from bench.common import (
    append_row,
    calib_tokens,
    merge_row_field,
    read_rows,
    zeroshot_cell,
)
from bench.quality.cocurve import base as run
from bench.quality.cocurve.base import (
    COEC_METHODS,
    COEC_OPTS,
    COMP_CALIB,
    PRESETS,
    _disjoint,
    config,
    corpora_ids,
    data,
    graph_path,
    load,
    out_dir,
    splits,
)


def _alloc(inv, removed) -> dict:
    from secateur.methods.cocurve import allocation_by_layer

    a = allocation_by_layer(inv, removed)
    return {"attn": [a[i]["attn_removed"] for i in sorted(a)], "ffn": [a[i]["ffn_removed"] for i in sorted(a)],
            "attn_units": a[0]["attn_units"], "ffn_units": a[0]["ffn_units"]}


def _ppl(model, corpora_ids: dict, windows, p: dict | None = None, only: list[str] | None = None) -> dict:
    """Perplexity at the preset's protocol (sliding 2048/512 unless it names ``ppl_seqlen`` / ``ppl_stride``;
    stride None: non-overlapping windows), the first ``windows`` windows (None: every window); ``only``: these
    corpora."""
    from secateur.eval.ppl import perplexity

    p = p or {}
    out = {}
    for name, ids in corpora_ids.items():
        if only is not None and name not in only:
            continue
        r = perplexity(model, ids, seqlen=p.get("ppl_seqlen", 2048), stride=p.get("ppl_stride", 512),
                       max_windows=windows, progress=False)
        out[name] = {"ppl": r["ppl"], "windows": r["windows"], "scored": r["scored_tokens"], "s": r["seconds"],
                     "protocol": r.get("protocol")}
    return out


def _wants(p: dict, key: str, method: str, rho: float) -> bool:
    """Whether the preset's list ``key`` ("method" or "method@rho" entries) names this row."""
    return any(x == method if "@" not in x else x == f"{method}@{rho:g}" for x in p.get(key, ()))


def _wants_full_ppl(p: dict, method: str, rho: float) -> bool:
    """Rows the preset measures on every perplexity window too (``full_ppl``: "dense", "method@rho")."""
    if p["ppl_windows"] is None:  # its ppl column is already every window
        return False
    return _wants(p, "full_ppl", method, rho)


def _baseline_removed(method: str, inv, adapter, stats, rho: float, guard) -> tuple[torch.Tensor, bool]:
    """A baseline's mask under the shared inventory, guard and budget; ``stats`` = sumsq + meanvar of the graph
    windows (Wanda-sp, FLAP). Returns (removed, cost_normalized)."""
    from secateur.budgets.allocate import allocate_global
    from secateur.scoring.structured import flap_alam_scores, unit_scores

    if method == "wanda_sp":
        scores, norm = unit_scores(inv, adapter, "wanda_sp", stats), True
    elif method == "flap":
        scores, norm = flap_alam_scores(inv, adapter, stats), False
    elif method == "magnitude":
        scores, norm = unit_scores(inv, adapter, "magnitude_unit"), True
    elif method == "random":
        scores, norm = unit_scores(inv, adapter, "random", seed=0), False
    else:
        raise ValueError(f"not a baseline: {method}")
    return allocate_global(inv, scores, rho, guard=guard, cost_normalized=norm).removed, norm


def _row_removed(row: dict, inv, adapter, stats, guard) -> torch.Tensor:
    """The mask of a results row, rebuilt (CoCurve rows: their saved mask) and checked against its sha256."""
    from secateur.scoring.cocurve_graph import array_sha256

    m, rho = row["method"], row["rho"]
    if m.startswith("cocurve"):
        removed = torch.load(out_dir(row["preset"], m, rho) / "cocurve_mask.pt")["removed"]
    else:
        removed = _baseline_removed(m, inv, adapter, stats, rho, guard)[0]
    if array_sha256(removed) != row["mask_sha256"]:
        raise SystemExit(f"{m} mask at {rho} differs from its row's (sha256)")
    return removed


def _graph_stats(model, adapter, g_ids):
    from secateur.calib import engine
    from secateur.calib.collect import StatsCollector

    h = StatsCollector(("sumsq", "meanvar"))
    engine.run(model, adapter, g_ids, h, mode="dense", progress=False)
    return h.stats


def zs_cells(model, tok, adapter, inv, cfg, stats, preset: str, rho: float, methods) -> None:
    """Merge the zero-shot column into the mask-only rows of ``methods`` at ``rho`` that lack it."""
    from secateur.models.adapters import get_adapter
    from secateur.structured.selection import Selection
    from secateur.structured.slicing import apply_selection

    p = PRESETS[preset]
    for m in methods:
        if "zs" in p and not _wants(p, "zs", m, rho):  # the preset names its zero-shot rows
            continue
        row = next((r for r in read_rows(run.OUT_JSON) if r.get("preset") == preset and r["method"] == m
                    and r["rho"] == rho and "coec_rounds" not in r), None)
        if row is None or row.get("zeroshot"):
            continue
        removed = _row_removed(row, inv, adapter, stats, cfg.guard(rho))
        pruned = copy.deepcopy(model)
        apply_selection(pruned, get_adapter(pruned), Selection.from_removed(inv, removed, {"method": m}))
        cell = zeroshot_cell(pruned, tok)
        merge_row_field(run.OUT_JSON, {"preset": preset, "method": m, "rho": rho}, "zeroshot", cell)
        print(m, rho, "zero-shot", cell.get("mean"), flush=True)
        del pruned


def stage_zs(preset: str, rhos: list[float], methods: list[str]) -> None:
    """The zero-shot column of the main table (first ZS_LIMIT documents per task), resumable cell by cell."""
    from secateur.methods.cocurve import cocurve_inventory
    from secateur.models.adapters import get_adapter

    torch.set_num_threads(1)
    p = PRESETS[preset]
    model, tok = load()
    adapter = get_adapter(model)
    g_ids, _, _ = data(tok, p)
    stats = _graph_stats(model, adapter, g_ids) if {"wanda_sp", "flap"} & set(methods) else None
    inv = cocurve_inventory(adapter)
    for rho in rhos:
        zs_cells(model, tok, adapter, inv, config(p), stats, preset, rho, methods)


def stage_rows(preset: str, rhos: list[float], methods: list[str], with_dense: bool) -> None:
    """The mask-only rows (CoCurve, its diagonal control, the baselines) and the dense row, resumable row by row."""
    from secateur.budgets.heldout import HeldoutKL
    from secateur.data.windows import token_sha256
    from secateur.methods.cocurve import cocurve_inventory
    from secateur.models.adapters import get_adapter
    from secateur.runinfo import machine, versions
    from secateur.scoring.cocurve_graph import CoPruningGraph, array_sha256

    torch.set_num_threads(1)
    p = PRESETS[preset]
    model, tok = load()
    adapter = get_adapter(model)
    sp = splits(tok, p)
    g_ids, h_ids, t_ids, man = sp["graph"], sp["heldout"], sp["test"], sp["manifest"]
    cfg = config(p)
    inv = cocurve_inventory(adapter)
    graph, sweep_s = None, 0.0
    if any(m.startswith("cocurve") for m in methods):
        graph = CoPruningGraph.load(graph_path(preset))
        sweep_s = graph.meta["timings"]["ablations_s"] + graph.meta["timings"]["dense_s"]
    corpora = corpora_ids(tok)
    teacher = HeldoutKL(model, h_ids)  # C': chooses lambda (and the KL column when there is no test split)
    tester = None if t_ids is None else HeldoutKL(model, t_ids)  # the independent test split: KL only
    base = {"preset": preset, "preset_params": p, "calibration": man, "heldout_sha256": token_sha256(h_ids),
            "test_sha256": None if t_ids is None else token_sha256(t_ids), "device": run.DEVICE,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "graph_H_sha256": None if graph is None else array_sha256(graph.H), "versions": versions(),
            "machine": machine(), "max_unit_params": int(inv.costs.max())}
    done = {(r["method"], r["rho"]) for r in read_rows(run.OUT_JSON) if r.get("preset") == preset}
    eff_kw = {"prompt_len": 256, "new_tokens": 16, "warmup": 1, "repeats": 3}
    eff = p.get("efficiency", True)
    ctx = SimpleNamespace(model=model, tok=tok, inv=inv, base=base, corpora=corpora, p=p, preset=preset, eff=eff,
                          eff_kw=eff_kw)

    if with_dense and ("dense", 0.0) not in done:
        _dense_row(ctx, teacher, tester)

    stats, stats_s = None, 0.0
    if any(m in ("wanda_sp", "flap") for m in methods):
        t = time.perf_counter()
        stats = _graph_stats(model, adapter, g_ids)
        stats_s = time.perf_counter() - t

    for rho in rhos:
        guard = cfg.guard(rho)
        for method in methods:
            if (method, rho) in done:
                continue
            t0 = time.perf_counter()
            if method.startswith("cocurve"):
                chosen = _cocurve_choice(graph, inv, rho, adapter, teacher, tester, cfg, method, sweep_s, t0)
            else:
                chosen = _baseline_choice(method, inv, adapter, stats, rho, guard, teacher, tester, stats_s, t0)
            _mask_row(ctx, method, rho, *chosen)


def _dense_row(ctx: SimpleNamespace, teacher, tester) -> None:
    """The dense row: held-out (and test) KL, perplexity, parameters and, unless the preset says not, efficiency."""
    from secateur.eval.efficiency import count_params, measure_efficiency

    model, corpora, p = ctx.model, ctx.corpora, ctx.p
    t = time.perf_counter()
    row = {**ctx.base, "method": "dense", "rho": 0.0, "realized": 0.0, "heldout_kl": teacher.evaluate()["kl"],
           "ppl": _ppl(model, corpora, p["ppl_windows"], p), "params": count_params(model)}
    if tester is not None:
        row["test_kl"], row["test_se"] = tester.evaluate()["kl"], 0.0
    if _wants_full_ppl(p, "dense", 0.0):
        row["ppl_full"] = _ppl(model, corpora, None, p, p.get("full_ppl_corpora"))
    if ctx.eff:
        row["efficiency"] = measure_efficiency(model, **ctx.eff_kw)
    row["eval_s"] = time.perf_counter() - t
    append_row(run.OUT_JSON, row)
    print("dense", row["ppl"], flush=True)


def _cocurve_choice(graph, inv, rho, adapter, teacher, tester, cfg, method: str, sweep_s: float, t0: float):
    """CoCurve's (or its diagonal control's) mask at ``rho``, lambda chosen on the held-out split:
    (removed, held-out KL, its SE, selection seconds, selection cost in seconds, row extras)."""
    from secateur.budgets.heldout import masked
    from secateur.methods.cocurve import select

    if method == "cocurve-fixed":  # the paper's fixed-split arm: the diagonal's attention/FFN counts held
        cfg = dataclasses.replace(cfg, split="fixed")
    res = select(graph, inv, rho, adapter, teacher, cfg, diagonal=method == "cocurve-diag")
    removed = res.removed
    extra = {"lambda": res.lam, "candidates": res.candidates, "chosen": res.chosen,
             "one_se_set": res.one_se_set}
    extra |= {k: res.info[k] for k in ("choice", "lambda_family", "split", "budget_vs_diagonal", "split_half")
              if k in res.info}
    kl = res.candidates[res.chosen]["heldout_kl"]
    se = res.candidates[res.chosen]["heldout_se"]
    sel_s = time.perf_counter() - t0
    cost_s = sweep_s + sel_s
    if tester is not None:
        with masked(adapter, inv, removed):
            ev = tester.evaluate()
        extra |= {"test_kl": ev["kl"], "test_se": ev["se"], "test_per_sequence": ev["per_sequence"]}
    return removed, kl, se, sel_s, cost_s, extra


def _baseline_choice(method: str, inv, adapter, stats, rho, guard, teacher, tester, stats_s: float, t0: float):
    """A baseline's mask at ``rho`` and its held-out (and test) KL; returns as ``_cocurve_choice``."""
    from secateur.budgets.heldout import masked

    extra: dict = {}
    removed, norm = _baseline_removed(method, inv, adapter, stats, rho, guard)
    sel_s = time.perf_counter() - t0
    cost_s = sel_s + (stats_s if method in ("wanda_sp", "flap") else 0.0)
    with masked(adapter, inv, removed):
        ev = teacher.evaluate()
        if tester is not None:
            et = tester.evaluate()
            extra = {"test_kl": et["kl"], "test_se": et["se"], "test_per_sequence": et["per_sequence"]}
    kl, se = ev["kl"], ev["se"]
    extra |= {"cost_normalized": norm, "heldout_per_sequence": ev["per_sequence"]}
    return removed, kl, se, sel_s, cost_s, extra


def _mask_row(ctx: SimpleNamespace, method: str, rho: float, removed, kl, se, sel_s, cost_s, extra: dict) -> None:
    """Slice the model by ``removed``, measure it (perplexity; CoCurve rows: export, mask file, efficiency) and
    append its row."""
    from secateur.budgets.allocate import report
    from secateur.eval.efficiency import count_params, measure_efficiency
    from secateur.export.sliced import save_pruned
    from secateur.models.adapters import get_adapter
    from secateur.scoring.cocurve_graph import array_sha256
    from secateur.structured.selection import Selection
    from secateur.structured.slicing import apply_selection

    inv, p, corpora = ctx.inv, ctx.p, ctx.corpora
    rep = report(inv, removed, rho)
    sel = Selection.from_removed(inv, removed, {"method": method})
    pruned = copy.deepcopy(ctx.model)
    apply_selection(pruned, get_adapter(pruned), sel)
    t1 = time.perf_counter()
    row = {**ctx.base, "method": method, "rho": rho, "realized": rep["realized"],
           "realized_minus_target_pp": 100 * (rep["realized"] - rho), "heldout_kl": kl, "heldout_se": se,
           "alloc": _alloc(inv, removed), "selection_s": sel_s, "selection_cost_s": cost_s,
           "mask_sha256": array_sha256(removed), "params": count_params(pruned), **extra}
    row["ppl"] = _ppl(pruned, corpora, p["ppl_windows"], p)
    if _wants_full_ppl(p, method, rho):
        row["ppl_full"] = _ppl(pruned, corpora, None, p, p.get("full_ppl_corpora"))
    if method.startswith("cocurve"):
        out = out_dir(ctx.preset, method, rho)
        saved = save_pruned(pruned, out, ctx.tok, overwrite=True,
                            extra_files={"secateur_selection.json": sel.to_dict()})
        mask_file = out / "cocurve_mask.pt"
        torch.save({"removed": removed, "lambda": row["lambda"]}, mask_file)
        row["export"] = {**saved, "mask_file": str(mask_file)}
        if ctx.eff:
            row["efficiency"] = measure_efficiency(pruned, **ctx.eff_kw)
    row["eval_s"] = time.perf_counter() - t1
    append_row(run.OUT_JSON, row)
    print(method, rho, f"kl={kl:.4f}", {k: round(v["ppl"], 2) for k, v in row["ppl"].items()},
          f"realized={rep['realized']:.4f}", flush=True)
    del pruned


def stage_coec(preset: str, rhos: list[float], methods: tuple[str, ...] = COEC_METHODS, zs: bool = False) -> None:
    """COEC (<= 50 rounds) after three selections, each row against its selection alone:
    ``cocurve+coec`` (the CoCurve row's saved mask), ``wanda_sp+coec`` (the Wanda-sp row's mask, recomputed
    and checked against its sha256: same inventory, guards and budget as CoCurve), and ``coec`` (COEC's own
    pipeline: RCPU score, KV groups + single channels, uniform ceil allocation, no guard; its realized
    budget is what ceil rounding gives). Grams and scores from ``COMP_CALIB``; KL and perplexity as the rows.
    ``zs``: the zero-shot column too, on these rows and on the uncompensated ``cocurve`` / ``wanda_sp`` rows.
    Returns before loading anything when no row (and, with ``zs``, no zero-shot cell) is left to do."""
    from secateur.budgets.heldout import HeldoutKL
    from secateur.calib.collect import SCORE_STATS, collect_stats
    from secateur.data.windows import token_sha256
    from secateur.methods.cocurve import cocurve_inventory
    from secateur.models.adapters import get_adapter
    from secateur.runinfo import machine, versions

    if not _coec_left(preset, rhos, methods, zs):
        print(f"COEC rows ({', '.join(methods)}) at {rhos}: every row already done", flush=True)
        return
    torch.set_num_threads(1)
    p = PRESETS[preset]
    model, tok = load()
    adapter = get_adapter(model)
    sp = splits(tok, p)
    g_ids, h_ids, t_ids, man = sp["graph"], sp["heldout"], sp["test"], sp["manifest"]
    c = COMP_CALIB
    c_ids, c_man = calib_tokens(tok, c["source"], c["nsamples"], c["seqlen"], c["seed"])
    if not _disjoint(c_ids, h_ids) or (t_ids is not None and not _disjoint(c_ids, t_ids)):
        raise SystemExit("the compensation calibration windows overlap the held-out or test split")
    inv = cocurve_inventory(adapter)
    cfg = config(p)
    corpora = corpora_ids(tok)
    teacher = HeldoutKL(model, h_ids)
    tester = None if t_ids is None else HeldoutKL(model, t_ids)
    rows = read_rows(run.OUT_JSON)
    rounds = COEC_OPTS["max_rounds"]
    done = {(r["method"], r["rho"]) for r in rows if r.get("preset") == preset and r.get("coec_rounds") == rounds}
    t = time.perf_counter()
    stats = collect_stats(model, adapter, c_ids, SCORE_STATS + ("gram",))
    stats_s = time.perf_counter() - t
    g_stats = None
    if zs or "wanda_sp+coec" in methods:  # the Wanda-sp selection, from the graph windows' statistics
        g_stats = _graph_stats(model, adapter, g_ids)
    base = {"preset": preset, "preset_params": p, "calibration": man, "comp_calibration": c_man,
            "heldout_sha256": token_sha256(h_ids), "test_sha256": None if t_ids is None else token_sha256(t_ids),
            "device": run.DEVICE, "coec_rounds": rounds, "versions": versions(),
            "machine": machine(), "stats_s": stats_s}
    ctx = SimpleNamespace(model=model, tok=tok, adapter=adapter, inv=inv, cfg=cfg, p=p, corpora=corpora,
                          teacher=teacher, tester=tester, base=base, c_ids=c_ids, stats=stats, stats_s=stats_s,
                          g_stats=g_stats, zs=zs)
    for rho in rhos:
        for method in methods:
            if (method, rho) in done:
                continue
            src = method.removesuffix("+coec")
            ref = next((r for r in rows if r.get("preset") == preset and r["method"] == src and r["rho"] == rho),
                       None)
            _coec_row(ctx, method, rho, ref)
        if zs:  # the selections alone, for the zero-shot column
            zs_cells(model, tok, adapter, inv, cfg, g_stats, preset, rho, ("cocurve", "wanda_sp"))


def _coec_left(preset: str, rhos: list[float], methods: tuple[str, ...], zs: bool) -> bool:
    """Whether ``stage_coec`` has anything left, from the rows file alone: a COEC row not yet at this round cap
    (that has its selection's row, or is COEC's own pipeline), or, with ``zs``, a zero-shot cell ``zs_cells``
    would fill."""
    p = PRESETS[preset]
    rows = [r for r in read_rows(run.OUT_JSON) if r.get("preset") == preset]
    rounds = COEC_OPTS["max_rounds"]
    done = {(r["method"], r["rho"]) for r in rows if r.get("coec_rounds") == rounds}
    for rho in rhos:
        for method in methods:
            src = method.removesuffix("+coec")
            if (method, rho) not in done and (method == "coec" or any(
                    r["method"] == src and r["rho"] == rho for r in rows)):
                return True
        for m in ("cocurve", "wanda_sp") if zs else ():
            if "zs" in p and not _wants(p, "zs", m, rho):
                continue
            row = next((r for r in rows if r["method"] == m and r["rho"] == rho and "coec_rounds" not in r), None)
            if row is not None and not row.get("zeroshot"):
                return True
    return False


def _coec_row(ctx: SimpleNamespace, method: str, rho: float, ref: dict | None) -> None:
    """One COEC row: compensate the selection (``ref``'s mask, or COEC's own pipeline), evaluate it, append it."""
    from secateur.eval.efficiency import count_params
    from secateur.models.adapters import get_adapter

    p = ctx.p
    pruned = copy.deepcopy(ctx.model)
    pa = get_adapter(pruned)
    t0 = time.perf_counter()
    if method != "coec":
        if ref is None:
            print(f"no {method.removesuffix('+coec')} row at {rho}: skipping {method}")
            return
        extra = _coec_on_row_mask(ctx, method, rho, ref, pruned, pa)
    else:
        extra = _coec_own_pipeline(ctx, rho, pruned, pa)
    ev = ctx.teacher.evaluate(pruned)
    row = {**ctx.base, "method": method, "rho": rho, "heldout_kl": ev["kl"], "heldout_se": ev["se"],
           "params": count_params(pruned), "ppl": _ppl(pruned, ctx.corpora, p["ppl_windows"], p),
           "wall_s": time.perf_counter() - t0, **extra}
    if ctx.tester is not None:
        et = ctx.tester.evaluate(pruned)
        row["test_kl"], row["test_se"] = et["kl"], et["se"]
    if ctx.zs and ("zs" not in p or _wants(p, "zs", method, rho)):
        row["zeroshot"] = zeroshot_cell(pruned, ctx.tok)
    append_row(run.OUT_JSON, row)
    print(method, rho, f"kl={ev['kl']:.4f}", {k: round(v["ppl"], 2) for k, v in row["ppl"].items()},
          flush=True)
    del pruned


def _coec_on_row_mask(ctx: SimpleNamespace, method: str, rho: float, ref: dict, pruned, pa) -> dict:
    """COEC on a results row's mask (rebuilt and sha256-checked), applied to ``pruned``; returns the row extras."""
    from secateur.budgets.allocate import report
    from secateur.compensate import COECOptions
    from secateur.methods.materialize import compensate_selection
    from secateur.methods.structured import StructuredConfig
    from secateur.scoring.cocurve_graph import array_sha256
    from secateur.structured.selection import Selection
    from secateur.structured.slicing import apply_selection

    inv, stats_s = ctx.inv, ctx.stats_s
    removed = _row_removed(ref, inv, ctx.adapter, ctx.g_stats, ctx.cfg.guard(rho))
    sel = Selection.from_removed(inv, removed, {"method": method})
    ccfg = StructuredConfig(compensation="coec", sparsity=rho, coec=COECOptions(**COEC_OPTS))
    reps, records, comp_s = compensate_selection(pruned, pa, sel, ctx.stats, ccfg)
    apply_selection(pruned, pa, sel, reps)
    rep = report(inv, removed, rho)
    return {"lambda": ref.get("lambda"), "alloc": ref["alloc"], "mask_sha256": array_sha256(removed),
            "compensation_s": comp_s, "realized": rep["realized"],
            "selection_cost_s": ref["selection_cost_s"] + stats_s + comp_s,
            "recon_after_mean": sum(r["recon_after"] for r in records) / max(len(records), 1),
            "recon_before_mean": sum(r["recon_before"] for r in records) / max(len(records), 1),
            "rounds_mean": sum(r.get("rounds") or 0 for r in records) / max(len(records), 1),
            "guard_fired": sum(bool(r.get("guard")) for r in records)}


def _coec_own_pipeline(ctx: SimpleNamespace, rho: float, pruned, pa) -> dict:
    """COEC's own pipeline (RCPU score, uniform ceil allocation, COEC) on ``pruned``; returns the row extras."""
    from secateur.compensate import COECOptions
    from secateur.methods.structured import StructuredConfig, prune_structured

    res = prune_structured(pruned, pa, ctx.c_ids, StructuredConfig(
        score="rcpu", compensation="coec", sparsity=rho, coec=COECOptions(**COEC_OPTS)), stats=ctx.stats)
    d = res.details
    return {"realized": d["realized"], "compensation_s": d["compensation_seconds"],
            "selection_cost_s": ctx.stats_s + res.timings["total_s"], "units": d["units"],
            "allocation": d["allocation"], "compensation_summary": d["compensation_summary"]}
