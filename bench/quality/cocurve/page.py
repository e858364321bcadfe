"""CoCurve bench, the pages: every preset's Markdown (tables, checks, the medium section) and the allocation plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.common import (
    RESULTS,
    WORK,
    ZS_LIMIT,
    find_dense_zeroshot,
    fmt,
    fmt_zs,
    read_rows,
)
from bench.quality.cocurve import base as run
from bench.quality.cocurve.base import (
    COEC_METHODS,
    COEC_OPTS,
    CORPORA,
    METHODS,
    PRESETS,
    graph_path,
    md_path,
    png_path,
)


def plot(rows: list[dict], path: Path) -> None:
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
    fig.savefig(path, dpi=110)


# What each preset is, in the words of the pages' header (every page names every preset and whether it has rows).
# The load while each preset's graph was swept (1-minute averages read during the run; the graph file does not
# record it): the selection-cost column's seconds are only comparable through it.
SWEEP_LOAD = {"quick": "load 10-16",
              "medium": "load 3-4.7 during the session-11 sweep, 2 gloo ranks plus other tests"}


PRESET_TEXT = {
    "quick": "4 x 256 graph tokens, 4 x 256 held-out tokens (they choose lambda and give the KL column), first "
             "sliding window per corpus",
    "medium": "graph on 16 x 512 C4 tokens (seed 0); lambda chosen on 16 x 512 disjoint held-out tokens; KL "
              "column on an independent 16 x 512 test split (chooses nothing; the three splits come from disjoint "
              "C4 documents); positions scaled from the paper's "
              "2048-token protocol at its stride (P_tok 128 at 2048 -> 32 at 512: one position every 16 tokens), "
              "top-r 256 kept (a vocabulary support size, not a length); rows at 20% and 30%: CoCurve, its diagonal "
              "control, Wanda-sp, FLAP, random (same units, guard, budget), CoCurve + COEC, Wanda-sp + COEC; "
              "perplexity at nonoverlap-2048 on the first 16 windows of WikiText-2, C4 and PTB (named), and on "
              "every WikiText-2 window for the 30% CoCurve row (dense: 21.61 there); zero-shot (first 100 "
              "documents per task) for CoCurve, diagonal, Wanda-sp and CoCurve + COEC at 30%",
    "full": "the paper's protocol: 128 x 2048 graph tokens, P_tok 128, r 256, 16 x 2048 held-out (lambda) + an "
            "independent 16 x 2048 test split, every perplexity window; for one GPU: "
            "`bench/quality/device_cocurve_full.sh` (the sweep, the lambda choice and the 30% row); probed on an H200 "
            "(`device-check-h200.md`): a sweep of ~700 s in TF32, ~1,090 s in float32, more than a 15-minute lease",
    "smoke": "plumbing check",
    "tiny": "plumbing check of `bench/quality/device_cocurve_full.sh` on a random tiny Llama",
}


def _kl(r: dict) -> tuple[float, float]:
    """The KL column: the test split's when the preset has one, else the held-out split C' (which chose lambda)."""
    return (r["test_kl"], r["test_se"]) if "test_kl" in r else (r["heldout_kl"], r["heldout_se"])


def graph_summary(preset: str) -> tuple[dict, str | None]:
    """The graph's metadata and file name: from the ``.npz`` when it is on disk (its summary is then written to
    ``results/text/cocurve-smollm2-graph-<preset>.json``), else from that summary (the npz lives in the git-ignored
    work folder)."""
    gp = graph_path(preset)
    side = run.RESULTS_DIR / f"cocurve-smollm2-graph-{preset}.json"
    if gp.exists():
        from secateur.scoring.cocurve_graph import CoPruningGraph, array_sha256, bytes_sha256

        g = CoPruningGraph.load(gp)
        name = str(gp.relative_to(WORK.parent.parent)) if gp.is_relative_to(WORK.parent.parent) else gp.name
        meta = {k: g.meta[k] for k in ("n_ablated", "n_units", "n_positions", "support_mass", "lambda_min",
                                       "timings", "float32_matmul_precision", "split_half", "split_half_subsample")
                if k in g.meta}
        meta |= {"wall_s": g.meta.get("wall_s", 0), "file_sha256": bytes_sha256(gp.read_bytes()),
                 "H_sha256": array_sha256(g.H), "file": name, "device": g.meta.get("device", "cpu")}
        side.write_text(json.dumps(meta, indent=1, default=str) + "\n")
        return meta, name
    if side.exists():
        meta = json.loads(side.read_text())
        return meta, meta["file"]
    return {}, None


def claim_check(rows: list[dict], has_test: bool) -> list[str]:
    """CoCurve below its diagonal control (the paper's claim), at 20% and 30%, on the KL column and on every
    perplexity, said plainly where it does not hold."""
    L = ["## Claim check: CoCurve below its diagonal control at 20% and 30%\n"]
    kl_name = "test-split KL" if has_test else "held-out KL (C', the split that chose CoCurve's lambda)"
    L.append(f"From the rows: CoCurve's {kl_name} and perplexities against the diagonal control's (lambda = 0, "
             "same graph, units, guard and budget). 'holds' = CoCurve strictly lower; for the KL the difference "
             "is also given in units of the combined SE (sqrt(SE_a^2 + SE_b^2)); perplexities carry no SE here.\n")
    L.append("| rho | measure | CoCurve | diagonal | CoCurve - diagonal | below the diagonal? |")
    L.append("|---|---|---|---|---|---|")
    verdicts = []
    for rho in (0.2, 0.3):
        by = {r["method"]: r for r in rows if r["rho"] == rho}
        cc, dg = by.get("cocurve"), by.get("cocurve-diag")
        if cc is None or dg is None:
            verdicts.append(f"* {rho:.0%}: not measured (no CoCurve and diagonal rows at this budget).")
            continue
        fails = []
        (a, sa), (b, sb) = _kl(cc), _kl(dg)
        z = (a - b) / math.hypot(sa, sb) if math.hypot(sa, sb) > 0 else float("nan")
        ok = a < b
        L.append(f"| {rho:.0%} | {kl_name.split(' (')[0]} | {a:.4f} ± {sa:.4f} | {b:.4f} ± {sb:.4f} | "
                 f"{a - b:+.4f} ({z:+.1f} SE) | {'holds' if ok else '**does not hold**'} |")
        if not ok:
            fails.append(f"{kl_name.split(' (')[0]} ({a:.4f} vs {b:.4f})")
        kl_weak = ok and z > -2
        for col, label in (("ppl", "PPL"), ("ppl_full", "PPL, every window")):
            if col not in cc or col not in dg:
                continue
            for c in CORPORA:
                if c not in cc[col] or c not in dg[col]:
                    continue
                x, y = cc[col][c]["ppl"], dg[col][c]["ppl"]
                w = cc[col][c]["windows"]
                ok = x < y
                L.append(f"| {rho:.0%} | {c} {label} ({w} windows) | {x:.2f} | {y:.2f} | {x - y:+.2f} | "
                         f"{'holds' if ok else '**does not hold**'} |")
                if not ok:
                    fails.append(f"{c} {label} ({x:.2f} vs {y:.2f})")
        if cc.get("mask_sha256") and cc.get("mask_sha256") == dg.get("mask_sha256"):
            verdicts.append(f"* {rho:.0%}: **does not hold**: the held-out split chose lambda = "
                            f"{cc.get('lambda', 0):.2f}, so CoCurve's mask is the diagonal control's (same sha256); "
                            "the off-diagonal (co-pruning) term brought no gain here that the held-out split saw.")
        elif fails:
            verdicts.append(f"* {rho:.0%}: **does not hold** on " + "; ".join(fails) + "; holds on the rest.")
        else:
            verdicts.append(f"* {rho:.0%}: holds on every measure above"
                            + (f" (the KL gap is within 2 combined SE: {z:+.1f})." if kl_weak else "."))
    L.append("")
    L += verdicts
    if not has_test:
        L.append("* Caveat: this preset has no test split, so CoCurve's KL is measured on the split that chose its "
                 "lambda (optimistic for CoCurve; the diagonal control chooses nothing). The perplexities are "
                 "independent of the selection.")
    L.append("")
    return L


def paired_claim_check(rows: list[dict]) -> list[str]:
    """Issue 45's claim check: each arm's test-split KL minus the diagonal control's, sequence by sequence (both are
    scored on the same test windows, so the SE is that of the per-sequence differences, not sqrt(SE_a^2 + SE_b^2)),
    and the realized budgets side by side (a comparison counts only where they match within one unit)."""
    from secateur.budgets.heldout import standard_error

    L = ["## Claim check, paired (issue 45): does the edge term beat its diagonal by more than noise?\n",
         "Per budget: mean over the test windows of KL(arm) - KL(diagonal control), and the SE of those "
         "per-sequence differences (paired SE); 'beats' = difference < -1 paired SE. The unpaired SE "
         "(sqrt(SE_a^2 + SE_b^2)) of earlier pages is shown for comparison. Budget: realized fraction of the "
         "removable parameters; 'Δ units' = (arm - diagonal) removed parameters / the largest unit's cost.\n",
         "| rho | arm | λ | realized | diagonal realized | Δ units | test KL arm | test KL diag | mean diff | "
         "paired SE | unpaired SE | beats the diagonal? |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for rho in sorted({r["rho"] for r in rows if r["method"] != "dense"}):
        by = {r["method"]: r for r in rows if r["rho"] == rho}
        dg = by.get("cocurve-diag")
        if dg is None or "test_per_sequence" not in dg:
            continue
        for arm in ("cocurve", "cocurve-fixed", "wanda_sp", "flap"):
            r = by.get(arm)
            if r is None or "test_per_sequence" not in r:
                continue
            d = [a - b for a, b in zip(r["test_per_sequence"], dg["test_per_sequence"], strict=True)]
            mean, se = sum(d) / len(d), standard_error(d)
            unpaired = math.hypot(r["test_se"], dg["test_se"])
            unit = r.get("max_unit_params")
            du_units = f"{(dg['params'] - r['params']) / unit:+.2f}" if unit else "-"  # more removed: positive
            beats = mean < -se
            L.append(f"| {rho:.0%} | {arm} | {fmt(r.get('lambda'))} | {100 * r['realized']:.2f}% | "
                     f"{100 * dg['realized']:.2f}% | {du_units} | {r['test_kl']:.4f} | {dg['test_kl']:.4f} | "
                     f"{mean:+.4f} | {se:.4f} | {unpaired:.4f} | {'**yes**' if beats else 'no'} |")
            if arm.startswith("cocurve"):
                verdicts.append(f"* {rho:.0%}, {arm}: " + (
                    f"beats the diagonal by {-mean / se:.1f} paired SE" if beats and se > 0 else
                    "the same mask as the diagonal (the paired rule kept lambda = 0)" if mean == 0 else
                    f"does **not** beat the diagonal by more than its paired SE ({mean:+.4f} vs SE {se:.4f})"))
    return L + [""] + verdicts + [""]


def split_half_section(meta: dict, p: dict) -> list[str]:
    """The graph's split-half agreement from every position against that of medium's 32-position subsample (the
    same features: ``SweepConfig.subsample_check``)."""
    sh, sub = meta.get("split_half"), meta.get("split_half_subsample")
    if not sh or not sh.get("available"):
        return []
    L = ["## Split-half agreement: every position against medium's 32-position subsample\n",
         "H from the even-numbered graph windows against H from the odd ones, over the ablated units "
         "(`secateur.scoring.cocurve_graph.split_half_agreement`): Spearman of the diagonals, Pearson of the "
         "normalized edges H_uv / sqrt(H_uu H_vv) and its Spearman-Brown reliability (the agreement expected of the "
         "whole graph against another of the same size); the edge term is trusted from Pearson 0.5. The 32-position "
         "graph is the subsample of medium's protocol (one position every 16 tokens) from the same sweep's features, "
         "so the two columns differ only in the positions.\n",
         "| positions per window | units | diagonal Spearman | edge Pearson | edge reliability | edges trusted |",
         "|---|---|---|---|---|---|"]
    every = p["positions"] or p["seqlen"]
    for name, x in ((f"{every} (every position)" if not p["positions"] else str(every), sh),
                    (f"{(sub or {}).get('positions_per_window')} (subsample)", sub)):
        if x:
            L.append(f"| {name} | {x['units']} | {fmt(x['diag_spearman'], 3)} | {fmt(x['edge_pearson'], 3)} "
                     f"| {fmt(x['edge_reliability'], 3)} | {'yes' if x['edges_trusted'] else 'no'} |")
    return L + [""]


def presets_header(rows_all: list[dict], preset: str) -> str:
    have = {r["preset"] for r in rows_all}
    parts = []
    for name, text in PRESET_TEXT.items():
        if name == preset:
            status = "this page"
        elif name in have:
            status = f"rows present: `{md_path(name).name}`"
        elif run.RESULTS_DIR == RESULTS / "text":
            status = "defined, not yet run"
        else:
            status = f"no rows in {run.RESULTS_DIR.name}/"
        parts.append(f"**{name}** ({status}): {text}")
    return ("Presets of `bench/quality/cocurve_smollm2.py` (`--dry-run --preset NAME` prints a preset's plan and "
            "cost): "
            + "; ".join(parts) + ".\n")


def _ppl_protocol(p: dict) -> str:
    """The preset's perplexity protocol in words (``eval.ppl.protocol_id`` names)."""
    from secateur.eval.ppl import protocol_id

    return f"`{protocol_id(p.get('ppl_seqlen', 2048), p.get('ppl_stride', 512))}`"


