"""Every row of the fixable-input table (tests/error_cases.py) through a real ``python -m secateur.cli`` process.

    PYTHONPATH=src python bench/checks/reliability_table.py  # results/reliability/reliability-table.{md,jsonl}

Per row: the exit code, the first line of stderr, the number of stderr lines, whether a traceback appeared,
whether anything new was written, and ``ok`` (exit code, one matching line, no traceback, nothing written).
Inputs (tiny random models saved to folders, broken files) are built in a temporary folder and removed at
the end. Exit status: 0 when every applicable row is ok.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports

from error_cases import CASES, TRACEBACK, Case, Workspace, check_stderr, snapshot  # noqa: E402

from bench.common import stamped  # noqa: E402


def _anon(text: str, models: Path, scratch: Path) -> str:
    """The run's temporary folders as ``$MODELS`` / ``$TMP``, so the table reads the same on every run."""
    return text.replace(str(models), "$MODELS").replace(str(scratch), "$TMP")


def run_case(case: Case, models: Path, scratch: Path) -> dict:
    if case.when is not None and not case.when():
        return {"id": case.id, "skipped": "does not apply on this machine"}
    ws = Workspace(models, scratch)
    argv = case.argv(ws)
    before = snapshot(models, scratch)
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "secateur.cli", *argv], capture_output=True, text=True, env=env,
                       stdin=subprocess.DEVNULL, timeout=600)
    seconds = time.perf_counter() - t0
    written = snapshot(models, scratch) != before
    why = check_stderr(case, p.stderr)
    lines = p.stderr.splitlines()
    return {"id": case.id, "argv": ["secateur", *[_anon(a, models, scratch) for a in argv]],
            "exit": p.returncode, "expected_exit": case.exit,
            "stderr_first_line": _anon(lines[0], models, scratch) if lines else "",
            "stderr_lines": len(lines), "traceback": TRACEBACK in p.stderr, "wrote_files": written,
            "ok": p.returncode == case.exit and why is None and not written, "problem": why,
            "seconds": round(seconds, 2)}


def markdown(rows: list[dict]) -> str:
    done = [r for r in rows if "skipped" not in r]
    ok = sum(r["ok"] for r in done)
    out = ["# Fixable inputs: one line, exit 2, nothing written", "",
           f"`python bench/checks/reliability_table.py`: every row of `tests/error_cases.py` through a real "
           f"`python -m secateur.cli` process. {ok}/{len(done)} rows ok"
           + (f", {len(rows) - len(done)} skipped (do not apply on this machine)" if len(done) < len(rows) else "")
           + ". `$MODELS`: tiny random models and broken files made for the run; `$TMP`: the row's scratch folder "
           "(its `--out` and input files).", "",
           "| input | command | exit | stderr (first line) | ok |", "|---|---|---:|---|---|"]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['id']} | | | skipped: {r['skipped']} | |")
            continue
        cmd = " ".join(r["argv"]).replace("|", "\\|")
        err = r["stderr_first_line"].replace("|", "\\|")
        ok = "yes" if r["ok"] else f"NO: {r['problem']}"
        out.append(f"| {r['id']} | `{cmd}` | {r['exit']} | {err} | {ok} |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "reliability" / "reliability-table"),
                    help="path without suffix")
    ap.add_argument("-k", default=None, help="only rows whose id contains this")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="secateur-reliability-") as d:
        models = Path(d) / "models"
        models.mkdir()
        for i, case in enumerate(c for c in CASES if args.k is None or args.k in c.id):
            scratch = Path(d) / f"row{i:03d}"
            scratch.mkdir()
            rows.append(run_case(case, models, scratch))
            r = rows[-1]
            print(f"{r['id']}: " + (r.get("skipped") or f"exit {r['exit']} {'ok' if r['ok'] else 'NOT OK'}: "
                                    f"{r['stderr_first_line']}"), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(markdown(rows))
    out.with_suffix(".jsonl").write_text("".join(json.dumps(stamped(r)) + "\n" for r in rows))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.jsonl')}")
    return 0 if all(r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
