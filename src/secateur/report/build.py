"""``secateur report``: a Markdown and an HTML report of pruning runs, built only from their JSON.

Inputs (``RUN_DIRS``), each one of

* a **run folder** written by ``secateur prune --out RUN``: ``RUN/secateur-report.json`` (required), plus
  any evaluation JSON written next to it with ``--json`` (the convention, docs/report.md)::

      secateur eval ppl      --model RUN --dataset wikitext2 --json RUN/ppl-wikitext2.json
      secateur eval zeroshot --model RUN --json RUN/zeroshot.json
      secateur eval qk-error --model RUN --json RUN/qk-error.json

  Every other ``*.json`` in the folder is classified by its ``protocol`` field, not by its name:
  ``nonoverlap-L`` / ``sliding-L-S`` (perplexity), ``zeroshot-lmeval-mc-0shot`` (zero-shot; several files
  merge task by task), ``qk-error-eq49`` (QK error). Hugging Face files (config, tokenizer, ...) are
  skipped; a structured run's ``secateur_selection.json`` supplies kept widths when the report's
  ``details`` have none; anything else is listed as ignored. A file that is not valid JSON is an error.
* a **JSONL results file** from ``bench/`` (``results/*.jsonl``): one run per row, with keys such as
  ``row``/``key``, ``method``, ``sparsity``/``rho``, ``preset``, ``wikitext2``/``c4``/``ptb`` or
  ``ppl: {dataset: {...}}``, ``realized_sparsity``/``realized``, ``prune_s``, ``peak_rss_mb``,
  ``calibration``. A later row with the same ``(preset, row)`` replaces an earlier one (as the bench
  renderers do); ``kind: "qk-error"`` rows attach their QK error to the row of the same name.

Output (``--out DIR``, written atomically with :func:`secateur.export.folder.atomic_dir`): ``report.md`` (plots as
``plots/*.png`` next to it), ``secateur-report-index.json`` (title and inputs; the marker that lets
``--overwrite`` replace the folder later) and ``report.html`` (one self-contained file: inline CSS, the same plots
embedded as base64 PNG). Numbers: perplexity 3 decimals, percentages 2 decimals, seconds 2 decimals, MiB
whole. Perplexity columns are keyed by (dataset, protocol id, windows used): numbers from different
protocols or window subsets never share a column. Plots need matplotlib (extra ``plots``); without it
the report says so and keeps every table.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from secateur.errors import SecateurError
from secateur.eval.qk_error import PROTOCOL as QK_PROTOCOL
from secateur.eval.zeroshot import PROTOCOL as ZEROSHOT_PROTOCOL
from secateur.eval.zeroshot import suite_summary
from secateur.eval.zeroshot_tasks import SUITE7
from secateur.export.folder import EXPORT_MARKER, REPORT_INDEX, REPORT_NAME, atomic_dir, check_output_dir

SELECTION_NAME = "secateur_selection.json"
# Hugging Face files in a run folder: never parsed (tokenizer.json can be megabytes)
HF_JSON = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "added_tokens.json", "vocab.json", "preprocessor_config.json",
           "model.safetensors.index.json", "chat_template.json"}
PPL_PROTOCOL = re.compile(r"^(nonoverlap-\d+|sliding-\d+-\d+)$")
DATASET_LABELS = {"wikitext2": "WikiText-2", "c4": "C4", "ptb": "PTB"}
QUALIFIERS = ("budget", "variant", "scope", "compensation", "allocation", "coec_stage", "tool")


# ------------------------------------------------------------------------------------------ runs


@dataclass
class Run:
    """One pruning run normalized from a run folder or a JSONL row (``None`` = not recorded)."""

    name: str
    source: str
    method: str = "?"
    sparsity: float | None = None
    pattern: str | None = None
    kind: str | None = None
    preset: str | None = None
    ppl: list[dict] = field(default_factory=list)
    zeroshot: dict | None = None
    qk_error: dict | None = None
    qk_removal: dict | None = None
    realized: float | None = None
    realized_all: float | None = None
    prune_s: float | None = None
    peak_rss_mb: float | None = None
    params_before: int | None = None
    params_after: int | None = None
    removed_blocks: list[int] = field(default_factory=list)
    per_module: dict[str, float] = field(default_factory=dict)
    kept: list[dict] = field(default_factory=list)  # {layer, group, kept, width} (width None = unknown)
    calibration: dict | None = None
    versions: dict | None = None
    machine: dict | None = None
    files: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    @property
    def is_dense(self) -> bool:
        return self.method == "dense"

    @property
    def structured(self) -> bool:
        return self.kind == "structured" or bool(self.kept) or self.params_before is not None


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SecateurError(f"{path}: invalid JSON (line {e.lineno}: {e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SecateurError(f"{path}: cannot read ({e})") from None


def _label(method: str, quals: dict, pattern: str | None) -> str:
    q = [f"{k}={v}" for k, v in quals.items()
         if isinstance(v, (str, int, float)) and not isinstance(v, bool) and v not in ("none", "")]
    return method + (f" {pattern}" if pattern else "") + (f" ({', '.join(q)})" if q else "")


def _ppl_entry(dataset: str, d: dict, file: str | None = None) -> dict:
    return {"dataset": dataset, "ppl": _num(d.get("ppl")), "protocol": d.get("protocol"),
            "windows": d.get("windows"), "windows_total": d.get("windows_total"),
            "scored_tokens": d.get("scored_tokens", d.get("scored")), "tokens_sha256": d.get("tokens_sha256"),
            "file": file}


def _merge_zeroshot(docs: list[dict]) -> dict:
    if len(docs) == 1:
        return docs[0]
    tasks: dict[str, dict] = {}
    for d in docs:  # a task in two files: the later file (sorted by name) wins
        tasks.update(d.get("tasks") or {})
    try:
        summary = suite_summary(tasks)
    except (KeyError, TypeError, ZeroDivisionError):  # a task without score / n: no mean rather than a crash
        summary = {}
    return {**docs[-1], "tasks": tasks, "summary": summary}


def load_run_folder(folder: Path) -> Run:
    """A ``secateur prune`` output folder and the evaluation JSON beside its report."""
    rep_path = folder / REPORT_NAME
    if not rep_path.is_file():
        raise SecateurError(f"{folder}: no {REPORT_NAME} (not a secateur prune output folder)")
    rep = _read_json(rep_path)
    if not isinstance(rep, dict) or "method" not in rep:
        raise SecateurError(f"{rep_path}: not a secateur prune report (no 'method')")
    opts = rep.get("options") or {}
    details = rep.get("details") or {}
    rs = rep.get("realized_sparsity")
    rs = rs if isinstance(rs, dict) else {"targeted": rs}
    run = Run(name=folder.name, source=str(folder), pattern=rep.get("pattern"),
              method=_label(rep["method"], {k: opts.get(k) for k in QUALIFIERS}, None),
              sparsity=_num(rep.get("target_sparsity")), kind=rep.get("kind"), realized=_num(rs.get("targeted")),
              realized_all=_num(rs.get("of_all_parameters")), per_module=dict(rs.get("per_module") or {}),
              prune_s=_num(((rep.get("timings") or {}).get("phases") or {}).get("prune")),
              peak_rss_mb=_num(rep.get("peak_rss_mb")), calibration=rep.get("calibration"),
              versions=rep.get("versions"), machine=rep.get("machine"), files=[REPORT_NAME])
    if details.get("params_before") is not None:
        run.params_before, run.params_after = details.get("params_before"), details.get("params_after")
    run.removed_blocks = list(details.get("removed_blocks") or [])
    run.kept = [{k: r.get(k) for k in ("layer", "group", "kept", "width")} for r in details.get("per_layer") or []
                if isinstance(r, dict) and r.get("kept") is not None]
    alloc = details.get("allocation")
    if isinstance(alloc, dict) and alloc.get("per_block"):
        run.qk_removal = alloc
    zs_docs = []
    for p in sorted(folder.glob("*.json")):
        if p.name in (REPORT_NAME, EXPORT_MARKER) or p.name in HF_JSON:
            continue
        doc = _read_json(p)
        proto = doc.get("protocol") if isinstance(doc, dict) else None
        if p.name == SELECTION_NAME and isinstance(doc, dict):
            if not run.kept:
                run.kept = _kept_from_selection(doc)
                run.removed_blocks = run.removed_blocks or list(doc.get("removed_blocks") or [])
            run.files.append(p.name)
        elif isinstance(proto, str) and PPL_PROTOCOL.match(proto) and "ppl" in doc:
            run.ppl.append(_ppl_entry(str(doc.get("dataset", p.stem)), doc, p.name))
            run.files.append(p.name)
        elif proto == ZEROSHOT_PROTOCOL and isinstance(doc.get("tasks"), dict):
            zs_docs.append(doc)
            run.files.append(p.name)
        elif proto == QK_PROTOCOL and "e_qk" in doc:
            run.qk_error = doc | {"file": p.name}
            if isinstance(doc.get("removal"), dict) and doc["removal"].get("per_block") and run.qk_removal is None:
                run.qk_removal = doc["removal"]
            run.files.append(p.name)
        else:
            run.ignored.append(p.name)
    if zs_docs:
        run.zeroshot = _merge_zeroshot(zs_docs)
    return run


def _kept_from_selection(sel: dict) -> list[dict]:
    """Kept unit counts per layer from ``secateur_selection.json`` (layers not listed are unchanged)."""
    out = []
    for i, keep in sorted((sel.get("layers") or {}).items(), key=lambda kv: int(kv[0])):
        for group, key in (("heads", "heads"), ("kv_heads", "kv_heads"), ("channels", "channels")):
            if keep.get(key) is not None:
                out.append({"layer": int(i), "group": group, "kept": len(keep[key]), "width": None})
    return out


_SUFFIX = re.compile(r"-(\d+:\d+|\d+(?:\.\d+)?)$")


def _row_run(row: dict, source: str) -> Run:
    """Normalize one bench row (unstructured/structured/qk-wanda/cocurve/llm-compressor layouts)."""
    name = row.get("row") or row.get("key")
    mod = row.get("modifier_args") if isinstance(row.get("modifier_args"), dict) else {}
    sparsity = next((_num(row[k]) for k in ("sparsity", "rho", "target_sparsity") if _num(row.get(k)) is not None),
                    _num(mod.get("sparsity")))
    pattern = row.get("pattern") or (mod.get("mask_structure") if mod.get("mask_structure") not in (None, "0:0")
                                     else None)
    method = row.get("method")
    m = _SUFFIX.search(str(name or ""))
    if method is None:
        method = "dense" if name == "dense" else (str(name)[: m.start()] if m else str(name or "?"))
    if m and sparsity is None and pattern is None:
        if ":" in m.group(1):
            pattern = m.group(1)
        else:
            sparsity = float(m.group(1)) / 100
    if pattern and sparsity is None:
        n, mm = (int(x) for x in pattern.split(":"))
        sparsity = 1 - n / mm
    if method == "dense":
        sparsity = 0.0
    if name is None:
        name = f"{method}-{sparsity:g}" if sparsity is not None else method
    quals = {k: row.get(k) for k in QUALIFIERS}
    rs = row.get("realized_sparsity", row.get("realized"))
    rs = rs if isinstance(rs, dict) else {"targeted": rs}
    run = Run(name=str(name), source=source, method=_label(str(method), quals, pattern), sparsity=sparsity,
              pattern=pattern, preset=row.get("preset"), realized=_num(rs.get("targeted")),
              realized_all=_num(rs.get("of_all_parameters", row.get("params_removed_fraction"))),
              prune_s=_num(row.get("prune_s", row.get("selection_s"))), calibration=row.get("calibration"),
              peak_rss_mb=_num(row.get("peak_rss_mb_after_prune", row.get("peak_rss_mb"))),
              versions=row.get("versions"), machine=row.get("machine"))
    if isinstance(row.get("per_layer"), list):
        run.kept = [{k: r.get(k) for k in ("layer", "group", "kept", "width")} for r in row["per_layer"]
                    if isinstance(r, dict) and r.get("kept") is not None]
    if method != "dense" and (run.kept or row.get("by_kind") is not None or _num(row.get("params")) is not None):
        run.kind = "structured"  # bench rows count parameters only for structured (sliced) models
        run.params_after = row.get("params")
        run.removed_blocks = list(row.get("removed_blocks") or [])
    for k, v in row.items():  # top-level {dataset: {ppl, protocol, ...}}
        if isinstance(v, dict) and _num(v.get("ppl")) is not None:
            run.ppl.append(_ppl_entry(k, v))
    if isinstance(row.get("ppl"), dict):
        run.ppl += [_ppl_entry(k, v) for k, v in row["ppl"].items() if isinstance(v, dict)]
    alloc = row.get("allocation")
    if isinstance(alloc, dict) and alloc.get("per_block"):
        run.qk_removal = alloc
    if isinstance(row.get("zeroshot"), dict) and isinstance(row["zeroshot"].get("tasks"), dict):
        run.zeroshot = row["zeroshot"]
    return run


def load_jsonl(path: Path, preset: str | None = None) -> list[Run]:
    """Runs of a bench results file (the latest row per ``(preset, row)`` wins)."""
    rows: dict[tuple, dict] = {}
    qk: dict[tuple, dict] = {}
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SecateurError(f"{path}: cannot read ({e})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SecateurError(f"{path}:{n}: invalid JSON ({e.msg})") from None
        if not isinstance(row, dict) or (preset is not None and row.get("preset") != preset):
            continue
        ident = row.get("row") or row.get("key") or (row.get("method"), row.get("rho", row.get("sparsity")))
        key = (row.get("preset"), str(ident))
        if row.get("kind") == "qk-error":
            qk[key] = row
        elif row.get("kind", "row") == "row" and any(k in row for k in ("row", "key", "method")):
            rows.pop(key, None)  # re-insert: file order of the latest version
            rows[key] = row
    if not rows:
        extra = f" for preset {preset!r}" if preset is not None else ""
        raise SecateurError(f"{path}: no result rows{extra} (expected JSON objects with row/key/method)")
    dense_params = {k[0]: r["params"] for k, r in rows.items()
                    if (r.get("method") == "dense" or r.get("row") == "dense") and _num(r.get("params")) is not None}
    runs = []
    for key, row in rows.items():
        run = _row_run(row, f"{path.name}#{key[1]}")
        if run.params_after is not None and run.params_before is None:
            run.params_before = dense_params.get(key[0])  # the dense row of the same preset
        q = qk.get(key)
        if q is not None and _num(q.get("e_qk")) is not None:
            run.qk_error = {k: q.get(k) for k in ("e_qk", "per_block", "e_logits", "e_block", "e_rollout")}
            run.qk_error["protocol"] = q.get("protocol", QK_PROTOCOL)
        runs.append(run)
    return runs


def load_inputs(paths: Iterable[str], preset: str | None = None) -> list[Run]:
    runs: list[Run] = []
    for s in paths:
        p = Path(s)
        if p.is_dir():
            runs.append(load_run_folder(p))
        elif p.is_file() and p.name == REPORT_NAME:
            runs.append(load_run_folder(p.parent))
        elif p.is_file() and p.suffix == ".jsonl":
            runs += load_jsonl(p, preset)
        elif not p.exists():
            raise SecateurError(f"{p} does not exist")
        else:
            raise SecateurError(f"{p}: not a secateur prune output folder or a .jsonl results file")
    if not runs:
        raise SecateurError("no runs given")
    seen: dict[str, int] = {}
    for r in runs:
        seen[r.name] = seen.get(r.name, 0) + 1
    for r in runs:  # the same name from two inputs: name them by their source
        if seen[r.name] > 1:
            r.name = r.source if "#" in r.source else f"{Path(r.source).parent.name}/{r.name}"
    return runs


# ------------------------------------------------------------------------------------ formatting


def _f(x: Any, nd: int) -> str:
    x = _num(x)
    return "-" if x is None else f"{x:.{nd}f}"


def _pct(x: Any) -> str:
    x = _num(x)
    return "-" if x is None else f"{100 * x:.2f}%"


def _int(x: Any) -> str:
    return "-" if _num(x) is None else f"{int(x):,}"


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


def _drop_empty(headers: list[str], rows: list[list[str]], keep: int) -> tuple[list[str], list[list[str]]]:
    """Drop columns (after the first ``keep``) that are ``-`` in every row."""
    cols = [i for i in range(len(headers)) if i < keep or any(r[i] != "-" for r in rows)]
    return [headers[i] for i in cols], [[r[i] for i in cols] for r in rows]


# ------------------------------------------------------------------------------------- document


@dataclass
class Doc:
    """Blocks rendered twice: Markdown (plots as files) and HTML (plots embedded)."""

    blocks: list[tuple] = field(default_factory=list)
    plots: dict[str, bytes] = field(default_factory=dict)

    def h(self, level: int, text: str) -> None:
        self.blocks.append(("h", level, text))

    def p(self, text: str) -> None:
        self.blocks.append(("p", text))

    def ul(self, items: list[str]) -> None:
        if items:
            self.blocks.append(("ul", items))

    def table(self, headers: list[str], rows: list[list[str]], left: int = 2) -> None:
        """``left``: the first columns are text (left-aligned); the rest numbers (right-aligned)."""
        if rows:
            self.blocks.append(("table", headers, rows, left))

    def img(self, name: str, png: bytes, alt: str) -> None:
        self.plots[name] = png
        self.blocks.append(("img", f"plots/{name}", alt))

    def markdown(self) -> str:
        out: list[str] = []
        for b in self.blocks:
            if b[0] == "h":
                out += ["#" * b[1] + " " + b[2], ""]
            elif b[0] == "p":
                out += [b[1], ""]
            elif b[0] == "ul":
                out += [f"* {x}" for x in b[1]] + [""]
            elif b[0] == "table":
                _, headers, rows, left = b
                cell = lambda s: str(s).replace("|", "\\|")  # noqa: E731
                out.append("| " + " | ".join(cell(h) for h in headers) + " |")
                out.append("|" + "|".join("---" if i < left else "---:" for i in range(len(headers))) + "|")
                out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
                out.append("")
            elif b[0] == "img":
                alt = b[2].replace("[", "(").replace("]", ")")  # brackets would end the alt text
                out += [f"![{alt}]({b[1]})", ""]
        return "\n".join(out)

    def html(self, title: str) -> str:
        def inline(s: str) -> str:  # escape, then `code` spans
            return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(str(s)))

        body: list[str] = []
        for b in self.blocks:
            if b[0] == "h":
                body.append(f"<h{b[1]}>{inline(b[2])}</h{b[1]}>")
            elif b[0] == "p":
                body.append(f"<p>{inline(b[1])}</p>")
            elif b[0] == "ul":
                body.append("<ul>" + "".join(f"<li>{inline(x)}</li>" for x in b[1]) + "</ul>")
            elif b[0] == "table":
                _, headers, rows, left = b
                cls = ["" if i < left else ' class="num"' for i in range(len(headers))]
                head = "".join(f"<th{cls[i]}>{inline(h)}</th>" for i, h in enumerate(headers))
                trs = "".join("<tr>" + "".join(f"<td{cls[i]}>{inline(c)}</td>" for i, c in enumerate(r)) + "</tr>"
                              for r in rows)
                body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{trs}</tbody></table>")
            elif b[0] == "img":
                data = base64.b64encode(self.plots[b[1].removeprefix("plots/")]).decode()
                body.append(f'<figure><img alt="{html.escape(b[2])}" src="data:image/png;base64,{data}">'
                            f"<figcaption>{inline(b[2])}</figcaption></figure>")
        return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}"
                f"</title>\n<style>{CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")


CSS = ("body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}"
       "table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:.9em}"
       "th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left}th{background:#f3f3f3}"
       ".num{text-align:right;font-variant-numeric:tabular-nums}code{font-size:.9em;background:#f6f6f6}"
       "figure{margin:1em 0}img{max-width:100%}figcaption{font-size:.85em;color:#555}"
       "h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}")


# ----------------------------------------------------------------------------------------- plots


def _png(fig) -> bytes:
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buf = io.BytesIO()
    FigureCanvasAgg(fig)
    fig.savefig(buf, format="png", dpi=130)
    return buf.getvalue()


def plot_ppl_vs_sparsity(series: dict[str, list[tuple[float, float]]], dense: float | None = None,
                         title: str = "") -> bytes:
    """Perplexity (log scale when it spans > 5x) against target sparsity (%), one line per method;
    ``dense`` draws the unpruned model as a dotted line. Returns PNG bytes (matplotlib, Agg canvas)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 3.8))
    ax = fig.add_subplot(1, 1, 1)
    ys = [y for pts in series.values() for _, y in pts] + ([dense] if dense else [])
    for label, pts in series.items():
        pts = sorted(pts)
        ax.plot([100 * x for x, _ in pts], [y for _, y in pts], marker="o", ms=4, lw=1.4, label=label)
    if dense:
        ax.axhline(dense, color="0.4", ls=":", lw=1.0, label=f"dense {dense:.3f}")
    if ys and min(ys) > 0 and max(ys) / min(ys) > 5:
        ax.set_yscale("log")
    ax.set_xlabel("target sparsity (%)")
    ax.set_ylabel("perplexity")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return _png(fig)


