"""The generated-input tests run longer than CI runs them, with their cases counted by class (issues 25 and 50).

    python bench/checks/reliability_fuzz.py --examples 300 --seed 1     # -> results/reliability/reliability-fuzz.json
    python bench/checks/reliability_fuzz.py --only boundaries --examples 10 --timeout 600   # a run that fits a budget

Groups (``--only``, comma-separated; all by default), each its own pytest process:

* ``cli``, ``files``: ``tests/test_fuzz_cli.py``, ``tests/test_fuzz_files.py`` (issue 25's classes);
* ``boundaries``: ``tests/test_fuzz_boundaries.py`` (round three: api-signature, out-paths, recover-masks-mutated,
  shard-sets, vlm);
* ``processes``: ``tests/test_fuzz_processes.py`` (round three's real processes: dist-env, concurrency, faults; the
  long matrix runs only under the ``long`` profile, a tenth of ``--examples`` for the generated environments);
* ``signals``: ``tests/test_signals.py`` (every stage x SIGINT/SIGTERM and random times).

Each group runs with hypothesis's ``long`` profile (``SECATEUR_FUZZ_EXAMPLES`` cases per generated test, a seed of
its own rather than CI's fixed one); every case is logged by ``tests/contract.py`` (``SECATEUR_FUZZ_LOG``, with the
test it came from) and every test's outcome read from pytest's JUnit XML. The record holds, per class: cases, exit
codes, broken promises, tracebacks, hangs, silent wrong results (exit 0, then the test's own check of the output
failed), debris (something left beside the output, or a user file touched), with the first few problems; per test
(the process/fault matrix is read from these): outcome, seconds, exits. A run replaces, in the record, the groups it
ran and keeps the others with their own command, commit, date, machine and load, so a budget-sized run of one group
does not erase the rest. ``bench/checks/reliability_report.py`` renders it into ``results/reliability/reliability.md``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.common import git_commit, results_dir

ROOT = Path(__file__).resolve().parents[2]

OUT = results_dir("reliability") / "reliability-fuzz.json"

#: group -> (its test files, the classes its cases are logged under; issue 25's are whatever the log holds)
GROUPS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "cli": (("tests/test_fuzz_cli.py",), ()),
    "files": (("tests/test_fuzz_files.py",), ()),
    "boundaries": (("tests/test_fuzz_boundaries.py",),
                   ("api-signature", "out-paths", "recover-masks-mutated", "shard-sets", "vlm")),
    "processes": (("tests/test_fuzz_processes.py",), ("dist-env", "concurrency", "faults")),
    "signals": (("tests/test_signals.py",), ()),
}
#: the groups of issue 50's round three (section 5 of the page) and of issue 25 (section 0)
ROUND_THREE = ("boundaries", "processes")
ISSUE_25 = ("cli", "files", "signals")

# a failed test whose logged cases all kept the contract: what its failing statement checked
_WRONG = re.compile(r"folder_digest\(|_sha_tensors\(|torch\.equal|allclose|== alone|\bres\[0\] == res\[1\]|reapplied"
                    r"|came back|zeroed|\.any\(\)")
_DEBRIS = re.compile(r"_debris\(|iterdir\(\)|listdir\(|lock_path\(|checkpoint_dir\(|hidden|entries\)|thesis")


def runs_of(record: dict | None) -> list[dict]:
    """The runs a record holds, oldest first. A record written before issue 50 (one run of ``tests/test_fuzz_*.py``
    in one pytest process, its signals apart) reads as one run with the groups ``cli+files`` and ``signals``."""
    if not record:
        return []
    if "runs" in record:
        return record["runs"]
    groups = {"cli+files": {k: record[k] for k in ("files", "pytest_rc", "pytest_summary", "seconds", "classes",
                                                  "tracebacks", "pytest_tail") if k in record}}
    if record.get("signals"):
        s = record["signals"]
        groups["signals"] = {"files": ["tests/test_signals.py"], "pytest_rc": s["rc"], "seconds": s["seconds"],
                             "classes": {}, "tests": [{"id": f"tests/test_signals.py::{c['case']}",
                                                       "outcome": "passed" if c["ok"] else "failed"}
                                                      for c in s["cases"]]}
    run = {k: record[k] for k in ("command", "commit", "date", "load_before", "load_after", "seconds")
           if k in record}
    return [run | {"groups": groups}]


def group_of(runs: list[dict], name: str) -> tuple[dict, dict] | None:
    """(run, group) of the newest run that holds group ``name`` (a key such as ``cli+files`` holds ``cli``)."""
    for run in reversed(runs):
        for key, g in run["groups"].items():
            if name in key.split("+"):
                return run, g
    return None


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _node(testcase: ET.Element, files: tuple[str, ...]) -> str:
    mod = testcase.get("classname", "")
    for f in files:
        dotted = f.removesuffix(".py").replace("/", ".")
        if mod == dotted or mod.startswith(dotted + "."):
            return f"{f}::{mod[len(dotted) + 1:] + '::' if mod != dotted else ''}{testcase.get('name')}"
    return f"{mod}::{testcase.get('name')}"


def _failing_statement(text: str) -> str:
    """The source line just above pytest's first ``E`` line (``--tb=short``): the statement that failed."""
    lines = text.splitlines()
    for i, ln in enumerate(lines):
        if ln.startswith("E ") and i > 0:
            above = [x.strip() for x in lines[:i] if x.strip().strip("^~")]  # not Python's ^^^ markers
            return above[-1] if above else ""
    return ""