def medium_section(rows_all: list[dict]) -> list[str]:
    """The quick page's section on the medium protocol (issue 26): its plan (``--dry-run``, measured here), how far
    the run is (graph blocks, rows), and where its rows are."""
    L = ["", "## Medium protocol (issue 26)", ""]
    plan_file = run.RESULTS_DIR / "cocurve-smollm2-medium-plan.json"
    if plan_file.exists():
        plan = json.loads(plan_file.read_text())
        rate = plan["measured_dense_forward"]
        L.append(f"`python bench/quality/cocurve_smollm2.py --preset medium --dry-run` (run by "
                 f"`bench/quality/cocurve_medium.sh`, "
                 f"{rate['cpu']}, 1 thread, load {rate['load_before']} before): "
                 f"{plan['ablations']} ablations x {plan['ablation_over_dense_forward']:.3f}; "
                 f"{plan['cost_dense_forward_tokens']['total'] / 1e6:.2f} M dense forward-tokens; a dense forward "
                 f"measured at {rate['s_per_token_at_512'] * 1e3:.2f} ms/token (512) and "
                 f"{rate['s_per_token_at_2048'] * 1e3:.2f} ms/token (2048) on one thread; estimate "
                 f"{plan['estimate_hours']} h with every stage in one process, "
                 f"**{plan['estimate_hours_rows_in_2_processes']} h** with the sweep over 2 ranks and the rows in "
                 f"two lanes (one per rho). Parts (s): {json.dumps(plan['estimate_wall_s'])}.")
    rows = [r for r in rows_all if r.get("preset") == "medium"]
    meta = graph_summary("medium")[0]  # the npz (git-ignored) or its committed summary: a clone renders the same
    if meta:
        L.append(f"\nGraph: built, {meta.get('wall_s', 0) / 3600:.2f} h wall over "
                 f"{meta.get('timings', {}).get('world_size')} ranks (H sha256 in the rows).")
    else:
        from secateur.calib.resume import checkpoint_dir

        g = graph_path("medium")
        done = len(list(checkpoint_dir(g).glob("sweep0-block*.pt"))) if checkpoint_dir(g).exists() else 0
        L.append(f"\nGraph: in progress, {done} of {PRESETS['medium']['n_graph']} blocks of sequences checkpointed "
                 "(`--resume` continues it bit-identically: `tests/test_cocurve_resume.py`).")
    if rows:
        L.append(_measured_cost(rows, meta))
    if not rows:
        L.append("\nNo medium rows yet; `bench/quality/cocurve_medium.sh` (rerun it after a stop) continues "
                 "where it stopped.")
        return L
    names = ", ".join(sorted({f"{r['method']}@{r['rho']}" for r in rows}))
    L.append(f"\nRows landed: {len(rows)} ({names}); every column, the lambda paths and the artifacts are on "
             f"the medium page: [{md_path('medium').name}]({md_path('medium').name}).\n")
    L += [x.replace("## ", "### ", 1) if x.startswith("## ") else x for x in claim_check(rows, True)]
    L += baseline_check(rows)
    L += rank_change([r for r in rows_all if r.get("preset") == "quick"], rows)
    L.append(f"\n![medium allocation]({png_path('medium').name})\n")
    return L


