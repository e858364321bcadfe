"""CoCurve on SmolLM2-135M at 20/30/40/50%: CoCurve vs its diagonal control and the structured baselines.

    nice -n 5 python bench/cocurve_smollm2.py --stage graph --preset quick --ranks 2   # H once (gloo)
    nice -n 5 python bench/cocurve_smollm2.py --stage rows --preset quick --rhos 0.2,0.3 &
    nice -n 5 python bench/cocurve_smollm2.py --stage rows --preset quick --rhos 0.4,0.5
    python bench/cocurve_smollm2.py --render                                          # results/*.md + plot

Protocol (every row shares it): units = 3 KV groups + 16 contiguous FFN groups per layer (570 units);
cost = removable parameters (structured inventory); guards = layers 0, 1, 28, 29 protected, per-layer
cap 1.5 rho; budget = the shared greedy solver (``allocate_global``; CoCurve's own conditional greedy
for CoCurve). Calibration: C4 (local validation documents [0, 1500)), Wanda's random-long-document rule,
seed 0; the first ``n_graph`` windows build H / the baselines' statistics, the last ``n_heldout`` are
the disjoint held-out split C' (lambda choice and the KL column). Perplexity: sliding 2048/512
(``perplexity(..., stride=512)``) on WikiText-2 test, C4 held-out documents [1500, 2000) and PTB test,
the first ``ppl_windows`` windows. Held-out KL: full vocabulary, mean over every held-out token, masked
model. H does not depend on rho: it is built once (``--stage graph``) and reused for every budget.

Baseline scores (src/secateur/scoring/structured.py): Wanda-sp ``sum_j ||W_:,j|| ||X_j||`` and magnitude
(Frobenius norm of every weight a unit owns) ranked per parameter (score / cost); FLAP = AL-AM
standardized WIFV scores (may be negative, so ranked raw), random = seeded uniform scores (raw). No
bias compensation for any method (masks only, as in the paper).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    RESULTS,
    WORK,
    ZS_LIMIT,
    append_row,
    calib_tokens,
    find_dense_zeroshot,
    fmt,
    fmt_zs,
    merge_row_field,
    read_rows,
    zeroshot_cell,
)

PRESETS = {
    # the paper's protocol (default in code): 128 x 2048 graph, P_tok 128, r 256, 16 held-out, full corpora
    "full": {"n_graph": 128, "n_heldout": 16, "seqlen": 2048, "positions": 128, "top_r": 256, "ppl_windows": None,
             "unit_batch": 8},
    # what 2 heavily shared CPU cores allow: 4 x 256 graph, 32 positions/seq (P = 128), r 256, 4 x 256
    # held-out, perplexity on the first sliding window (2048 tokens, 2047 scored) of each corpus
    "quick": {"n_graph": 4, "n_heldout": 4, "seqlen": 256, "positions": 32, "top_r": 256, "ppl_windows": 1,
              "unit_batch": 8},
    "smoke": {"n_graph": 2, "n_heldout": 2, "seqlen": 64, "positions": 8, "top_r": 64, "ppl_windows": 1,
              "unit_batch": 8},
}
RHOS = (0.2, 0.3, 0.4, 0.5)
METHODS = ("cocurve", "cocurve-diag", "wanda_sp", "flap", "magnitude", "random")
CORPORA = ("wikitext2", "c4", "ptb")
OUT_JSON = RESULTS / "cocurve-smollm2.jsonl"
OUT_MD = RESULTS / "cocurve-smollm2.md"
OUT_PNG = RESULTS / "cocurve-smollm2-alloc.png"
DIR = WORK / "cocurve-smollm2"


def graph_path(preset: str) -> Path:
    return DIR / f"graph-{preset}.npz"


def data(tok, p: dict):
    ids, man = calib_tokens(tok, "c4", p["n_graph"] + p["n_heldout"], p["seqlen"])
    g, h = ids[:p["n_graph"]], ids[p["n_graph"]:]
    if any(torch.equal(a, b) for a in g for b in h):
        raise SystemExit("held-out windows overlap the graph windows")
    return g, h, man


def config(p: dict):
    from secateur.methods.cocurve import CoCurveConfig
    from secateur.scoring.cocurve_sweep import SweepConfig

    return CoCurveConfig(sweep=SweepConfig(positions_per_seq=p["positions"], top_r=p["top_r"],
                                           unit_batch=p["unit_batch"], progress=True))


# --- stage 1: the graph (torch.distributed over --ranks processes) --------------------------------------

def _graph_worker(rank: int, world: int, preset: str) -> None:
    from secateur.methods.cocurve import build_graph, cocurve_inventory
    from secateur.models.adapters import get_adapter
    from secateur.models.loading import load_model

    p = PRESETS[preset]
    model, tok = load_model("smollm2-135m")
    adapter = get_adapter(model)
    g_ids, _, man = data(tok, p)
    cfg = config(p)
    t = time.perf_counter()
    graph = build_graph(model, adapter, g_ids, cfg, cocurve_inventory(adapter))
    if rank == 0:
        graph.meta["wall_s"] = time.perf_counter() - t
        graph.meta["calibration_manifest"] = man
        graph.meta["preset"] = preset
        info = graph.save(graph_path(preset))
        print(json.dumps({k: graph.meta[k] for k in ("timings", "wall_s", "n_ablated", "lambda_min")}
                         | info, default=str), flush=True)


def stage_graph(preset: str, ranks: int) -> None:
    if ranks > 1:
        from secateur.calib.dist import spawn_gloo

        spawn_gloo(_graph_worker, ranks, (preset,), threads=1)
    else:
        torch.set_num_threads(1)
        _graph_worker(0, 1, preset)


# --- stage 2: rows --------------------------------------------------------------------------------------

def _alloc(inv, removed) -> dict:
    from secateur.methods.cocurve import allocation_by_layer

    a = allocation_by_layer(inv, removed)
    return {"attn": [a[i]["attn_removed"] for i in sorted(a)], "ffn": [a[i]["ffn_removed"] for i in sorted(a)],
            "attn_units": a[0]["attn_units"], "ffn_units": a[0]["ffn_units"]}


def _ppl(model, corpora_ids: dict, windows) -> dict:
    from secateur.eval.ppl import perplexity

    out = {}
    for name, ids in corpora_ids.items():
        r = perplexity(model, ids, seqlen=2048, stride=512, max_windows=windows, progress=False)
        out[name] = {"ppl": r["ppl"], "windows": r["windows"], "scored": r["scored_tokens"], "s": r["seconds"]}
    return out


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
        removed = torch.load(DIR / f"out-{m}-{int(round(rho * 100))}" / "cocurve_mask.pt")["removed"]
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

    for m in methods:
        row = next((r for r in read_rows(OUT_JSON) if r.get("preset") == preset and r["method"] == m
                    and r["rho"] == rho and "coec_rounds" not in r), None)
        if row is None or row.get("zeroshot"):
            continue
        removed = _row_removed(row, inv, adapter, stats, cfg.guard(rho))
        pruned = copy.deepcopy(model)
        apply_selection(pruned, get_adapter(pruned), Selection.from_removed(inv, removed, {"method": m}))
        cell = zeroshot_cell(pruned, tok)
        merge_row_field(OUT_JSON, {"preset": preset, "method": m, "rho": rho}, "zeroshot", cell)
        print(m, rho, "zero-shot", cell.get("mean"), flush=True)
        del pruned


def stage_zs(preset: str, rhos: list[float], methods: list[str]) -> None:
    """The zero-shot column of the main table (first ZS_LIMIT documents per task), resumable cell by cell."""
    from secateur.methods.cocurve import cocurve_inventory
    from secateur.models.adapters import get_adapter
    from secateur.models.loading import load_model

    torch.set_num_threads(1)
    p = PRESETS[preset]
    model, tok = load_model("smollm2-135m")
    adapter = get_adapter(model)
    g_ids, _, _ = data(tok, p)
    stats = _graph_stats(model, adapter, g_ids) if {"wanda_sp", "flap"} & set(methods) else None
    inv = cocurve_inventory(adapter)
    for rho in rhos:
        zs_cells(model, tok, adapter, inv, config(p), stats, preset, rho, methods)


def stage_rows(preset: str, rhos: list[float], methods: list[str], with_dense: bool) -> None:
    from secateur.budgets.heldout import HeldoutKL, masked
    from secateur.data.sources import eval_text
    from secateur.data.windows import eval_ids, token_sha256
    from secateur.eval.efficiency import count_params, measure_efficiency
    from secateur.export.sliced import save_pruned
    from secateur.methods.cocurve import cocurve_inventory, select
    from secateur.models.adapters import get_adapter
    from secateur.models.loading import load_model
    from secateur.runinfo import machine, versions
    from secateur.scoring.cocurve_graph import CoPruningGraph, array_sha256
    from secateur.structured.slicing import apply_selection

    torch.set_num_threads(1)
    p = PRESETS[preset]
    model, tok = load_model("smollm2-135m")
    adapter = get_adapter(model)
    g_ids, h_ids, man = data(tok, p)
    cfg = config(p)
    inv = cocurve_inventory(adapter)
    graph, sweep_s = None, 0.0
    if any(m.startswith("cocurve") for m in methods):
        graph = CoPruningGraph.load(graph_path(preset))
        sweep_s = graph.meta["timings"]["ablations_s"] + graph.meta["timings"]["dense_s"]
    corpora = {c: eval_ids(eval_text(c), tok) for c in CORPORA}
    teacher = HeldoutKL(model, h_ids)
    base = {"preset": preset, "preset_params": p, "calibration": man, "heldout_sha256": token_sha256(h_ids),
            "graph_H_sha256": None if graph is None else array_sha256(graph.H), "versions": versions(),
            "machine": machine()}
    done = {(r["method"], r["rho"]) for r in read_rows(OUT_JSON) if r.get("preset") == preset}
    eff_kw = {"prompt_len": 256, "new_tokens": 16, "warmup": 1, "repeats": 3}

    if with_dense and ("dense", 0.0) not in done:
        t = time.perf_counter()
        row = {**base, "method": "dense", "rho": 0.0, "realized": 0.0, "heldout_kl": teacher.evaluate()["kl"],
               "ppl": _ppl(model, corpora, p["ppl_windows"]), "params": count_params(model),
               "efficiency": measure_efficiency(model, **eff_kw)}
        row["eval_s"] = time.perf_counter() - t
        append_row(OUT_JSON, row)
        print("dense", row["ppl"], flush=True)

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
            extra: dict = {}
            if method.startswith("cocurve"):
                res = select(graph, inv, rho, adapter, teacher, cfg, diagonal=method == "cocurve-diag")
                removed = res.removed
                extra = {"lambda": res.lam, "candidates": res.candidates, "chosen": res.chosen,
                         "one_se_set": res.one_se_set}
                kl = res.candidates[res.chosen]["heldout_kl"]
                se = res.candidates[res.chosen]["heldout_se"]
                sel_s = time.perf_counter() - t0
                cost_s = sweep_s + sel_s
            else:
                removed, norm = _baseline_removed(method, inv, adapter, stats, rho, guard)
                sel_s = time.perf_counter() - t0
                cost_s = sel_s + (stats_s if method in ("wanda_sp", "flap") else 0.0)
                with masked(adapter, inv, removed):
                    ev = teacher.evaluate()
                kl, se = ev["kl"], ev["se"]
                extra = {"cost_normalized": norm}
            from secateur.budgets.allocate import report
            from secateur.structured.selection import Selection

            rep = report(inv, removed, rho)
            sel = Selection.from_removed(inv, removed, {"method": method})
            pruned = copy.deepcopy(model)
            apply_selection(pruned, get_adapter(pruned), sel)
            t1 = time.perf_counter()
            row = {**base, "method": method, "rho": rho, "realized": rep["realized"],
                   "realized_minus_target_pp": 100 * (rep["realized"] - rho), "heldout_kl": kl, "heldout_se": se,
                   "alloc": _alloc(inv, removed), "selection_s": sel_s, "selection_cost_s": cost_s,
                   "mask_sha256": array_sha256(removed), "params": count_params(pruned), **extra}
            row["ppl"] = _ppl(pruned, corpora, p["ppl_windows"])
            if method.startswith("cocurve"):
                out = DIR / f"out-{method}-{int(round(rho * 100))}"
                saved = save_pruned(pruned, out, tok, overwrite=True,
                                    extra_files={"secateur_selection.json": sel.to_dict()})
                mask_file = out / "cocurve_mask.pt"
                torch.save({"removed": removed, "lambda": row["lambda"]}, mask_file)
                row["export"] = {**saved, "mask_file": str(mask_file)}
                row["efficiency"] = measure_efficiency(pruned, **eff_kw)
            row["eval_s"] = time.perf_counter() - t1
            append_row(OUT_JSON, row)
            print(method, rho, f"kl={kl:.4f}", {k: round(v["ppl"], 2) for k, v in row["ppl"].items()},
                  f"realized={rep['realized']:.4f}", flush=True)
            del pruned


# --- stage 3: CoCurve selection + COEC compensation vs each alone -----------------------------------------

COEC_OPTS = {"max_rounds": 50}  # the paper's cap (tol 1e-4); the solver is ~4x cheaper per round since session 2
# COEC's Grams come from their own calibration set, not the 4 x 256 graph windows: 1024 tokens cannot pin down a
# 1536-wide down_proj Gram, and COEC fitted there raised held-out KL. C4 like the graph (documents [0, 1500)),
# seed 1 so the windows differ; checked against the held-out split below.
COMP_CALIB = {"source": "c4", "nsamples": 16, "seqlen": 2048, "seed": 1}
COEC_METHODS = ("cocurve+coec", "wanda_sp+coec", "coec")


def _disjoint(windows: torch.Tensor, heldout: torch.Tensor, k: int = 32) -> bool:
    """No k-token run of a held-out window occurs in the compensation windows."""
    runs = {tuple(w[i:i + k].tolist()) for w in windows for i in range(0, w.numel() - k + 1)}
    return not any(tuple(h[i:i + k].tolist()) in runs for h in heldout for i in range(0, h.numel() - k + 1, k))


def stage_coec(preset: str, rhos: list[float], methods: tuple[str, ...] = COEC_METHODS, zs: bool = False) -> None:
    """COEC (<= 50 rounds) after three selections, each row against its selection alone:
    ``cocurve+coec`` (the CoCurve row's saved mask), ``wanda_sp+coec`` (the Wanda-sp row's mask, recomputed
    and checked against its sha256: same inventory, guards and budget as CoCurve), and ``coec`` (COEC's own
    pipeline: RCPU score, KV groups + single channels, uniform ceil allocation, no guard; its realized
    budget is what ceil rounding gives). Grams and scores from ``COMP_CALIB``; KL and perplexity as the rows.
    ``zs``: the zero-shot column too, on these rows and on the uncompensated ``cocurve`` / ``wanda_sp`` rows."""
    from secateur.budgets.allocate import report
    from secateur.budgets.heldout import HeldoutKL
    from secateur.calib.collect import SCORE_STATS, collect_stats
    from secateur.compensate import COECOptions
    from secateur.data.sources import eval_text
    from secateur.data.windows import eval_ids, token_sha256
    from secateur.eval.efficiency import count_params
    from secateur.methods.cocurve import cocurve_inventory
    from secateur.methods.compensation import compensate_selection
    from secateur.methods.structured import StructuredConfig, prune_structured
    from secateur.models.adapters import get_adapter
    from secateur.models.loading import load_model
    from secateur.runinfo import machine, versions
    from secateur.scoring.cocurve_graph import array_sha256
    from secateur.structured.selection import Selection
    from secateur.structured.slicing import apply_selection

    torch.set_num_threads(1)
    p = PRESETS[preset]
    model, tok = load_model("smollm2-135m")
    adapter = get_adapter(model)
    g_ids, h_ids, man = data(tok, p)
    c = COMP_CALIB
    c_ids, c_man = calib_tokens(tok, c["source"], c["nsamples"], c["seqlen"], c["seed"])
    if not _disjoint(c_ids, h_ids):
        raise SystemExit("the compensation calibration windows overlap the held-out split")
    inv = cocurve_inventory(adapter)
    cfg = config(p)
    corpora = {k: eval_ids(eval_text(k), tok) for k in CORPORA}
    teacher = HeldoutKL(model, h_ids)
    rows = read_rows(OUT_JSON)
    rounds = COEC_OPTS["max_rounds"]
    done = {(r["method"], r["rho"]) for r in rows if r.get("preset") == preset and r.get("coec_rounds") == rounds}
    t = time.perf_counter()
    stats = collect_stats(model, adapter, c_ids, SCORE_STATS + ("gram",))
    stats_s = time.perf_counter() - t
    g_stats = None
    if zs or "wanda_sp+coec" in methods:  # the Wanda-sp selection, from the graph windows' statistics
        g_stats = _graph_stats(model, adapter, g_ids)
    base = {"preset": preset, "preset_params": p, "calibration": man, "comp_calibration": c_man,
            "heldout_sha256": token_sha256(h_ids), "coec_rounds": rounds, "versions": versions(),
            "machine": machine(), "stats_s": stats_s}
    for rho in rhos:
        for method in methods:
            if (method, rho) in done:
                continue
            src = method.removesuffix("+coec")
            ref = next((r for r in rows if r.get("preset") == preset and r["method"] == src and r["rho"] == rho),
                       None)
            pruned = copy.deepcopy(model)
            pa = get_adapter(pruned)
            t0 = time.perf_counter()
            if method != "coec":
                if ref is None:
                    print(f"no {src} row at {rho}: skipping {method}")
                    continue
                removed = _row_removed(ref, inv, adapter, g_stats, cfg.guard(rho))
                sel = Selection.from_removed(inv, removed, {"method": method})
                ccfg = StructuredConfig(compensation="coec", sparsity=rho, coec=COECOptions(**COEC_OPTS))
                reps, records, comp_s = compensate_selection(pruned, pa, sel, stats, ccfg)
                apply_selection(pruned, pa, sel, reps)
                rep = report(inv, removed, rho)
                extra = {"lambda": ref.get("lambda"), "alloc": ref["alloc"], "mask_sha256": array_sha256(removed),
                         "compensation_s": comp_s, "realized": rep["realized"],
                         "selection_cost_s": ref["selection_cost_s"] + stats_s + comp_s,
                         "recon_after_mean": sum(r["recon_after"] for r in records) / max(len(records), 1),
                         "recon_before_mean": sum(r["recon_before"] for r in records) / max(len(records), 1),
                         "rounds_mean": sum(r.get("rounds") or 0 for r in records) / max(len(records), 1),
                         "guard_fired": sum(bool(r.get("guard")) for r in records)}
            else:
                res = prune_structured(pruned, pa, c_ids, StructuredConfig(
                    score="rcpu", compensation="coec", sparsity=rho, coec=COECOptions(**COEC_OPTS)), stats=stats)
                d = res.details
                extra = {"realized": d["realized"], "compensation_s": d["compensation_seconds"],
                         "selection_cost_s": stats_s + res.timings["total_s"], "units": d["units"],
                         "allocation": d["allocation"], "compensation_summary": d["compensation_summary"]}
            ev = teacher.evaluate(pruned)
            row = {**base, "method": method, "rho": rho, "heldout_kl": ev["kl"], "heldout_se": ev["se"],
                   "params": count_params(pruned), "ppl": _ppl(pruned, corpora, p["ppl_windows"]),
                   "wall_s": time.perf_counter() - t0, **extra}
            if zs:
                row["zeroshot"] = zeroshot_cell(pruned, tok)
            append_row(OUT_JSON, row)
            print(method, rho, f"kl={ev['kl']:.4f}", {k: round(v["ppl"], 2) for k, v in row["ppl"].items()},
                  flush=True)
            del pruned
        if zs:  # the selections alone, for the zero-shot column
            zs_cells(model, tok, adapter, inv, cfg, g_stats, preset, rho, ("cocurve", "wanda_sp"))


# --- render ---------------------------------------------------------------------------------------------

def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rhos = sorted({r["rho"] for r in rows if r["method"] != "dense"})
    fig, axes = plt.subplots(2, len(rhos), figsize=(4.2 * len(rhos), 6.4), sharex=True, squeeze=False)
    styles = {"cocurve": ("C3", "-", "o"), "cocurve-diag": ("C0", "--", "s"), "wanda_sp": ("C2", ":", "^"),
              "flap": ("C1", "-.", "v"), "magnitude": ("C4", ":", "x"), "random": ("C7", ":", ".")}
    for j, rho in enumerate(rhos):
        for r in rows:
            if r["rho"] != rho or r["method"] not in styles:
                continue
            c, ls, mk = styles[r["method"]]
            a = r["alloc"]
            for i, (key, n) in enumerate((("attn", a["attn_units"]), ("ffn", a["ffn_units"]))):
                axes[i][j].plot(range(len(a[key])), [x / n for x in a[key]], color=c, ls=ls, marker=mk, ms=3,
                                label=r["method"])
        axes[0][j].set_title(f"rho = {rho:.0%}")
        axes[1][j].set_xlabel("layer")
    axes[0][0].set_ylabel("KV groups removed (fraction)")
    axes[1][0].set_ylabel("FFN groups removed (fraction)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT_PNG, dpi=110)


def render() -> None:
    rows = read_rows(OUT_JSON)
    if not rows:
        raise SystemExit("no rows")
    preset = rows[-1]["preset"]
    rows = [r for r in rows if r["preset"] == preset]
    p = PRESETS[preset]
    dense = next((r for r in rows if r["method"] == "dense"), None)
    graph_meta = {}
    gp = graph_path(preset)
    if gp.exists():
        from secateur.scoring.cocurve_graph import CoPruningGraph, array_sha256, bytes_sha256

        g = CoPruningGraph.load(gp)
        graph_meta = {**g.meta, "file_sha256": bytes_sha256(gp.read_bytes()), "H_sha256": array_sha256(g.H)}
    L = []
    L.append("# CoCurve on SmolLM2-135M (structured, masks only)\n")
    L.append(f"Preset **{preset}**: {json.dumps(p)}. Generated by `bench/cocurve_smollm2.py` "
             "(see its docstring for the protocol); rows in `results/cocurve-smollm2.jsonl`.\n")
    L.append("Units: 30 layers x (3 KV groups + 16 contiguous FFN groups) = 570; cost = removable parameters; "
             "guards: layers 0, 1, 28, 29 protected, per-layer cap 1.5 rho; every method uses the same "
             "inventory, guard and budget (shared greedy solver; CoCurve its conditional greedy). KL = "
             "full-vocabulary teacher KL on the held-out windows (mean per token, ± SE over sequences). PPL = "
             f"sliding 2048/512 (`perplexity(..., stride=512)`), first {p['ppl_windows']} windows of each corpus. "
             "Selection cost: CoCurve = ablation sweep (shared by all budgets and by the diagonal control) + "
             "lambda path + held-out KL of every candidate; baselines = statistics pass + scoring.\n")
    if graph_meta:
        t = graph_meta["timings"]
        L.append("## Graph (H, built once)\n")
        L.append(f"* ablated units: {graph_meta['n_ablated']} of {graph_meta['n_units']} (units of protected "
                 f"layers are never eligible, so they are not ablated); positions P = {graph_meta['n_positions']}; "
                 f"mean top-{p['top_r']} teacher mass {graph_meta['support_mass']:.3f}; "
                 f"lambda_min(H) = {graph_meta['lambda_min']:.2e}")
        L.append(f"* sweep: {t['n_ablations']} ablations (unit x block) in {t['ablations_s']:.0f} rank-s "
                 f"+ dense {t['dense_s']:.1f} s over {t['world_size']} gloo ranks "
                 f"(wall {graph_meta.get('wall_s', 0):.0f} s); "
                 f"**time per ablation / one dense forward = {t['ablation_over_dense']:.3f}** "
                 f"({t['per_ablation_s']:.3f} s vs {t['dense_forward_per_block_s']:.3f} s for "
                 f"{t['tokens_per_block']} "
                 "tokens; only layers after the unit are re-run, LM head at the sampled positions only)")
        L.append(f"* `{gp.relative_to(WORK.parent.parent)}`: file sha256 `{graph_meta['file_sha256']}`, "
                 f"H sha256 `{graph_meta['H_sha256']}`\n")
    if dense:
        L.append("Dense: held-out KL 0, PPL " + ", ".join(f"{c} {dense['ppl'][c]['ppl']:.2f}" for c in CORPORA)
                 + f"; params {dense['params'] / 1e6:.1f} M.\n")
    L.append("## Summary (computed from the rows)\n")
    L.append("| rho | ΔKL vs diagonal | ΔKL vs best baseline (which) | WT2 CoCurve / best baseline WT2 |")
    L.append("|---|---|---|---|")
    for rho in sorted({r["rho"] for r in rows if r["method"] == "cocurve"}):
        by = {r["method"]: r for r in rows if r["rho"] == rho}
        cc, dg = by["cocurve"], by.get("cocurve-diag")
        bases = [by[m] for m in ("wanda_sp", "flap", "magnitude", "random") if m in by]
        if not bases:
            continue
        bk = min(bases, key=lambda r: r["heldout_kl"])
        bw = min(bases, key=lambda r: r["ppl"]["wikitext2"]["ppl"])
        L.append(f"| {rho:.0%} | {cc['heldout_kl'] - dg['heldout_kl']:+.3f} | "
                 f"{cc['heldout_kl'] - bk['heldout_kl']:+.3f} ({bk['method']}) | "
                 f"{cc['ppl']['wikitext2']['ppl']:.1f} / {bw['ppl']['wikitext2']['ppl']:.1f} ({bw['method']}) |")
    L.append("")
    L.append("Notes: (1) the quick preset is tiny (1024 graph tokens, 1024 held-out tokens, one 2048-token "
             "window per corpus): differences within a few SE of the KL are not significant, and perplexities "
             "of pruned 135M models without recovery are in the hundreds to thousands for every method. "
             "(2) Budget granularity: a SmolLM2 KV group is 294,912 parameters = 0.28% of C, so the greedy's "
             "guaranteed overshoot bound (< one unit) exceeds the paper's 0.2 pp acceptance window; rows "
             "above 0.2 pp are kept and marked by their realized fraction (the 0.2 pp check is enforced in "
             "tests on a geometry where it is attainable). (3) Selection cost of CoCurve counts the sweep's "
             "rank-seconds (each rank's wall time, summed over both ranks; the sweep's wall time is in the graph "
             "section), on 2 cores shared with other jobs (load 10-16): compare the ablation/dense ratio, "
             "not the seconds. (4) Baselines rank "
             "per parameter (score / cost) for Wanda-sp and magnitude, raw for FLAP (standardized scores) "
             "and random. (5) The KL column of CoCurve is measured on the split that chose its lambda "
             "(the paper's C'), so it is optimistic for CoCurve; the perplexities are independent of selection, "
             "and the diagonal control (one candidate, nothing chosen) has an unbiased KL.\n")
    L.append("## Quality\n")
    L.append(f"Zero-shot: seven-task mean on the first {ZS_LIMIT} documents per task (`--stage zs`; dense "
             f"{fmt_zs(find_dense_zeroshot())}); '-' where not yet measured.\n")
    L.append("| rho | method | realized | KL (± SE) | WT2 | C4 | PTB | zero-shot | lambda | #cand | "
             "KV / FFN groups removed | params (M) | selection cost (s) |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rho in sorted({r["rho"] for r in rows if r["method"] != "dense"}):
        for m in METHODS:
            r = next((x for x in rows if x["rho"] == rho and x["method"] == m), None)
            if r is None:
                continue
            a = r["alloc"]
            L.append(f"| {rho:.0%} | {m} | {100 * r['realized']:.2f}% | "
                     f"{r['heldout_kl']:.4f} ± {r['heldout_se']:.4f} | "
                     + " | ".join(fmt(r["ppl"][c]["ppl"]) for c in CORPORA)
                     + f" | {fmt_zs(r.get('zeroshot'))} | {fmt(r.get('lambda'))} | "
                     f"{len(r['candidates']) if 'candidates' in r else '-'} | "
                     f"{sum(a['attn'])} / {sum(a['ffn'])} | {r['params'] / 1e6:.1f} | {r['selection_cost_s']:.0f} |")
    comp = [r for r in rows if r["method"] in COEC_METHODS and r.get("coec_rounds") == COEC_OPTS["max_rounds"]]
    if comp:
        c = comp[0]["comp_calibration"]
        L.append("\n## CoCurve selection + COEC compensation vs each alone\n")
        L.append("`X+coec`: the mask of row X above (CoCurve: its saved mask; Wanda-sp: recomputed, sha256 checked), "
                 f"then COEC with the paper's defaults (alpha 0.9, GCV, reduced Stiefel, alignment on o_proj, <= "
                 f"{COEC_OPTS['max_rounds']} rounds, tol 1e-4; `secateur.methods.compensation.compensate_selection`, "
                 "slice-only fallback where COEC would raise the calibration error) on every o_proj/down_proj that "
                 "lost columns. `coec`: COEC's own pipeline (RCPU score, KV groups + single MLP channels, uniform "
                 "ceil allocation per layer, **no layer guard**; `prune_structured(score='rcpu', "
                 "compensation='coec')`): ceil rounding keeps every KV group up to 30%, so its realized fraction "
                 "differs. Grams (and the `coec` row's scores) come from their own calibration set: "
                 f"{c['source']} {c['n']} x {c['seqlen']}, seed {c['seed']} (token sha256 {c['sha256'][:16]}...), "
                 "checked to share no 32-token run with the held-out split; an earlier run that fitted COEC (1 "
                 "round) on the 4 x 256 graph windows raised held-out KL.\n")
        dz = find_dense_zeroshot()
        L.append(f"Zero-shot: seven-task mean on the first {ZS_LIMIT} documents per task (dense "
                 f"{fmt_zs(dz)}).\n")
        L.append("| rho | method | realized | KL (± SE) | WT2 | C4 | PTB | zero-shot | params (M) | mean rounds | "
                 "compensation (s) |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for rho in sorted({r["rho"] for r in comp}):
            for m in ("cocurve", "cocurve+coec", "wanda_sp", "wanda_sp+coec", "coec"):
                pool = comp if m in COEC_METHODS else rows
                r = next((x for x in pool if x["rho"] == rho and x["method"] == m), None)
                if r:
                    L.append(f"| {rho:.0%} | {m} | {100 * r['realized']:.2f}% | {r['heldout_kl']:.4f} ± "
                             f"{r['heldout_se']:.4f} | " + " | ".join(fmt(r["ppl"][c]["ppl"]) for c in CORPORA)
                             + f" | {fmt_zs(r.get('zeroshot'))} | {r['params'] / 1e6:.1f} | "
                             f"{fmt(r.get('rounds_mean'), 1)} | "
                             f"{fmt(r.get('compensation_s'), 0)} |")
    L.append("\n## Allocation per layer (removed KV groups of 3 / FFN groups of 16, layers 0..29)\n")
    L.append(f"![allocation]({OUT_PNG.name})\n")
    L.append("| rho | method | KV groups removed per layer | FFN groups removed per layer |")
    L.append("|---|---|---|---|")
    for rho in sorted({r["rho"] for r in rows if r["method"] != "dense"}):
        for m in METHODS:
            r = next((x for x in rows if x["rho"] == rho and x["method"] == m), None)
            if r:
                L.append(f"| {rho:.0%} | {m} | `{''.join(str(x) for x in r['alloc']['attn'])}` | "
                         f"`{' '.join(str(x) for x in r['alloc']['ffn'])}` |")
    L.append("\n## CoCurve lambda paths (held-out KL of every distinct mask)\n")
    for r in rows:
        if r["method"] == "cocurve":
            path = "; ".join(f"λ={c['lambda']:.2f}: {c['heldout_kl']:.4f}" for c in r["candidates"])
            L.append(f"* {r['rho']:.0%}: chosen λ̂ = {r['lambda']:.2f} (one-SE set: "
                     f"{[r['candidates'][i]['lambda'] for i in r['one_se_set']]}); {path}")
    L.append("\n## Artifacts (CoCurve rows: sliced and exported)\n")
    L.append("| rho | method | export route | folder | mask sha256 |")
    L.append("|---|---|---|---|---|")
    for r in sorted(rows, key=lambda x: (x["rho"], x["method"])):
        if "export" in r:
            L.append(f"| {r['rho']:.0%} | {r['method']} | {r['export'].get('route', '-')} | "
                     f"`{Path(r['export']['mask_file']).parent.name}` | `{r.get('mask_sha256', '-')[:16]}…` |")
    from efficiency_smollm2 import table as efficiency_table  # fresh process per model, quiet machine

    eff = efficiency_table("cocurve")
    # the rows' own in-process numbers (2 cores shared by other jobs, load 10-16) are not reported: load artifacts
    L += eff[1:] if eff else ["", "Efficiency: not measured yet in fresh processes "
                              "(`python bench/efficiency_smollm2.py --measure --models cocurve`)."]
    L.append("")
    OUT_MD.write_text("\n".join(L) + "\n")
    try:
        plot(rows)
    except ImportError:
        print("matplotlib missing: no plot")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=["graph", "rows", "coec", "zs"], default=None)
    ap.add_argument("--preset", default="quick", choices=sorted(PRESETS))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rhos", default=",".join(str(r) for r in RHOS))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--zs", action="store_true", help="--stage coec: add the zero-shot column (first 100 docs/task)")
    ap.add_argument("--render", action="store_true")
    args = ap.parse_args()
    if args.stage == "graph":
        stage_graph(args.preset, args.ranks)
    elif args.stage == "rows":
        stage_rows(args.preset, [float(x) for x in args.rhos.split(",")], args.methods.split(","),
                   not args.no_dense)
    elif args.stage == "coec":
        ms = tuple(m for m in args.methods.split(",") if m in COEC_METHODS) or COEC_METHODS
        stage_coec(args.preset, [float(x) for x in args.rhos.split(",")], ms, zs=args.zs)
    elif args.stage == "zs":  # the main table's zero-shot column (first 100 docs/task), cell by cell
        stage_zs(args.preset, [float(x) for x in args.rhos.split(",")], args.methods.split(","))
    if args.render:
        render()


if __name__ == "__main__":
    main()