def failure_kind(text: str, cases: list[dict]) -> str:
    """What a failed test broke: ``broken`` (a case broke the contract; its problem says how), ``silent-wrong``
    (every case kept the contract, the test's own check of an exit-0 output failed), ``debris`` (something left
    beside the output or a user file touched), ``failed`` (anything else: a message, a rerun, a fixture)."""
    if any(not c["ok"] for c in cases):
        return "broken"
    stmt = _failing_statement(text)
    if _WRONG.search(stmt):
        return "silent-wrong"
    if _DEBRIS.search(stmt):
        return "debris"
    return "silent-wrong" if cases and cases[-1]["exit"] == 0 else "failed"


def _kind_of_problem(p: str) -> str | None:
    if "traceback" in p:
        return "tracebacks"
    if p.startswith("a hang"):
        return "hangs"
    if p.startswith(("left on disk", "user files")):
        return "debris"
    return None


def tally(cases: list[dict], tests: list[dict], expected: tuple[str, ...] = ()) -> dict[str, dict]:
    """Per class: cases, exits, broken promises and, among them, tracebacks, hangs, silent wrong results, debris;
    a failed test beyond the contract counts once under the class of its last case."""
    by: dict[str, dict] = {}

    def cls(k: str) -> dict:
        return by.setdefault(k, {"cases": 0, "exit": collections.Counter(), "broken": 0, "tracebacks": 0,
                                 "hangs": 0, "silent_wrong": 0, "debris": 0, "problems": []})

    for k in expected:
        cls(k)
    for c in cases:
        d = cls(c["class"])
        d["cases"] += 1
        d["exit"][str(c["exit"])] += 1
        if not c["ok"]:
            d["broken"] += 1
            kind = _kind_of_problem(c["problem"] or "")
            if kind:
                d[kind] += 1
            if len(d["problems"]) < 5:
                d["problems"].append(c["problem"])
    for t in tests:
        if t["outcome"] in ("failed", "error") and t.get("kind") not in (None, "broken") and t.get("classes"):
            d = cls(t["classes"][-1])
            d["broken"] += 1
            if t["kind"] == "silent-wrong":
                d["silent_wrong"] += 1
            elif t["kind"] == "debris":
                d["debris"] += 1
            if len(d["problems"]) < 5:
                d["problems"].append(f"{t['id']}: {t['kind']}: {t.get('message', '')}"[:300])
    return {k: v | {"exit": dict(v["exit"])} for k, v in sorted(by.items())}


def _read_cases(log: Path) -> list[dict]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a killed process
            continue
    return out


def _tests(junit: Path, files: tuple[str, ...], cases: list[dict], text: str = "") -> list[dict]:
    """Every test's outcome: from JUnit XML; when pytest was stopped before writing it (``--timeout``), from its
    verbose lines (``node PASSED``) and the case log, a test logged but not reported being ``unfinished``."""
    by_node: dict[str, list[dict]] = collections.defaultdict(list)
    for c in cases:
        by_node[c.get("test") or "?"].append(c)
    out: list[dict] = []
    seen: set[str] = set()
    root = ET.parse(junit).getroot() if junit.exists() else None
    for tc in root.iter("testcase") if root is not None else ():
        node = _node(tc, files)
        seen.add(node)
        mine = by_node.get(node, [])
        t = {"id": node, "outcome": "passed", "seconds": round(float(tc.get("time") or 0), 1), "cases": len(mine),
             "exits": dict(collections.Counter(str(c["exit"]) for c in mine)),
             "classes": list(dict.fromkeys(c["class"] for c in mine))}
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                t["outcome"] = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                text = (el.text or "") + "\n" + (el.get("message") or "")
                t["message"] = (el.get("message") or "").splitlines()[0][:300] if el.get("message") else ""
                if tag != "skipped":
                    t["kind"] = failure_kind(text, mine)
                    t["statement"] = _failing_statement(el.text or "")[:200]
                break
        out.append(t)
    reported = {} if root is not None else \
        {m[0]: m[1].lower() for m in re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)\b", text, re.M)}
    for node in reported:
        by_node.setdefault(node, [])
    for node, mine in by_node.items():  # never in the XML: pytest was stopped
        if node not in seen:
            out.append({"id": node, "outcome": {"error": "failed"}.get(reported.get(node, ""), reported.get(node))
                        or "unfinished", "cases": len(mine),
                        "exits": dict(collections.Counter(str(c["exit"]) for c in mine)),
                        "classes": list(dict.fromkeys(c["class"] for c in mine))})
    return out