def _measured_cost(rows: list[dict], graph_meta: dict) -> str:
    """What the medium plan cost, measured: the graph's wall time and every row's own seconds (selection +
    evaluation, or a COEC row's wall; zero-shot cells), against the dry run's estimate."""
    secs = sum((r["wall_s"] if "wall_s" in r else (r.get("selection_s") or 0) + (r.get("eval_s") or 0))
               + ((r.get("zeroshot") or {}).get("seconds") or 0) for r in rows)
    loads = [r["load_avg_1_5_15"][0] for r in rows if r.get("load_avg_1_5_15")]
    gw = graph_meta.get("wall_s", 0) / 3600
    return (f"\nMeasured: graph {gw:.2f} h wall (2 ranks); the {len(rows)} rows' own seconds sum to "
            f"{secs / 3600:.2f} h (selection + evaluation, COEC rows' wall, zero-shot cells), run in two lanes (one "
            f"per rho), so about {gw + secs / 7200:.1f} h of wall in all, at load {min(loads, default=0):.1f}-"
            f"{max(loads, default=0):.1f} when rows were written (the estimate assumes a quiet machine, one process "
            "per core). The run spanned three sessions (resumed each time; finished rows are skipped).")


SELECTORS = ("cocurve", "cocurve-diag", "wanda_sp", "flap", "random")  # the masks-only rows (COEC rows aside)


