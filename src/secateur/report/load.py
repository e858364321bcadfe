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
from secateur.eval.accuracy import PROTOCOL as ACCURACY_PROTOCOL
from secateur.eval.qk_error import PROTOCOL as QK_PROTOCOL
from secateur.eval.zeroshot import PROTOCOL as ZEROSHOT_PROTOCOL
from secateur.eval.zeroshot import suite_summary
from secateur.runinfo import SCHEMA_VERSION
from secateur.safe_write import EXPORT_MARKER, REPORT_NAME
from secateur.schemas.report import (
    ROW_FIX,
    RUN_FIX,
    Allocation,
    BenchPreset,
    BenchRow,
    KeptRow,
    ModifierArgs,
    PplEntry,
    QKError,
    Realized,
    RunReport,
    Selection,
    ZeroshotResult,
    parse_at,
)

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
    accuracy: list[dict] = field(default_factory=list)  # image classification: {dataset, split, top1, top5, n}
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
    from secateur.files import read_json

    return read_json(path, RUN_FIX)


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
    except (KeyError, TypeError, ValueError, ZeroDivisionError):  # a task without score / n: no mean, no crash
        summary = {}
    return {**docs[-1], "tasks": tasks, "summary": summary}


def load_run_folder(folder: Path) -> Run:
    """A ``secateur prune`` output folder and the evaluation JSON beside its report."""
    rep_path = folder / REPORT_NAME
    if not rep_path.is_file():
        raise SecateurError(f"{folder}: no {REPORT_NAME} (not a secateur prune output folder); pass a folder that "
                            "secateur prune --out wrote")
    rep = _read_json(rep_path)
    if not isinstance(rep, dict) or "method" not in rep:
        raise SecateurError(f"{rep_path}: not a secateur prune report (no 'method'); {RUN_FIX}")
    check_schema(rep, rep_path)
    parse_at(RunReport, rep, str(rep_path), RUN_FIX)
    run = _report_run(folder, rep, str(rep_path))
    zs_docs = []
    for p in sorted(folder.glob("*.json")):
        if p.name in (REPORT_NAME, EXPORT_MARKER) or p.name in HF_JSON or not p.is_file():
            continue
        doc = _read_json(p)
        if isinstance(doc, dict) and doc.get("protocol") == ZEROSHOT_PROTOCOL and isinstance(doc.get("tasks"), dict):
            parse_at(ZeroshotResult, doc, str(p), RUN_FIX)
            zs_docs.append(doc)
        elif not _attach(run, p, doc):
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
        raise SecateurError(f"{path}: schema_version {v!r:.40} is not a non-negative integer; {RUN_FIX}")
    if v > SCHEMA_VERSION:
        raise SecateurError(f"{path}: schema_version {v} is newer than this secateur reads ({SCHEMA_VERSION}); "
                            "upgrade secateur")
    return v


def _realized(rs: Any, source: str, fix: str) -> dict:
    """``realized_sparsity``: a mapping (checked), or the targeted fraction alone (older reports and rows)."""
    if isinstance(rs, dict):
        parse_at(Realized, rs, source, fix, "realized_sparsity")
        return rs
    if rs is not None and (isinstance(rs, bool) or not isinstance(rs, (int, float))):
        raise SecateurError(f"{source}: realized_sparsity: {rs!r:.40} is neither a number nor a mapping; {fix}")
    return {"targeted": rs}


def _kept_rows(rows: Any, source: str, fix: str, at: str) -> list[dict]:
    """The kept-width rows (those with ``kept``) of a ``per_layer`` list, each checked."""
    out = []
    for j, r in enumerate(rows or []):
        if isinstance(r, dict) and r.get("kept") is not None:
            parse_at(KeptRow, r, source, fix, f"{at}.{j}")
            out.append({k: r.get(k) for k in ("layer", "group", "kept", "width")})
    return out


def _allocation(alloc: Any, source: str, fix: str, at: str) -> dict | None:
    """A Q/K removal allocation when ``alloc`` is one (a mapping with ``per_block``), checked; else None."""
    if isinstance(alloc, dict) and alloc.get("per_block"):
        parse_at(Allocation, alloc, source, fix, at)
        return alloc
    return None


def _report_run(folder: Path, rep: dict, source: str = REPORT_NAME) -> Run:
    """The run described by a ``secateur-report.json`` (its types checked by :class:`RunReport`)."""
    opts = rep.get("options") or {}
    details = rep.get("details") or {}
    rs = _realized(rep.get("realized_sparsity"), source, RUN_FIX)
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
    run.kept = _kept_rows(details.get("per_layer"), source, RUN_FIX, "details.per_layer")
    alloc = _allocation(details.get("allocation"), source, RUN_FIX, "details.allocation")
    if alloc is not None:
        run.qk_removal = alloc
    return run


