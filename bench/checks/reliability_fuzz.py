"""The generated-input tests run longer than CI runs them, with their cases counted by class (issue 25).

    python bench/checks/reliability_fuzz.py --examples 300 --seed 1     # -> results/reliability/reliability-fuzz.json

Runs ``tests/test_fuzz_*.py`` with hypothesis's ``long`` profile (``SECATEUR_FUZZ_EXAMPLES`` cases per test, a
random seed of its own rather than CI's fixed one) and ``tests/test_signals.py`` (every stage x SIGINT/SIGTERM
and random times), each case logged by ``tests/contract.py`` (``SECATEUR_FUZZ_LOG``). The record holds, per
class, the cases, the exit codes, the broken promises (with the first few problems), and for the signal
matrix each case's outcome. ``bench/checks/reliability_report.py`` renders it into
``results/reliability/reliability.md``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import stamped

ROOT = Path(__file__).resolve().parents[2]

OUT = ROOT / "results" / "reliability" / "reliability-fuzz.json"


def _pytest(args: list[str], env: dict) -> tuple[int, str, float]:
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT,
                       capture_output=True, text=True, env=env)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=300, help="hypothesis cases per generated test")
    ap.add_argument("--seed", type=int, default=1, help="hypothesis seed (CI's profile is derandomized)")
    ap.add_argument("--no-signals", action="store_true")
    args = ap.parse_args()
    log = Path(tempfile.mkdtemp(prefix="secateur-fuzz-")) / "cases.jsonl"
    env = os.environ | {"SECATEUR_FUZZ_LOG": str(log), "HYPOTHESIS_PROFILE": "long",
                        "SECATEUR_FUZZ_EXAMPLES": str(args.examples)}
    load_before = os.getloadavg()
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_fuzz_*.py"))
    rc, text, secs = _pytest([*files, f"--hypothesis-seed={args.seed}"], env)
    summary = (re.findall(r"\d+ (?:passed|failed|error)[^\n]*", text) or ["?"])[-1]
    cases = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    by: dict[str, dict] = {}
    for c in cases:
        d = by.setdefault(c["class"], {"cases": 0, "exit": collections.Counter(), "broken": 0, "problems": []})
        d["cases"] += 1
        d["exit"][str(c["exit"])] += 1
        if not c["ok"]:
            d["broken"] += 1
            if len(d["problems"]) < 5:
                d["problems"].append(c["problem"])
    record = {"command": f"python bench/checks/reliability_fuzz.py --examples {args.examples} --seed {args.seed}",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "load_before": [round(x, 2) for x in load_before], "files": files, "pytest_rc": rc,
              "pytest_summary": summary, "seconds": round(secs, 1),
              "classes": {k: v | {"exit": dict(v["exit"])} for k, v in sorted(by.items())},
              "tracebacks": sum("traceback" in (c.get("problem") or "") for c in cases)}
    if rc != 0:
        record["pytest_tail"] = text[-4000:]
    if not args.no_signals:
        rc2, text2, secs2 = _pytest(["tests/test_signals.py", "-rA"], os.environ)
        rows = re.findall(r"^(PASSED|FAILED) tests/test_signals.py::(\S+)", text2, re.M)
        record["signals"] = {"rc": rc2, "seconds": round(secs2, 1), "cases": [{"case": c, "ok": s == "PASSED"}
                                                                             for s, c in rows]}
    record["load_after"] = [round(x, 2) for x in os.getloadavg()]
    record = stamped(record)
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("pytest_summary", "tracebacks", "seconds")}), flush=True)
    for k, v in record["classes"].items():
        print(f"{k}: {v['cases']} cases, exits {v['exit']}, broken {v['broken']}")


if __name__ == "__main__":
    main()
