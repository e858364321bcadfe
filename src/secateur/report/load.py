"""Reading the inputs of ``secateur report``: run folders (``secateur-report.json`` and the evaluation JSON
beside it, classified by their ``protocol`` field) and bench JSONL results files, each normalized to a
:class:`Run`. Everything is read (and every error raised) before anything is written.

Reports written before ``schema_version`` existed (older runs) have none and read as version 0; a report
of a newer schema than this code knows is refused rather than misread.
"""

from __future__ import annotations

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
from secateur.export.folder import EXPORT_MARKER, REPORT_NAME
from secateur.runinfo import SCHEMA_VERSION

SELECTION_NAME = "secateur_selection.json"
# Hugging Face files in a run folder: never parsed (tokenizer.json can be megabytes)
HF_JSON = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "added_tokens.json", "vocab.json", "preprocessor_config.json",
           "model.safetensors.index.json", "chat_template.json"}
PPL_PROTOCOL = re.compile(r"^(nonoverlap-\d+|sliding-\d+-\d+)$")
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


def num(x: Any) -> float | None:
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
    return {"dataset": dataset, "ppl": num(d.get("ppl")), "protocol": d.get("protocol"),
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
    check_schema(rep, rep_path)
    run = _report_run(folder, rep)
    zs_docs = []
    for p in sorted(folder.glob("*.json")):
        if p.name in (REPORT_NAME, EXPORT_MARKER) or p.name in HF_JSON:
            continue
        doc = _read_json(p)
        if isinstance(doc, dict) and doc.get("protocol") == ZEROSHOT_PROTOCOL and isinstance(doc.get("tasks"), dict):
            zs_docs.append(doc)
        elif not _attach(run, p.name, doc):
            run.ignored.append(p.name)
            continue
        check_schema(doc, p)
        run.files.append(p.name)
    if zs_docs:
        run.zeroshot = _merge_zeroshot(zs_docs)
    return run


def check_schema(doc: dict, path: Path | str) -> int:
    """The ``schema_version`` of a report or evaluation JSON: 0 when absent (written before versions existed);
    a version newer than :data:`~secateur.runinfo.SCHEMA_VERSION` is refused."""
    v = doc.get("schema_version", 0)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise SecateurError(f"{path}: schema_version {v!r} is not a non-negative integer")
    if v > SCHEMA_VERSION:
        raise SecateurError(f"{path}: schema_version {v} is newer than this secateur reads ({SCHEMA_VERSION}); "
                            "upgrade secateur")
    return v


def _report_run(folder: Path, rep: dict) -> Run:
    """The run described by a ``secateur-report.json``."""
    opts = rep.get("options") or {}
    details = rep.get("details") or {}
    rs = rep.get("realized_sparsity")
    rs = rs if isinstance(rs, dict) else {"targeted": rs}
    run = Run(name=folder.name, source=str(folder), pattern=rep.get("pattern"),
              method=_label(rep["method"], {k: opts.get(k) for k in QUALIFIERS}, None),
              sparsity=num(rep.get("target_sparsity")), kind=rep.get("kind"), realized=num(rs.get("targeted")),
              realized_all=num(rs.get("of_all_parameters")), per_module=dict(rs.get("per_module") or {}),
              prune_s=num(((rep.get("timings") or {}).get("phases") or {}).get("prune")),
              peak_rss_mb=num(rep.get("peak_rss_mb")), calibration=rep.get("calibration"),
              versions=rep.get("versions"), machine=rep.get("machine"), files=[REPORT_NAME])
    if details.get("params_before") is not None:
        run.params_before, run.params_after = details.get("params_before"), details.get("params_after")
    run.removed_blocks = list(details.get("removed_blocks") or [])
    run.kept = [{k: r.get(k) for k in ("layer", "group", "kept", "width")} for r in details.get("per_layer") or []
                if isinstance(r, dict) and r.get("kept") is not None]
    alloc = details.get("allocation")
    if isinstance(alloc, dict) and alloc.get("per_block"):
        run.qk_removal = alloc
    return run


def _attach(run: Run, name: str, doc: Any) -> bool:
    """Attach a selection, perplexity or QK-error JSON of the run folder to ``run``; False for anything else
    (zero-shot files are merged by the caller)."""
    proto = doc.get("protocol") if isinstance(doc, dict) else None
    if name == SELECTION_NAME and isinstance(doc, dict):
        if not run.kept:
            run.kept = _kept_from_selection(doc)
            run.removed_blocks = run.removed_blocks or list(doc.get("removed_blocks") or [])
    elif isinstance(proto, str) and PPL_PROTOCOL.match(proto) and "ppl" in doc:
        run.ppl.append(_ppl_entry(str(doc.get("dataset", Path(name).stem)), doc, name))
    elif proto == QK_PROTOCOL and "e_qk" in doc:
        run.qk_error = doc | {"file": name}
        if isinstance(doc.get("removal"), dict) and doc["removal"].get("per_block") and run.qk_removal is None:
            run.qk_removal = doc["removal"]
    else:
        return False
    return True


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
    sparsity = next((num(row[k]) for k in ("sparsity", "rho", "target_sparsity") if num(row.get(k)) is not None),
                    num(mod.get("sparsity")))
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
              pattern=pattern, preset=row.get("preset"), realized=num(rs.get("targeted")),
              realized_all=num(rs.get("of_all_parameters", row.get("params_removed_fraction"))),
              prune_s=num(row.get("prune_s", row.get("selection_s"))), calibration=row.get("calibration"),
              peak_rss_mb=num(row.get("peak_rss_mb_after_prune", row.get("peak_rss_mb"))),
              versions=row.get("versions"), machine=row.get("machine"))
    if isinstance(row.get("per_layer"), list):
        run.kept = [{k: r.get(k) for k in ("layer", "group", "kept", "width")} for r in row["per_layer"]
                    if isinstance(r, dict) and r.get("kept") is not None]
    if method != "dense" and (run.kept or row.get("by_kind") is not None or num(row.get("params")) is not None):
        run.kind = "structured"  # bench rows count parameters only for structured (sliced) models
        run.params_after = row.get("params")
        run.removed_blocks = list(row.get("removed_blocks") or [])
    for k, v in row.items():  # top-level {dataset: {ppl, protocol, ...}}
        if isinstance(v, dict) and num(v.get("ppl")) is not None:
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
                    if (r.get("method") == "dense" or r.get("row") == "dense") and num(r.get("params")) is not None}
    runs = []
    for key, row in rows.items():
        run = _row_run(row, f"{path.name}#{key[1]}")
        if run.params_after is not None and run.params_before is None:
            run.params_before = dense_params.get(key[0])  # the dense row of the same preset
        q = qk.get(key)
        if q is not None and num(q.get("e_qk")) is not None:
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