def _attach(run: Run, path: Path, doc: Any) -> bool:
    """Attach a selection, perplexity or QK-error JSON of the run folder to ``run`` (its types checked); False
    for anything else (zero-shot files are merged by the caller)."""
    name, source = path.name, str(path)
    proto = doc.get("protocol") if isinstance(doc, dict) else None
    if name == SELECTION_NAME and isinstance(doc, dict):
        parse_at(Selection, doc, source, RUN_FIX)
        if not run.kept:
            run.kept = _kept_from_selection(doc)
            run.removed_blocks = run.removed_blocks or list(doc.get("removed_blocks") or [])
    elif isinstance(proto, str) and PPL_PROTOCOL.match(proto) and "ppl" in doc:
        parse_at(PplEntry, doc, source, RUN_FIX)
        run.ppl.append(_ppl_entry(str(doc.get("dataset", Path(name).stem)), doc, name))
    elif proto == ACCURACY_PROTOCOL and num(doc.get("top1")) is not None:
        run.accuracy.append({"dataset": str(doc.get("dataset", "?")), "split": doc.get("split"),
                             "top1": num(doc.get("top1")), "top5": num(doc.get("top5")),
                             "n_images": doc.get("n_images"), "images_sha256": doc.get("images_sha256"),
                             "file": name})
    elif proto == QK_PROTOCOL and "e_qk" in doc:
        parse_at(QKError, doc, source, RUN_FIX)
        run.qk_error = doc | {"file": name}
        removal = _allocation(doc.get("removal"), source, RUN_FIX, "removal")
        if removal is not None and run.qk_removal is None:
            run.qk_removal = removal
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


def _preset_name(value: Any, where: str) -> str | None:
    """A row's ``preset``: its name, or the preset's parameters (a mapping with its ``name``)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict):
        return parse_at(BenchPreset, value, where, ROW_FIX, "preset").name
    raise SecateurError(f"{where}: preset: {value!r:.40} is neither a preset name nor a preset's parameters; "
                        f"{ROW_FIX}")


def _bench_zeroshot(z: dict, where: str) -> dict:
    """A row's ``zeroshot`` as a zero-shot result: the bench writes ``{limit, mean, se, tasks: {task: score}}``,
    the scores of each task's suite metric; ``secateur eval zeroshot`` writes ``{tasks: {task: {...}}, summary}``."""
    from secateur.eval.zeroshot_tasks import TASKS

    tasks = z.get("tasks")
    if isinstance(tasks, dict) and tasks and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 for v in tasks.values()):
        rest = {k: v for k, v in z.items() if k not in ("tasks", "mean", "se", "limit")}
        z = {**rest, "tasks": {t: {"metric": TASKS[t].metric if t in TASKS else "score", "score": v}
                               for t, v in tasks.items()},
             "summary": {"tasks": list(tasks), "mean": z.get("mean"), "se": z.get("se")},
             "settings": {"limit": z.get("limit")}}
    parse_at(ZeroshotResult, z, where, ROW_FIX, "zeroshot")
    return z