def baseline_check(rows: list[dict]) -> list[str]:
    """CoCurve against the best masks-only baseline (lowest test KL among Wanda-sp, FLAP, random), per rho."""
    L = ["### CoCurve against the best baseline\n",
         "Best baseline = the lowest test-split KL among Wanda-sp, FLAP and random at the same budget; ΔKL in units "
         "of the combined SE. PPL: nonoverlap-2048, first 16 windows.\n",
         "| rho | CoCurve KL | best baseline (KL) | ΔKL (SE) | WT2 | C4 | PTB (CoCurve / baseline) | lower? |",
         "|---|---|---|---|---|---|---|---|"]
    for rho in (0.2, 0.3):
        by = {r["method"]: r for r in rows if r["rho"] == rho and r["method"] in SELECTORS}
        base = [by[m] for m in ("wanda_sp", "flap", "random") if m in by]
        if "cocurve" not in by or not base:
            L.append(f"| {rho:.0%} | not measured | | | | | | |")
            continue
        cc, bb = by["cocurve"], min(base, key=lambda r: _kl(r)[0])
        (a, sa), (b, sb) = _kl(cc), _kl(bb)
        ppl = [f"{cc['ppl'][c]['ppl']:.2f} / {bb['ppl'][c]['ppl']:.2f}" for c in CORPORA]
        wins = sum(cc["ppl"][c]["ppl"] < bb["ppl"][c]["ppl"] for c in CORPORA) + (a < b)
        L.append(f"| {rho:.0%} | {a:.4f} ± {sa:.4f} | {bb['method']} {b:.4f} ± {sb:.4f} | {a - b:+.4f} "
                 f"({(a - b) / math.hypot(sa, sb):+.1f}) | {' | '.join(ppl)} | {wins} of 4 measures |")
    return L + [""]