_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|layer)\.(\d+)\.(?:.*\.)?([^.]+)$")


def per_layer_series(run: Run) -> tuple[dict[str, list[float]], str]:
    """Per-layer allocation of a run: ``({label: value per layer}, y label)``; missing layers are NaN.

    Unstructured: realized sparsity per projection role from ``realized_sparsity.per_module`` (module names
    ``...layers.<i>.<...>.<role>``). Structured: the report's per-layer realized fraction, and kept width /
    full width per group where widths are known (kept counts otherwise)."""
    by: dict[str, dict[int, float]] = {}
    for name, v in run.per_module.items():
        if _num(v) is None:
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
    rows = [[r.name, r.method, sparsity_label(r)] + [_f(_ppl_of(r, c), 3) for c in cols]
            + [_pct(r.realized), _pct(r.realized_all), _f(r.prune_s, 2), _f(r.peak_rss_mb, 0)] for r in runs]
    return _drop_empty(headers, rows, 3)


def _pivot(runs: list[Run], col: tuple) -> tuple[list[str], list[list[str]]] | None:
    """Method x sparsity for one perplexity column (``a / b`` where several runs share a cell)."""
    have = [r for r in runs if _ppl_of(r, col) is not None]
    levels: list[tuple] = []
    for r in sorted(have, key=_order_key):
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
            cells.append(" / ".join(_f(v, 3) for v in vals) or "-")
        rows.append([m] + cells)
    return ["method"] + [lv[2] for lv in levels], rows