def _row_run(row: dict, source: str, where: str = "", preset: str | None = None) -> Run:
    """Normalize one bench row (unstructured/structured/qk-wanda/cocurve/llm-compressor layouts), checking the
    parts it reads (``where``: the file and line, for messages)."""
    where = where or source
    name = row.get("row") or row.get("key")
    mod = row.get("modifier_args") if isinstance(row.get("modifier_args"), dict) else {}
    parse_at(ModifierArgs, mod, where, ROW_FIX, "modifier_args")
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
        sparsity = 1 - n / mm if mm else None
    if method == "dense":
        sparsity = 0.0
    if name is None:
        name = f"{method}-{sparsity:g}" if sparsity is not None else method
    quals = {k: row.get(k) for k in QUALIFIERS}
    rs = _realized(row.get("realized_sparsity", row.get("realized")), where, ROW_FIX)
    run = Run(name=str(name), source=source, method=_label(str(method), quals, pattern), sparsity=sparsity,
              pattern=pattern, preset=preset, realized=num(rs.get("targeted")),
              realized_all=num(rs.get("of_all_parameters", row.get("params_removed_fraction"))),
              prune_s=num(row.get("prune_s", row.get("selection_s"))), calibration=row.get("calibration"),
              peak_rss_mb=num(row.get("peak_rss_mb_after_prune", row.get("peak_rss_mb"))),
              versions=row.get("versions"), machine=row.get("machine"))
    if isinstance(row.get("per_layer"), list):
        run.kept = _kept_rows(row["per_layer"], where, ROW_FIX, "per_layer")
    if method != "dense" and (run.kept or row.get("by_kind") is not None or num(row.get("params")) is not None):
        run.kind = "structured"  # bench rows count parameters only for structured (sliced) models
        run.params_after = row.get("params")
        run.removed_blocks = list(row.get("removed_blocks") or [])
    for k, v in row.items():  # top-level {dataset: {ppl, protocol, ...}}
        if isinstance(v, dict) and num(v.get("ppl")) is not None:
            parse_at(PplEntry, v, where, ROW_FIX, k)
            run.ppl.append(_ppl_entry(k, v))
    if isinstance(row.get("ppl"), dict):
        for k, v in row["ppl"].items():
            if isinstance(v, dict):
                parse_at(PplEntry, v, where, ROW_FIX, f"ppl.{k}")
                run.ppl.append(_ppl_entry(k, v))
    alloc = _allocation(row.get("allocation"), where, ROW_FIX, "allocation")
    if alloc is not None:
        run.qk_removal = alloc
    if isinstance(row.get("zeroshot"), dict) and isinstance(row["zeroshot"].get("tasks"), dict):
        run.zeroshot = _bench_zeroshot(row["zeroshot"], where)
    return run


def load_jsonl(path: Path, preset: str | None = None) -> list[Run]:
    """Runs of a bench results file (the latest row per ``(preset, row)`` wins). Every row read is checked
    (:class:`~secateur.schemas.report.BenchRow`): a damaged one is one line naming the file, the line and the key."""
    rows: dict[tuple, tuple[int, dict]] = {}
    qk: dict[tuple, dict] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        line = e.object[:e.start].count(b"\n") + 1
        raise SecateurError(f"{path}:{line}: not UTF-8 text (byte 0x{e.object[e.start]:02x}); {ROW_FIX}") from None
    except OSError as e:
        raise SecateurError(f"{path}: cannot read ({e.strerror or e}); check the file's permissions") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SecateurError(f"{path}:{n}: invalid JSON ({e.msg}); {ROW_FIX}") from None
        except RecursionError:
            raise SecateurError(f"{path}:{n}: invalid JSON (nested too deeply); {ROW_FIX}") from None
        if not isinstance(row, dict):
            continue
        kind = row.get("kind", "row")
        is_qk = kind == "qk-error"
        if not is_qk and not (kind == "row" and any(k in row for k in ("row", "key", "method"))):
            continue  # not a result row (plans, meta rows): not read
        where = f"{path}:{n}"
        parse_at(BenchRow, row, where, ROW_FIX)
        name = _preset_name(row.get("preset"), where)
        if preset is not None and name != preset:
            continue
        ident = row.get("row") or row.get("key") or (row.get("method"), row.get("rho", row.get("sparsity")))
        key = (name, str(ident))
        if is_qk:
            qk[key] = row
        else:
            rows.pop(key, None)  # re-insert: file order of the latest version
            rows[key] = (n, row)
    if not rows:
        extra = f" for preset {preset!r}" if preset is not None else ""
        raise SecateurError(f"{path}: no result rows{extra} (expected JSON objects with row/key/method); pass a "
                            "bench results file" + (", or another --preset" if preset is not None else ""))
    dense_params = {k[0]: r["params"] for k, (_, r) in rows.items()
                    if (r.get("method") == "dense" or r.get("row") == "dense") and num(r.get("params")) is not None}
    runs = []
    for key, (n, row) in rows.items():
        run = _row_run(row, f"{path.name}#{key[1]}", f"{path}:{n}", key[0])
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
            raise SecateurError(f"{p} does not exist; pass a secateur prune output folder or a .jsonl results file")
        else:
            raise SecateurError(f"{p}: not a secateur prune output folder or a .jsonl results file; pass one of those")
    if not runs:
        raise SecateurError("no runs given; pass run folders or .jsonl results files")
    seen: dict[str, int] = {}
    for r in runs:
        seen[r.name] = seen.get(r.name, 0) + 1
    for r in runs:  # the same name from two inputs: name them by their source
        if seen[r.name] > 1:
            r.name = r.source if "#" in r.source else f"{Path(r.source).parent.name}/{r.name}"
    return runs