def _ranks(rows: list[dict], rho: float, key) -> dict[str, int]:
    """1 = best; equal values share a rank (CoCurve whose lambda is 0 has the diagonal control's mask)."""
    vals = {r["method"]: key(r) for r in rows if r["rho"] == rho and r["method"] in SELECTORS}
    return {m: 1 + sum(v < vals[m] for v in vals.values()) for m in vals}


def rank_change(quick: list[dict], medium: list[dict]) -> list[str]:
    """Each masks-only method's rank (1 = best) by WikiText-2 perplexity at the quick and the medium preset: what
    the larger graph and the independent splits did to the ordering (absolute values differ: other windows)."""
    L = ["### Quick to medium: each method's rank\n",
         "Rank by WikiText-2 perplexity (1 = lowest) among the masks-only rows of the same budget; quick: first "
         "sliding window, medium: first 16 nonoverlap-2048 windows, so ranks compare and values do not.\n",
         "| rho | method | quick rank (WT2) | medium rank (WT2) | medium rank (test KL) |", "|---|---|---|---|---|"]
    wt2 = lambda r: r["ppl"]["wikitext2"]["ppl"]  # noqa: E731
    for rho in (0.2, 0.3):
        q, m, k = _ranks(quick, rho, wt2), _ranks(medium, rho, wt2), _ranks(medium, rho, lambda r: _kl(r)[0])
        for meth in SELECTORS:
            if meth in q or meth in m:
                L.append(f"| {rho:.0%} | {meth} | {q.get(meth, '-')} of {len(q)} | {m.get(meth, '-')} of {len(m)} | "
                         f"{k.get(meth, '-')} of {len(k)} |")
    return L + [""]


def render() -> None:
    """Every preset with rows -> its page (``md_path``)."""
    rows_all = read_rows(run.OUT_JSON)
    if not rows_all:
        raise SystemExit("no rows")
    presets = list(dict.fromkeys(r["preset"] for r in rows_all))
    # a preset whose graph is swept but whose rows are not yet measured: its page shows the graph (and its
    # split-half agreement) with the rows to come (medium-all: its graph alone is about 3 CPU-hours)
    presets += [p for p in PRESETS if p not in presets and p not in ("smoke", "tiny") and graph_summary(p)[1]]
    for preset in presets:
        render_preset(preset, rows_all)