def _order_key(r: Run) -> tuple:
    return (not r.is_dense, r.sparsity if r.sparsity is not None else 2.0, r.pattern is not None)


def build(runs: list[Run], title: str, with_plots: bool = True) -> Doc:
    plots = None
    note = None
    if with_plots:
        try:
            from secateur.report import plots  # colleague's QK plots; needs matplotlib
        except ImportError:
            note = "Plots skipped: matplotlib is not installed (`pip install 'secateur[plots]'`)."
    runs = sorted(runs, key=_order_key)  # stable: input order within a sparsity level
    doc = Doc()
    from secateur import __version__

    doc.h(1, title)
    doc.p(f"{len(runs)} run(s), generated by `secateur report` (secateur {__version__}) from the runs' JSON only; "
          "inputs and the files read are listed under Protocols and manifests.")
    if note:
        doc.p(note)

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
                doc.img(name, plot_ppl_vs_sparsity(series, dense, _ppl_header(c)),
                        f"perplexity against sparsity: {_ppl_header(c)}")

    zs = [r for r in runs if r.zeroshot]
    if zs:
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
            mean = f"{_f(s.get('mean'), 2)} ± {_f(s.get('se'), 2)}" if _num(s.get("mean")) is not None else "-"
            rows.append([r.name, r.method, sparsity_label(r)]
                        + [_f(100 * tk[t]["score"], 2) if t in tk and _num(tk[t].get("score")) is not None else "-"
                           for t in tasks] + [mean, str(len(s.get("tasks") or tk))])
        doc.p("Accuracy x 100 of each task's suite metric (lm-eval `multiple_choice`, 0-shot); the mean is the "
              "unweighted task mean with the task-stratified binomial SE `(100/T) sqrt(sum p(1-p)/n)`.")
        doc.table(headers, rows, left=3)

    st = [r for r in runs if r.structured and not r.is_dense]
    if st:
        doc.h(2, "Structured runs")
        rows = [[r.name, r.method, sparsity_label(r), _int(r.params_before), _int(r.params_after),
                 _pct(r.realized_all if r.realized_all is not None else (
                     1 - r.params_after / r.params_before if r.params_before and r.params_after is not None
                     else None)),
                 ", ".join(map(str, r.removed_blocks)) or "-"] for r in st]
        doc.table(*_drop_empty(["run", "method", "sparsity", "params before", "params after", "params removed",
                                "removed blocks"], rows, 3), left=3)
        for r in st:
            if not r.kept:
                continue
            groups = list(dict.fromkeys(k["group"] for k in r.kept))
            layers = sorted({int(k["layer"]) for k in r.kept})
            cell = {(int(k["layer"]), k["group"]): (f"{k['kept']}/{k['width']}" if k.get("width") else str(k["kept"]))
                    for k in r.kept}
            per = {str(i): v for i, v in r.per_module.items()}
            doc.h(3, f"Kept widths per layer: {r.name}")
            doc.p("kept / full width of each group's input columns" if all(k.get("width") for k in r.kept) else
                  "kept unit counts from `secateur_selection.json` (layers not listed are unchanged)")
            doc.table(["layer"] + groups + (["realized"] if per else []),
                      [[str(i)] + [cell.get((i, g), "-") for g in groups] + ([_pct(per.get(str(i)))] if per else [])
                       for i in layers], left=1)

    alloc = [(r, *per_layer_series(r)) for r in runs]
    alloc = [a for a in alloc if a[1]]
    if plots is not None and alloc:
        doc.h(2, "Per-layer allocation")
        doc.p("Unstructured: realized sparsity per projection per layer (`realized_sparsity.per_module`); "
              "structured: realized fraction of the layer's removable parameters and removed width per group.")
        for i, (r, series, ylabel) in enumerate(alloc):
            name = f"allocation-{i:02d}-{_slug(r.name)}.png"
            doc.img(name, plots.plot_block_errors(series, None, title=f"per-layer allocation: {r.name} ({r.method})",
                                                  ylabel=ylabel, log=False), f"per-layer allocation: {r.name}")

    qk = [r for r in runs if r.qk_error or r.qk_removal]
    if qk:
        doc.h(2, "QK reconstruction error")
        doc.p("Relative QK error (QK-Wanda Eq. 49, %): block mean of sum ||B^ - B||^2 / sum ||B||^2 of pre-RoPE "
              "QK products on dense block inputs; stage errors (Eq. 51) pooled over blocks; Q/K removal from the "
              "masks.")
        rows = []
        for r in qk:
            e = r.qk_error or {}
            al = r.qk_removal or {}
            rem = (f"{_f(100 * al['mean_rho_q'], 2)} / {_f(100 * al['mean_rho_k'], 2)}"
                   if _num(al.get("mean_rho_q")) is not None else "-")
            rows.append([r.name, r.method, sparsity_label(r), _f(e.get("e_qk"), 4), _f(e.get("e_logits"), 4),
                         _f(e.get("e_block"), 4), _f(e.get("e_rollout"), 4), rem])
        doc.table(*_drop_empty(["run", "method", "sparsity", "rel. QK error (%)", "logits error (%)",
                                "block error (%)", "rollout error (%)", "mean Q / K removed (%)"], rows, 3), left=3)
        if plots is not None:
            errs = {r.name: r.qk_error["per_block"] for r in qk if r.qk_error and r.qk_error.get("per_block")}
            if errs:
                doc.img("qk-error-per-block.png", plots.plot_block_errors(
                    errs, None, title="relative QK error per block (Eq. 49)"), "relative QK error per block")
            rem = {r.name: r.qk_removal for r in qk if r.qk_removal}
            if rem:
                doc.img("qk-removal-per-block.png", plots.plot_qk_removal(rem, None, title="Q/K removal per block"),
                        "Q/K removal per block")

    _manifests(doc, runs)
    return doc


