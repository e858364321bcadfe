"""Shared helpers for benchmark scripts: presets, cached calibration tokens, row files, tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "_work"  # cached token files and scratch (git-ignored)
# where rows and pages go: results/, or $BENCH_RESULTS (the suite runs the bench scripts on tiny models there)
RESULTS = Path(os.environ.get("BENCH_RESULTS") or ROOT / "results")

#: the topic folders of results/ (what each holds: results/README.md)
RESULT_TOPICS = ("text", "vision", "vlm", "deploy", "speed", "reliability", "device")


def results_dir(topic: str) -> Path:
    """``results/<topic>/`` (made if absent): results/README.md indexes every study by topic folder."""
    if topic not in RESULT_TOPICS:
        raise ValueError(f"unknown results topic {topic!r}: {', '.join(RESULT_TOPICS)}")
    d = RESULTS / topic
    d.mkdir(parents=True, exist_ok=True)
    return d


# Named protocol presets. full = the papers' protocol; quick = fewer tokens, same everything else.
PRESETS = {
    "full": {"nsamples": 128, "seqlen": 2048, "max_windows": None},
    "quick": {"nsamples": 32, "seqlen": 2048, "max_windows": 32},
    "smoke": {"nsamples": 2, "seqlen": 256, "max_windows": 2},
}


def model_path(model: str) -> str:
    """A bench's model argument as secateur reads it: the GGUF files ``bench/tools/get_models.py`` assembles
    (``qwen2.5-0.5b``, ``gemma3-270m``) by their path, anything else (a name, a folder) as given."""
    from bench.tools.get_models import MODELS, models_dir

    return str(models_dir() / MODELS[model].file) if model in MODELS else model


def calib_tokens(tokenizer, source: str, nsamples: int, seqlen: int, seed: int = 0):
    """Calibration ids cached on disk so every row (and llm-compressor) sees the same tokens."""
    from secateur.data.windows import calibration_set

    WORK.mkdir(parents=True, exist_ok=True)
    path = WORK / f"calib-{source}-{nsamples}x{seqlen}-seed{seed}.pt"
    if path.exists():
        blob = torch.load(path)
        return blob["ids"], blob["manifest"]
    ids, man = calibration_set(source, tokenizer, nsamples, seqlen, seed)
    torch.save({"ids": ids, "manifest": man.to_dict()}, path)
    return ids, man.to_dict()


def run_child(script: Path, args: list[str], log: Path) -> int:
    """Run one row in a fresh process (independent peak RSS), logging to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        return subprocess.call([sys.executable, str(script), *args], stdout=f, stderr=subprocess.STDOUT,
                               env=os.environ | {"TOKENIZERS_PARALLELISM": "false"})


def run_logged(cmd: list[str], log: Path) -> tuple[int, float]:
    """Run ``cmd`` with its output appended to ``log`` (after the command line): ``(exit code, seconds)``."""
    import time

    t = time.perf_counter()
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT,
                             env=os.environ | {"TOKENIZERS_PARALLELISM": "false"})
    return rc, time.perf_counter() - t


def rerunnable(command: str) -> str:
    """``command`` with each ``bench/<script>`` path written before bench/ was grouped into folders (issue 27)
    pointing at where that script is now: a record keeps the command it ran, a page names one anyone can rerun."""
    import re

    def now(m: re.Match) -> str:
        found = list((ROOT / "bench").glob(f"*/{m.group(1)}"))
        return f"bench/{found[0].parent.name}/{m.group(1)}" if len(found) == 1 else m.group(0)

    return re.sub(r"\bbench/([\w.-]+\.(?:py|sh))\b", now, command)


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _locked(path: Path):
    """An exclusive lock beside ``path``: two benchmark lanes may append to or rewrite one JSONL file."""
    import fcntl
    from contextlib import contextmanager

    @contextmanager
    def held():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    return held()


def git_commit() -> str:
    """``git describe --always --dirty`` of this checkout ("unknown" outside a git checkout)."""
    import subprocess

    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# The checkout as this process found it: a long run's rows name the code it loaded, not whatever the checkout
# holds when each row is written (a row written an hour later, after commits, would name the wrong code).
START_COMMIT = git_commit()