def run_group(name: str, examples: int, seed: int, timeout: float | None, work: Path) -> dict:
    files, expected = GROUPS[name]
    log, junit = work / f"{name}.jsonl", work / f"{name}.xml"
    for f in (log, junit):  # a group's own cases and outcomes only
        f.unlink(missing_ok=True)
    env = os.environ | {"SECATEUR_FUZZ_LOG": str(log), "HYPOTHESIS_PROFILE": "long",
                        "SECATEUR_FUZZ_EXAMPLES": str(examples)}
    argv = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--tb=short", f"--junitxml={junit}",
            *files, f"--hypothesis-seed={seed}"]
    t = time.monotonic()
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)  # its own group: a timeout stops the test's children too
    timed_out = False
    try:
        text, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(p.pid, signal.SIGKILL)
        text, _ = p.communicate()
    secs = time.monotonic() - t
    cases = _read_cases(log)
    tests = _tests(junit, files, cases, text)
    summary = (re.findall(r"\d+ (?:passed|failed|error|skipped)[^\n=]*", text) or ["?"])[-1].strip()
    g = {"files": list(files), "pytest_rc": p.returncode, "pytest_summary": summary, "seconds": round(secs, 1),
         "timed_out": timed_out, "classes": tally(cases, tests, expected), "tests": tests,
         "tracebacks": sum("traceback" in (c.get("problem") or "") for c in cases)}
    if timed_out:
        g["pytest_summary"] = f"stopped after {timeout:g} s (--timeout), {len(cases)} cases logged"
    if p.returncode != 0 or timed_out:
        g["pytest_tail"] = text[-4000:]
    return g


def merge(old: dict | None, run: dict) -> dict:
    """The record with ``run`` appended and the groups it ran removed from older runs (an emptied run goes)."""
    ran = {n for key in run["groups"] for n in key.split("+")}
    runs = []
    for r in runs_of(old):
        kept = {k: g for k, g in r["groups"].items() if not ran.intersection(k.split("+"))}
        if kept:
            runs.append(r | {"groups": kept})
    return {"format": 2, "runs": [*runs, run]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=300, help="hypothesis cases per generated test")
    ap.add_argument("--seed", type=int, default=1, help="hypothesis seed (CI's profile is derandomized)")
    ap.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated groups: {', '.join(GROUPS)}")
    ap.add_argument("--no-signals", action="store_true", help="all groups but signals")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per group; a group still running is "
                    "stopped, recorded as timed out with the cases it logged")
    args = ap.parse_args()
    groups = [g.strip() for g in args.only.split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown or not groups:
        ap.error(f"--only {args.only!r}: unknown group(s) {unknown}; choose from {', '.join(GROUPS)}")
    if args.no_signals:
        groups = [g for g in groups if g != "signals"]
    command = "python bench/checks/reliability_fuzz.py" + \
        ("" if groups == list(GROUPS) else f" --only {','.join(groups)}") + \
        f" --examples {args.examples} --seed {args.seed}" + \
        ("" if args.timeout is None else f" --timeout {args.timeout:g}")
    work = Path(tempfile.mkdtemp(prefix="secateur-fuzz-"))
    load_before = [round(x, 2) for x in os.getloadavg()]
    t = time.monotonic()
    run = {"command": command, "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": _cpu(), "cores": os.cpu_count(), "load_before": load_before, "examples": args.examples,
           "seed": args.seed, "groups": {}}
    for name in groups:
        run["groups"][name] = g = run_group(name, args.examples, args.seed, args.timeout, work)
        c = g["classes"]
        print(f"{name}: {g['pytest_summary']}; " + "; ".join(
            f"{k} {v['cases']} cases, exits {v['exit']}, broken {v['broken']}" for k, v in c.items()), flush=True)
    run["load_after"] = [round(x, 2) for x in os.getloadavg()]
    run["seconds"] = round(time.monotonic() - t, 1)
    old = json.loads(OUT.read_text()) if OUT.exists() else None
    OUT.write_text(json.dumps(merge(old, run), indent=1) + "\n")
    print(f"wrote {OUT} ({run['seconds']} s, load {load_before[0]} -> {run['load_after'][0]})", flush=True)


if __name__ == "__main__":
    main()