def _head(preset: str, p: dict, rows_all: list[dict], has_test: bool) -> list[str]:
    """The page's title, its preset, every preset's status and the protocol in one paragraph."""
    L = []
    L.append("# CoCurve on SmolLM2-135M (structured, masks only)\n")
    L.append(f"Preset **{preset}**: {json.dumps(p)}. Generated by `bench/quality/cocurve_smollm2.py` "
             "(see its docstring for the protocol); rows in `results/text/cocurve-smollm2.jsonl`.\n")
    L.append(presets_header(rows_all, preset))
    L.append("Units: 30 layers x (3 KV groups + 16 contiguous FFN groups) = 570; cost = removable parameters; "
             "guards: layers 0, 1, 28, 29 protected, per-layer cap 1.5 rho; every method uses the same "
             "inventory, guard and budget (shared greedy solver; CoCurve its conditional greedy). KL = "
             "full-vocabulary teacher KL on the "
             + ("independent test windows; the held-out windows C' only choose lambda;" if has_test
                else "held-out windows") + " (mean per token, ± SE over sequences). PPL = "
             + _ppl_protocol(p) + ", "
             + (f"first {p['ppl_windows']} windows" if p["ppl_windows"] else "every window") + " of each corpus. "
             "Selection cost: CoCurve = ablation sweep (shared by all budgets and by the diagonal control) + "
             "lambda path + held-out KL of every candidate; baselines = statistics pass + scoring.\n")
    return L


def _graph_section(graph_meta: dict, graph_file: str | None, p: dict) -> list[str]:
    """H: what was ablated, what the sweep cost, the file's and H's sha256 (nothing without a graph)."""
    L = []
    if graph_meta:
        t = graph_meta["timings"]
        L.append("## Graph (H, built once)\n")
        L.append(f"* ablated units: {graph_meta['n_ablated']} of {graph_meta['n_units']} (units of protected "
                 f"layers are never eligible, so they are not ablated); positions P = {graph_meta['n_positions']}; "
                 f"mean top-{p['top_r']} teacher mass {graph_meta['support_mass']:.3f}; "
                 f"lambda_min(H) = {graph_meta['lambda_min']:.2e}")
        where = (f"on {graph_meta.get('device', 'cpu')}, one process" if t["world_size"] == 1
                 else f"over {t['world_size']} gloo ranks")
        if graph_meta.get("float32_matmul_precision", "highest") != "highest":
            where += f" (float32 products at precision {graph_meta['float32_matmul_precision']!r}: TF32)"
        L.append(f"* sweep: {t['n_ablations']} ablations (unit x block) in {t['ablations_s']:.0f} rank-s "
                 f"+ dense {t['dense_s']:.1f} s {where} "
                 f"(wall {graph_meta.get('wall_s', 0):.0f} s); "
                 f"**time per ablation / one dense forward = {t['ablation_over_dense']:.3f}** "
                 f"({t['per_ablation_s']:.3f} s vs {t['dense_forward_per_block_s']:.3f} s for "
                 f"{t['tokens_per_block']} "
                 "tokens; only layers after the unit are re-run, LM head at the sampled positions only)")
        L.append(f"* `{graph_file}`: file sha256 `{graph_meta['file_sha256']}`, "
                 f"H sha256 `{graph_meta['H_sha256']}`\n")
    return L


def _summary(rows: list[dict], dense: dict | None) -> list[str]:
    """The dense row's line and the summary table (CoCurve against its diagonal control and the baselines)."""
    L = []
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
        if not bases or dg is None:
            continue
        bk = min(bases, key=lambda r: _kl(r)[0])
        bw = min(bases, key=lambda r: r["ppl"]["wikitext2"]["ppl"])
        L.append(f"| {rho:.0%} | {_kl(cc)[0] - _kl(dg)[0]:+.3f} | "
                 f"{_kl(cc)[0] - _kl(bk)[0]:+.3f} ({bk['method']}) | "
                 f"{cc['ppl']['wikitext2']['ppl']:.1f} / {bw['ppl']['wikitext2']['ppl']:.1f} ({bw['method']}) |")
    if L[-1] == "|---|---|---|---|":
        L.append("| - | no budget with CoCurve, its diagonal control and a baseline yet | | |")
    L.append("")
    return L


