"""The sections of a ``secateur report``, each a function that appends its blocks to a :class:`Doc`:
perplexity/sparsity/cost (with method x sparsity pivots and perplexity plots), zero-shot accuracy,
structured runs (parameters and kept widths), per-layer allocation plots, QK reconstruction error, and
the protocol manifests. ``plots`` is :mod:`secateur.plots` or ``None`` (matplotlib missing).

Perplexity columns are keyed by (dataset, protocol id, windows used): numbers from different protocols
or window subsets never share a column.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from secateur.eval.zeroshot_tasks import SUITE7
from secateur.report.load import Run, num
from secateur.report.render import Doc, drop_empty, fmt, fmt_int, pct

DATASET_LABELS = {"wikitext2": "WikiText-2", "c4": "C4", "ptb": "PTB"}


def sparsity_label(run: Run) -> str:
    if run.pattern:
        return str(run.pattern)
    return "-" if run.sparsity is None else f"{100 * run.sparsity:.4g}%"


def dataset_label(dataset: str) -> str:
    return DATASET_LABELS.get(dataset, Path(dataset).name)


def _ppl_key(e: dict) -> tuple:
    return (e["dataset"], e["protocol"] or "protocol not recorded", e["windows"], e["windows_total"])


def _ppl_header(key: tuple) -> str:
    dataset, proto, w, wt = key
    win = ("" if w is None else f", {w} windows" if wt is None else f", all {w} windows" if w == wt
           else f", first {w}/{wt} windows")
    return f"{dataset_label(dataset)} PPL [{proto}{win}]"


def _ppl_columns(runs: list[Run]) -> list[tuple]:
    order = {d: i for i, d in enumerate(DATASET_LABELS)}
    keys = {_ppl_key(e) for r in runs for e in r.ppl if e["ppl"] is not None}
    return sorted(keys, key=lambda k: (order.get(k[0], len(order)), k[0], str(k[1]), -(k[2] or 0)))


def _ppl_of(run: Run, key: tuple) -> float | None:
    return next((e["ppl"] for e in reversed(run.ppl) if _ppl_key(e) == key and e["ppl"] is not None), None)



_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|layer)\.(\d+)\.(?:.*\.)?([^.]+)$")


def per_layer_series(run: Run) -> tuple[dict[str, list[float]], str]:
    """Per-layer allocation of a run: ``({label: value per layer}, y label)``; missing layers are NaN.

    Unstructured: realized sparsity per projection role from ``realized_sparsity.per_module`` (module names
    ``...layers.<i>.<...>.<role>``). Structured: the report's per-layer realized fraction, and kept width /
    full width per group where widths are known (kept counts otherwise)."""
    by: dict[str, dict[int, float]] = {}
    for name, v in run.per_module.items():
        if num(v) is None:
            continue
        if str(name).isdigit():
            by.setdefault("realized (params)", {})[int(name)] = 100 * v
            continue
        m = _LAYER.search(str(name))
        if m:
            by.setdefault(m.group(2).removesuffix("_proj"), {})[int(m.group(1))] = 100 * v
    ylabel = "removed (%)"
    widths = all(k.get("width") for k in run.kept)
    for k in run.kept:
        if k.get("layer") is None:
            continue
        val = 100 * (1 - k["kept"] / k["width"]) if widths else k["kept"]
        by.setdefault(f"{k['group']} removed" if widths else f"{k['group']} kept", {})[int(k["layer"])] = val
    if run.kept and not widths:
        ylabel = "kept units (count)"
        by.pop("realized (params)", None)  # different units: counts only
    if not by:
        return {}, ylabel
    n = max(max(d) for d in by.values()) + 1
    return {label: [d.get(i, float("nan")) for i in range(n)] for label, d in by.items()}, ylabel


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", s).strip("-")[:60] or "run"


# ---------------------------------------------------------------------------------------- report


def _runs_table(runs: list[Run], cols: list[tuple]) -> tuple[list[str], list[list[str]]]:
    headers = (["run", "method", "sparsity"] + [_ppl_header(c) for c in cols]
               + ["realized sparsity (targeted)", "realized (all params)", "prune time (s)", "peak RSS (MiB)"])
    rows = [[r.name, r.method, sparsity_label(r)] + [fmt(_ppl_of(r, c), 3) for c in cols]
            + [pct(r.realized), pct(r.realized_all), fmt(r.prune_s, 2), fmt(r.peak_rss_mb, 0)] for r in runs]
    return drop_empty(headers, rows, 3)


def _pivot(runs: list[Run], col: tuple) -> tuple[list[str], list[list[str]]] | None:
    """Method x sparsity for one perplexity column (``a / b`` where several runs share a cell)."""
    have = [r for r in runs if _ppl_of(r, col) is not None]
    levels: list[tuple] = []
    for r in sorted(have, key=order_key):
        lv = (r.pattern is not None, r.sparsity or 0.0, sparsity_label(r))
        if lv not in levels:
            levels.append(lv)
    if len(levels) < 2:
        return None
    methods = list(dict.fromkeys(r.method for r in sorted(have, key=lambda r: not r.is_dense)))
    rows = []
    for m in methods:
        cells = []
        for lv in levels:
            vals = [_ppl_of(r, col) for r in have if r.method == m and sparsity_label(r) == lv[2]]
            cells.append(" / ".join(fmt(v, 3) for v in vals) or "-")
        rows.append([m] + cells)
    return ["method"] + [lv[2] for lv in levels], rows


def order_key(r: Run) -> tuple:
    return (not r.is_dense, r.sparsity if r.sparsity is not None else 2.0, r.pattern is not None)



# ---------------------------------------------------------------------------------------- sections


def intro(doc: Doc, runs: list[Run], title: str, note: str | None) -> None:
    from secateur import __version__

    doc.h(1, title)
    doc.p(f"{len(runs)} run(s), generated by `secateur report` (secateur {__version__}) from the runs' JSON only; "
          "inputs and the files read are listed under Protocols and manifests.")
    if note:
        doc.p(note)


def perplexity(doc: Doc, runs: list[Run], plots) -> None:
    """One row per run, a method x sparsity pivot per perplexity column, a plot per column."""
    cols = _ppl_columns(runs)
    doc.h(2, "Perplexity, sparsity and cost")
    doc.p("One row per run, dense first, then by target sparsity. Perplexity is the token-weighted "
          "`exp(sum NLL / scored tokens)` (field `ppl`) under the protocol id in each column header "
          "(docs/protocols.md); realized sparsity is of the targeted weights and of all parameters; prune time is "
          "the prune phase (model loading and calibration sampling excluded); peak RSS is the pruning process.")
    doc.table(*_runs_table(runs, cols), left=3)
    for c in cols:
        pv = _pivot(runs, c)
        if pv:
            doc.h(3, f"{_ppl_header(c)}: method x sparsity")
            doc.table(*pv, left=1)
    if plots is not None:
        for i, c in enumerate(cols):
            _ppl_plot(doc, runs, plots, i, c)


def _ppl_plot(doc: Doc, runs: list[Run], plots, i: int, c: tuple) -> None:
    series: dict[str, list[tuple[float, float]]] = {}
    dense = None
    for r in runs:
        v = _ppl_of(r, c)
        if v is None or r.sparsity is None:
            continue
        if r.is_dense:
            dense = v
        else:
            series.setdefault(r.method, []).append((r.sparsity, v))
    if series:
        name = f"ppl-vs-sparsity-{i:02d}-{_slug(c[0] if c[0] in DATASET_LABELS else Path(c[0]).stem)}.png"
        doc.img(name, plots.plot_ppl_vs_sparsity(series, dense, _ppl_header(c)),
                f"perplexity against sparsity: {_ppl_header(c)}")


def zeroshot(doc: Doc, runs: list[Run]) -> None:
    """Per-task accuracy x 100 (suite tasks first) and the task mean with its SE."""
    zs = [r for r in runs if r.zeroshot]
    if not zs:
        return
    doc.h(2, "Zero-shot accuracy")
    tasks = list(dict.fromkeys([t for t in SUITE7 if any(t in r.zeroshot["tasks"] for r in zs)]
                               + [t for r in zs for t in r.zeroshot["tasks"]]))
    metric = {t: next(r.zeroshot["tasks"][t].get("metric", "score") for r in zs if t in r.zeroshot["tasks"])
              for t in tasks}
    headers = ["run", "method", "sparsity"] + [f"{t} ({metric[t]})" for t in tasks] + ["mean ± SE", "tasks"]
    rows = []
    for r in zs:
        tk = r.zeroshot["tasks"]
        s = r.zeroshot.get("summary") or {}
        mean = f"{fmt(s.get('mean'), 2)} ± {fmt(s.get('se'), 2)}" if num(s.get("mean")) is not None else "-"
        rows.append([r.name, r.method, sparsity_label(r)]
                    + [fmt(100 * tk[t]["score"], 2) if t in tk and num(tk[t].get("score")) is not None else "-"
                       for t in tasks] + [mean, str(len(s.get("tasks") or tk))])
    doc.p("Accuracy x 100 of each task's suite metric (lm-eval `multiple_choice`, 0-shot); the mean is the "
          "unweighted task mean with the task-stratified binomial SE `(100/T) sqrt(sum p(1-p)/n)`.")
    doc.table(headers, rows, left=3)


def accuracy(doc: Doc, runs: list[Run]) -> None:
    """Image classification: top-1 / top-5 of each run on each evaluated set (``secateur eval accuracy``)."""
    acc = [r for r in runs if r.accuracy]
    if not acc:
        return
    doc.h(2, "Image classification accuracy")
    rows = []
    for r in acc:
        for a in r.accuracy:
            where = f"{a['dataset']} {a['split']}" if a.get("split") else a["dataset"]
            rows.append([r.name, r.method, sparsity_label(r), where, fmt(a["top1"], 4),
                         fmt(a["top5"], 4) if a.get("top5") is not None else "-", str(a.get("n_images", "-"))])
    doc.p("Top-k accuracy of the model's class logits on the named set, through the model's own image processor "
          "(`secateur eval accuracy`); ties go to the lower class id.")
    doc.table(["run", "method", "sparsity", "images", "top-1", "top-5", "n"], rows, left=4)


def structured(doc: Doc, runs: list[Run]) -> None:
    """Parameters before/after and removed blocks of structured runs; kept widths per layer."""
    st = [r for r in runs if r.structured and not r.is_dense]
    if not st:
        return
    doc.h(2, "Structured runs")
    rows = [[r.name, r.method, sparsity_label(r), fmt_int(r.params_before), fmt_int(r.params_after),
             pct(r.realized_all if r.realized_all is not None else (
                 1 - r.params_after / r.params_before if r.params_before and r.params_after is not None
                 else None)),
             ", ".join(map(str, r.removed_blocks)) or "-"] for r in st]
    doc.table(*drop_empty(["run", "method", "sparsity", "params before", "params after", "params removed",
                           "removed blocks"], rows, 3), left=3)
    for r in st:
        if r.kept:
            _kept_widths(doc, r)


def _kept_widths(doc: Doc, r: Run) -> None:
    groups = list(dict.fromkeys(k["group"] for k in r.kept))
    layers = sorted({int(k["layer"]) for k in r.kept})
    cell = {(int(k["layer"]), k["group"]): (f"{k['kept']}/{k['width']}" if k.get("width") else str(k["kept"]))
            for k in r.kept}
    per = {str(i): v for i, v in r.per_module.items()}
    doc.h(3, f"Kept widths per layer: {r.name}")
    doc.p("kept / full width of each group's input columns" if all(k.get("width") for k in r.kept) else
          "kept unit counts from `secateur_selection.json` (layers not listed are unchanged)")
    doc.table(["layer"] + groups + (["realized"] if per else []),
              [[str(i)] + [cell.get((i, g), "-") for g in groups] + ([pct(per.get(str(i)))] if per else [])
               for i in layers], left=1)


def allocation(doc: Doc, runs: list[Run], plots) -> None:
    """A per-layer allocation plot per run that records one (needs plots)."""
    alloc = [(r, *per_layer_series(r)) for r in runs]
    alloc = [a for a in alloc if a[1]]
    if plots is None or not alloc:
        return
    doc.h(2, "Per-layer allocation")
    doc.p("Unstructured: realized sparsity per projection per layer (`realized_sparsity.per_module`); "
          "structured: realized fraction of the layer's removable parameters and removed width per group.")
    for i, (r, series, ylabel) in enumerate(alloc):
        name = f"allocation-{i:02d}-{_slug(r.name)}.png"
        doc.img(name, plots.plot_block_errors(series, None, title=f"per-layer allocation: {r.name} ({r.method})",
                                              ylabel=ylabel, log=False), f"per-layer allocation: {r.name}")


def qk_error(doc: Doc, runs: list[Run], plots) -> None:
    """QK-Wanda Eq. 49 errors and Q/K removal per run; per-block plots."""
    qk = [r for r in runs if r.qk_error or r.qk_removal]
    if not qk:
        return
    doc.h(2, "QK reconstruction error")
    doc.p("Relative QK error (QK-Wanda Eq. 49, %): block mean of sum ||B^ - B||^2 / sum ||B||^2 of pre-RoPE "
          "QK products on dense block inputs; stage errors (Eq. 51) pooled over blocks; Q/K removal from the "
          "masks.")
    rows = []
    for r in qk:
        e = r.qk_error or {}
        al = r.qk_removal or {}
        rem = (f"{fmt(100 * al['mean_rho_q'], 2)} / {fmt(100 * al['mean_rho_k'], 2)}"
               if num(al.get("mean_rho_q")) is not None else "-")
        rows.append([r.name, r.method, sparsity_label(r), fmt(e.get("e_qk"), 4), fmt(e.get("e_logits"), 4),
                     fmt(e.get("e_block"), 4), fmt(e.get("e_rollout"), 4), rem])
    doc.table(*drop_empty(["run", "method", "sparsity", "rel. QK error (%)", "logits error (%)",
                           "block error (%)", "rollout error (%)", "mean Q / K removed (%)"], rows, 3), left=3)
    if plots is None:
        return
    errs = {r.name: r.qk_error["per_block"] for r in qk if r.qk_error and r.qk_error.get("per_block")}
    if errs:
        doc.img("qk-error-per-block.png", plots.plot_block_errors(
            errs, None, title="relative QK error per block (Eq. 49)"), "relative QK error per block")
    rem = {r.name: r.qk_removal for r in qk if r.qk_removal}
    if rem:
        doc.img("qk-removal-per-block.png", plots.plot_qk_removal(rem, None, title="Q/K removal per block"),
                "Q/K removal per block")


# --------------------------------------------------------------------------------------- manifests


def manifests(doc: Doc, runs: list[Run]) -> None:
    """Protocols and manifests: calibration, evaluation protocols, versions and machine, inputs."""
    doc.h(2, "Protocols and manifests")
    _calibration(doc, runs)
    _eval_protocols(doc, runs)
    _versions(doc, runs)


def _calibration(doc: Doc, runs: list[Run]) -> None:
    doc.h(3, "Calibration")
    rows = []
    for r in runs:
        c = r.calibration or {}
        if not c:
            continue
        nxl = f"{c.get('n', '?')} x {c.get('seqlen', '?')}"
        if c.get("segment_len"):
            nxl += f" (segments of {c['segment_len']})"
        rows.append([r.name, str(c.get("source", "-")), nxl, str(c.get("seed", "-")), str(c.get("rule", "-")),
                     f"`{c['sha256']}`" if c.get("sha256") else "-"])
    if rows:
        doc.table(["run", "source", "n x seqlen", "seed", "rule", "token sha256"], rows, left=6)
    else:
        doc.p("No calibration manifest recorded (data-free methods).")


def _eval_protocols(doc: Doc, runs: list[Run]) -> None:
    ppl = [(r, e) for r in runs for e in r.ppl if e["ppl"] is not None]
    if ppl:
        doc.h(3, "Perplexity protocols")
        doc.table(["run", "dataset", "protocol", "file", "token sha256", "windows", "scored tokens"],
                  [[r.name, str(e["dataset"]), str(e["protocol"] or "not recorded"), e["file"] or "-",
                    f"`{e['tokens_sha256']}`" if e["tokens_sha256"] else "-",
                    f"{e['windows']}/{e['windows_total']}" if e["windows_total"] else str(e["windows"] or "-"),
                    fmt_int(e["scored_tokens"])] for r, e in ppl], left=5)
    zs = [r for r in runs if r.zeroshot]
    if zs:
        doc.h(3, "Zero-shot protocol")
        rows = []
        for r in zs:
            z = r.zeroshot
            st = z.get("settings") or {}
            rows.append([r.name, str(z.get("protocol", "-")), ", ".join(z["tasks"]),
                         "all" if st.get("limit") is None else f"first {st['limit']}",
                         str(st.get("strategy", "-")), str(len((z.get("data") or {}).get("sha256") or {}))])
        doc.table(["run", "protocol", "tasks", "documents", "strategy", "data files hashed"], rows, left=5)
    qk = [r for r in runs if r.qk_error and r.qk_error.get("heldout")]
    if qk:
        doc.h(3, "QK-error held-out set")
        doc.table(["run", "protocol", "source", "n x seqlen", "seed", "token sha256"],
                  [[r.name, str(r.qk_error.get("protocol")), str(h.get("source")), f"{h.get('n')} x {h.get('seqlen')}",
                    str(h.get("seed")), f"`{h['sha256']}`" if h.get("sha256") else "-"]
                   for r in qk for h in [r.qk_error["heldout"]]], left=6)


def _versions(doc: Doc, runs: list[Run]) -> None:
    doc.h(3, "Versions and machine")
    groups: dict[str, list[str]] = {}
    for r in runs:
        m = r.machine or {}
        mach = (f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('torch_threads', '?')} torch threads, "
                f"{m.get('cuda') or 'no GPU'}, {m.get('platform', '?')}") if m else "-"
        vers = ", ".join(f"{k} {v}" for k, v in (r.versions or {}).items()) or "-"
        groups.setdefault(json.dumps([vers, mach]), []).append(r.name)
    doc.table(["versions", "machine", "runs"], [[*json.loads(k), ", ".join(v)] for k, v in groups.items()], left=3)
    doc.h(3, "Inputs")
    doc.table(["run", "source", "preset", "files read", "ignored"],
              [[r.name, r.source, r.preset or "-", ", ".join(r.files) or "-", ", ".join(r.ignored) or "-"]
               for r in runs], left=5)