def stamped(record: dict) -> dict:
    """``record`` with the commit it was measured at (the checkout at the process's start; ``commit_at_write``
    when the checkout differs now), the machine's load average and the time it was written, unless it names
    them itself: every bench record, a JSONL row or a whole JSON file, goes through here."""
    now = git_commit()
    record = {"commit": START_COMMIT, "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()],
              "written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())} | record
    return {"commit_at_write": now} | record if now != START_COMMIT else record


def append_row(path: Path, row: dict, unique_key: bool = False) -> bool:
    """Append ``row``; with ``unique_key``, only when no row with its ``key`` exists (checked under the lock,
    so two lanes never both append one key). Returns whether it was written. Every row gets the commit it was
    measured at and the machine's load average when it was written (``stamped``)."""
    row = stamped(row)
    with _locked(path):
        if unique_key and any(r.get("key") == row["key"] for r in read_rows(path)):
            return False
        with open(path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
    return True


def fmt(x, nd=2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


# Zero-shot column of every results table: the first ZS_LIMIT documents of each of the seven tasks, so
# rows are comparable; the full splits are in results/text/zeroshot-smollm2.md (dense only: ~3.4M tokens).
ZS_LIMIT = int(os.environ.get("BENCH_ZS_LIMIT", "100"))


def zeroshot_cell(model, tokenizer, limit: int = ZS_LIMIT) -> dict:
    """Seven-task zero-shot mean (with its task-stratified SE) of an in-memory model, first ``limit`` docs."""
    from secateur.eval.zeroshot import evaluate_zeroshot

    res = evaluate_zeroshot(model, tokenizer, limit=limit, progress=False)
    return {"limit": limit, "mean": res["summary"]["mean"], "se": res["summary"]["se"],
            "tasks": {t: m["score"] for t, m in res["tasks"].items()}, "seconds": res["speed"]["seconds"]}


def fmt_zs(cell: dict | None) -> str:
    return "-" if not cell else f"{cell['mean']:.2f} +- {cell['se']:.2f}"


def _dense_evals(field: str):
    """(record, source) for every dense row's ``field`` in ``results/*/*.jsonl``, in the layout of any bench."""
    for path in sorted(RESULTS.glob("*/*.jsonl")):
        for r in read_rows(path):
            if r.get("row") == "dense":  # QK-Wanda bench layout
                e = r.get(field)
            elif r.get("method") == "dense":  # structured / compensation / CoCurve layout
                e = r.get(field) if field == "zeroshot" else (r.get("ppl") or {}).get(field)
            else:
                continue
            if isinstance(e, dict) and "reused_from" not in e:
                preset = r.get("preset")
                name = preset.get("name") if isinstance(preset, dict) else preset
                yield e, f"results/{path.parent.name}/{path.name} (dense, preset {name})"


def find_dense_ppl(dataset: str, protocol: str, windows: int | None, tokens_sha256: str) -> dict | None:
    """A dense perplexity some bench already recorded on the same protocol, window count (None = every window)
    and corpus token hash, with ``reused_from`` naming it; None when there is none. The dense model does not
    depend on any calibration, so any bench's dense evaluation is valid for another."""
    for e, src in _dense_evals(dataset):
        if (e.get("protocol") == protocol and e.get("tokens_sha256") == tokens_sha256
                and (e.get("windows") == e.get("windows_total") if windows is None else e.get("windows") == windows)):
            return e | {"reused_from": src}
    return None


def find_dense_zeroshot(limit: int = ZS_LIMIT) -> dict | None:
    """A dense zero-shot cell some bench already recorded on the same first ``limit`` documents per task."""
    for e, src in _dense_evals("zeroshot"):
        if e.get("limit") == limit and "mean" in e:
            return e | {"reused_from": src}
    return None


def read_rows_key(path: Path, key: str) -> dict | None:
    return next((r for r in read_rows(path) if r.get("key") == key), None)


def merge_row_field(path: Path, match: dict, field: str, value) -> None:
    """Set ``field`` on the rows of a JSONL file whose keys equal ``match`` (atomic rewrite). A callable
    ``value`` maps the row's current value to the new one, under the lock (merges never drop another
    lane's update)."""
    with _locked(path):
        rows = read_rows(path)
        for r in rows:
            if all(r.get(k) == v for k, v in match.items()):
                r[field] = value(r.get(field)) if callable(value) else value
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
        os.replace(tmp, path)


def row_sink(path: Path, on_new, describe):
    """``emit(rec)``: append ``rec`` to ``path`` unless its ``key`` is already there (resumable sweeps);
    a stored row that lacks a corpus or the zero-shot cell ``rec`` now has gets them merged in. Calls
    ``on_new()`` (re-render) after each change and prints ``describe(rec)``."""
    stored = {r["key"]: r for r in read_rows(path)}

    def emit(rec: dict) -> None:
        old = stored.get(rec["key"])
        if old is None and append_row(path, rec, unique_key=True):
            on_new()
        else:
            old = old or read_rows_key(path, rec["key"]) or {}
            grew = [f for f in ("ppl", "zeroshot") if rec.get(f) and any(
                k not in (old.get(f) or {}) for k in (rec[f] if f == "ppl" else ("mean",)))]
            for f in grew:
                merge_row_field(path, {"key": rec["key"]}, f, rec[f] if f == "zeroshot" else (
                    lambda cur: (cur or {}) | rec["ppl"]))
            if grew:
                on_new()
        stored[rec["key"]] = read_rows_key(path, rec["key"]) or rec
        print(describe(rec), flush=True)

    return emit


def smollm2_wikitext_windows(seqlen: int, windows: int, model: str = "smollm2-135m"
                             ) -> tuple[list[list[int]], list[int], str]:
    """secateur's first ``windows`` nonoverlap WikiText-2 windows of ``seqlen`` for ``model``'s tokenizer (SmolLM2's by
    default), as the engine benches (llama.cpp, vLLM) feed them: (window ids, scored count per window, protocol id)."""
    from transformers import AutoTokenizer

    from secateur.data.sources import eval_text
    from secateur.data.windows import eval_ids  # the same tokenization as `secateur eval ppl`
    from secateur.eval.ppl import eval_windows, protocol_id
    from secateur.models.loading import resolve

    tok = AutoTokenizer.from_pretrained(resolve(model, "float32")[0])
    ids = eval_ids(eval_text("wikitext2"), tok)
    ids, plan, rule, _ = eval_windows(ids, seqlen, None, windows, tok, None)
    plan = plan[:windows]
    return [ids[b:e].tolist() for b, e, _ in plan], [n for _, _, n in plan], protocol_id(seqlen, None, rule)