def _notes(preset: str, has_test: bool) -> list[str]:
    """The numbered notes under the summary."""
    L = []
    n1 = ("the quick preset is tiny (1024 graph tokens, 1024 held-out tokens, one 2048-token "
          "window per corpus): differences within a few SE of the KL are not significant, and perplexities "
          "of pruned 135M models without recovery are in the hundreds to thousands for every method. "
          if preset == "quick" else f"preset {preset}: see the presets above for its token counts. ")
    n5 = ("The KL column is the independent test split's; the held-out split C' chose CoCurve's lambda (its KL "
          "for every candidate is in the lambda paths below)." if has_test else
          "The KL column of CoCurve is measured on the split that chose its lambda "
          "(the paper's C'), so it is optimistic for CoCurve; the perplexities are independent of selection, "
          "and the diagonal control (one candidate, nothing chosen) has an unbiased KL.")
    L.append("Notes: (1) " + n1 +
             "(2) Budget granularity: a SmolLM2 KV group is 294,912 parameters = 0.28% of C, so the greedy's "
             "guaranteed overshoot bound (< one unit) exceeds the paper's 0.2 pp acceptance window; rows "
             "above 0.2 pp are kept and marked by their realized fraction (the 0.2 pp check is enforced in "
             "tests on a geometry where it is attainable). (3) Selection cost of CoCurve counts the sweep's "
             "rank-seconds (each rank's wall time, summed over both ranks; the sweep's wall time is in the graph "
             "section), on 2 cores shared with other jobs (" + SWEEP_LOAD.get(preset, "load not recorded") +
             "): compare the ablation/dense ratio, not the seconds. (4) Baselines rank "
             "per parameter (score / cost) for Wanda-sp and magnitude, raw for FLAP (standardized scores) "
             "and random. (5) " + n5 + "\n")
    return L


def _quality(rows: list[dict]) -> list[str]:
    """The main table: every masks-only row."""
    L = []
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
                     "{:.4f} ± {:.4f} | ".format(*_kl(r))
                     + " | ".join(fmt(r["ppl"][c]["ppl"]) for c in CORPORA)
                     + f" | {fmt_zs(r.get('zeroshot'))} | {fmt(r.get('lambda'))} | "
                     f"{len(r['candidates']) if 'candidates' in r else '-'} | "
                     f"{sum(a['attn'])} / {sum(a['ffn'])} | {r['params'] / 1e6:.1f} | {r['selection_cost_s']:.0f} |")
    return L


def _coec_section(rows: list[dict], has_test: bool) -> list[str]:
    """CoCurve selection + COEC compensation against each alone (nothing without COEC rows)."""
    L = []
    comp = [r for r in rows if r["method"] in COEC_METHODS and r.get("coec_rounds") == COEC_OPTS["max_rounds"]]
    if comp:
        c = comp[0]["comp_calibration"]
        L.append("\n## CoCurve selection + COEC compensation vs each alone\n")
        L.append("`X+coec`: the mask of row X above (CoCurve: its saved mask; Wanda-sp: recomputed, sha256 checked), "
                 f"then COEC with the paper's defaults (alpha 0.9, GCV, reduced Stiefel, alignment on o_proj, <= "
                 f"{COEC_OPTS['max_rounds']} rounds, tol 1e-4; `secateur.methods.materialize.compensate_selection`, "
                 "slice-only fallback where COEC would raise the calibration error) on every o_proj/down_proj that "
                 "lost columns. `coec`: COEC's own pipeline (RCPU score, KV groups + single MLP channels, uniform "
                 "ceil allocation per layer, **no layer guard**; `prune_structured(score='rcpu', "
                 "compensation='coec')`): ceil rounding keeps every KV group up to 30%, so its realized fraction "
                 "differs. Grams (and the `coec` row's scores) come from their own calibration set: "
                 f"{c['source']} {c['n']} x {c['seqlen']}, seed {c['seed']} (token sha256 {c['sha256'][:16]}...), "
                 "checked to share no 32-token run with the held-out split" + (" and the test split" if has_test
                                                                                else "") + "; an earlier run that "
                 "fitted COEC (1 round) on the 4 x 256 graph windows raised held-out KL.\n")
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
                    L.append(f"| {rho:.0%} | {m} | {100 * r['realized']:.2f}% | "
                             "{:.4f} ± {:.4f} | ".format(*_kl(r)) + " | ".join(fmt(r["ppl"][c]["ppl"]) for c in CORPORA)
                             + f" | {fmt_zs(r.get('zeroshot'))} | {r['params'] / 1e6:.1f} | "
                             f"{fmt(r.get('rounds_mean'), 1)} | "
                             f"{fmt(r.get('compensation_s'), 0)} |")
    return L


def _alloc_and_lambdas(rows: list[dict], preset: str) -> list[str]:
    """The allocation per layer (plot + table) and CoCurve's lambda paths."""
    L = []
    if not any(r["method"] != "dense" for r in rows):
        return L  # no pruned rows yet: no allocation (and no plot)
    L.append("\n## Allocation per layer (removed KV groups of 3 / FFN groups of 16, layers 0..29)\n")
    L.append(f"![allocation]({png_path(preset).name})\n")
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
    return L