def _manifests(doc: Doc, runs: list[Run]) -> None:
    doc.h(2, "Protocols and manifests")
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
    ppl = [(r, e) for r in runs for e in r.ppl if e["ppl"] is not None]
    if ppl:
        doc.h(3, "Perplexity protocols")
        doc.table(["run", "dataset", "protocol", "file", "token sha256", "windows", "scored tokens"],
                  [[r.name, str(e["dataset"]), str(e["protocol"] or "not recorded"), e["file"] or "-",
                    f"`{e['tokens_sha256']}`" if e["tokens_sha256"] else "-",
                    f"{e['windows']}/{e['windows_total']}" if e["windows_total"] else str(e["windows"] or "-"),
                    _int(e["scored_tokens"])] for r, e in ppl], left=5)
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


def write_report(run_paths: list[str], out: str | Path, title: str = "secateur report", overwrite: bool = False,
                 preset: str | None = None) -> Path:
    """Read every input (all errors before anything is written), then write ``out/`` atomically."""
    runs = load_inputs(run_paths, preset)
    out_r = Path(out).resolve()
    for s in run_paths:
        p = Path(s).resolve()
        if out_r == p or out_r in p.parents:
            raise SecateurError(f"--out {out} would replace the input {s}")
    check_output_dir(out, overwrite, kind="report")
    doc = build(runs, title)
    md, page = doc.markdown(), doc.html(title)
    with atomic_dir(out, overwrite, kind="report") as tmp:
        (tmp / REPORT_INDEX).write_text(json.dumps({"title": title, "inputs": list(run_paths)}, indent=1))
        (tmp / "report.md").write_text(md)
        (tmp / "report.html").write_text(page)
        if doc.plots:
            (tmp / "plots").mkdir()
            for name, png in doc.plots.items():
                (tmp / "plots" / name).write_bytes(png)
    return Path(out)


# ------------------------------------------------------------------------------------------- CLI


def register_cli(subparsers) -> argparse.ArgumentParser:
    """Add ``secateur report``."""
    p = subparsers.add_parser(
        "report", help="Markdown + HTML report of pruning runs (tables and plots from their JSON)",
        description="Tables in the papers' layouts (perplexity by method and sparsity, zero-shot, structured "
                    "widths, QK error), plots and the protocol manifests, from secateur prune output folders "
                    "(secateur-report.json plus eval JSON written beside it with --json RUN/<name>.json) and "
                    "bench results files (*.jsonl). See docs/report.md.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="secateur prune output folder or bench .jsonl file")
    p.add_argument("--out", default="report", help="output folder, written atomically (default: %(default)s)")
    p.add_argument("--title", default="secateur report", help="report title (default: %(default)s)")
    p.add_argument("--preset", default=None, help="keep only JSONL rows of this bench preset")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cli_report)
    return p


def cli_report(args) -> int:
    out = write_report(args.runs, args.out, args.title, args.overwrite, args.preset)
    n_plots = len(list((out / "plots").glob("*.png"))) if (out / "plots").is_dir() else 0
    print(f"wrote {out / 'report.md'} and {out / 'report.html'} ({n_plots} plots)")
    return 0