def _artifacts(rows: list[dict]) -> list[str]:
    """The exported rows' folders and masks, and the rows measured on every perplexity window."""
    L = []
    L.append("\n## Artifacts (CoCurve rows: sliced and exported)\n")
    L.append("| rho | method | export route | folder | mask sha256 |")
    L.append("|---|---|---|---|---|")
    for r in sorted(rows, key=lambda x: (x["rho"], x["method"])):
        if "export" in r:
            L.append(f"| {r['rho']:.0%} | {r['method']} | {r['export'].get('route', '-')} | "
                     f"`{Path(r['export']['mask_file']).parent.name}` | `{r.get('mask_sha256', '-')[:16]}…` |")
    full = [r for r in rows if "ppl_full" in r]
    if full:
        proto = next(iter(full[0]["ppl_full"].values())).get("protocol") or "sliding-2048-512"
        L.append(f"\n## Perplexity on every window ({proto})\n")
        L.append("| rho | method | " + " | ".join(f"{c} (windows)" for c in CORPORA) + " |")
        L.append("|---|---|" + "---|" * len(CORPORA))
        for r in sorted(full, key=lambda x: (x["rho"], x["method"])):
            f = r["ppl_full"]
            L.append(f"| {r['rho']:.0%} | {r['method']} | " + " | ".join(
                f"{f[c]['ppl']:.2f} ({f[c]['windows']})" if c in f else "-" for c in CORPORA) + " |")
    return L


def _quick_tail(rows_all: list[dict]) -> list[str]:
    """The quick page's end: the exports' efficiency table and the medium preset's section."""
    L = []
    from bench.speed.efficiency_table import table as efficiency_table  # fresh process per model, quiet machine

    eff = efficiency_table("cocurve")
    # the rows' own in-process numbers (2 cores shared by other jobs, load 10-16) are not reported
    L += eff[1:] if eff else ["", "Efficiency: not measured yet in fresh processes "
                              "(`python bench/speed/efficiency_smollm2.py --measure --models cocurve`)."]
    L += medium_section(rows_all)
    return L


def _medium_all_beside(rows_all: list[dict]) -> list[str]:
    """The medium page's pointer to the same windows' rows with the graph from every position (issue 45): their
    paired claim check and the two graphs' split-half agreement, the whole page beside it."""
    rows = [r for r in rows_all if r["preset"] == "medium-all"]
    name = md_path("medium-all").name
    L = ["\n# The same windows, the graph from every position (issue 45, preset medium-all)\n",
         f"Breakpoint lambda family, paired one-SE choice, the fixed-split arm and 40%; the whole page: "
         f"[{name}]({name}) (`bench/quality/cocurve_medium_all.sh`, resumable).\n"]
    meta = graph_summary("medium-all")[0]
    if not rows:
        return L + [("The graph is swept; the rows are not yet measured (`bench/quality/cocurve_medium_all.sh` "
                     "continues with them)." if meta else "No rows yet: the graph is being swept.") + "\n"] \
            + split_half_section(meta, PRESETS["medium-all"])
    return L + paired_claim_check(rows) + split_half_section(meta, PRESETS["medium-all"])


def render_preset(preset: str, rows_all: list[dict]) -> None:
    rows = [r for r in rows_all if r["preset"] == preset]
    p = PRESETS[preset]
    has_test = any("test_kl" in r for r in rows)
    dense = next((r for r in rows if r["method"] == "dense"), None)
    graph_meta, graph_file = graph_summary(preset)
    L = _head(preset, p, rows_all, has_test)
    L += _graph_section(graph_meta, graph_file, p)
    L += _summary(rows, dense)
    L += _notes(preset, has_test)
    L += claim_check(rows, has_test)
    if any("test_per_sequence" in r for r in rows):
        L += paired_claim_check(rows)
    L += split_half_section(graph_meta, p)
    L += _quality(rows)
    L += _coec_section(rows, has_test)
    L += _alloc_and_lambdas(rows, preset)
    L += _artifacts(rows)
    if preset == "quick":  # the efficiency bench measures the quick rows' exported models
        L += _quick_tail(rows_all)
    if preset == "medium":
        L += _medium_all_beside(rows_all)
    L.append("")
    md_path(preset).write_text("\n".join(L) + "\n")
    try:
        if any(r["method"] != "dense" for r in rows):  # a graph without rows yet has nothing to plot
            plot(rows, png_path(preset))
    except ImportError:
        print("matplotlib missing: no plot")
