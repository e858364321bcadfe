"""Section 5 of results/reliability/reliability.md (issue 50, round three) is rendered from the record of
``bench/checks/reliability_fuzz.py``: the class table, the process/fault matrix, a broken count shown where it
cannot be read past; and the record's bookkeeping (cases tied to their tests, a partial run merged into the record,
a record from before issue 50 read as it was). Synthetic records, no pytest run, no model."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.checks import reliability_fuzz as fuzz  # noqa: E402
from bench.checks import reliability_report as report  # noqa: E402


def _cls(cases, exit0, exit2, broken=0, tracebacks=0, hangs=0, silent=0, debris=0, other=None, problems=()):
    e = {"0": exit0, "2": exit2} | (other or {})
    return {"cases": cases, "exit": {k: v for k, v in e.items() if v}, "broken": broken, "tracebacks": tracebacks,
            "hangs": hangs, "silent_wrong": silent, "debris": debris, "problems": list(problems)}


def _run(groups: dict, **kw) -> dict:
    return {"command": "python bench/checks/reliability_fuzz.py --only boundaries,processes --examples 10 --seed 1",
            "commit": "abc1234", "date": "2026-12-08 00:05 UTC", "machine": "Test CPU", "cores": 2,
            "load_before": [1.5, 2.0, 2.5], "load_after": [1.75, 2.0, 2.5], "seconds": 99.0, "groups": groups} | kw


def _boundaries(**vlm) -> dict:
    classes = {"api-signature": _cls(10, 0, 10), "out-paths": _cls(10, 3, 7),
               "recover-masks-mutated": _cls(12, 4, 8), "shard-sets": _cls(20, 5, 15),
               "vlm": _cls(8, 1, 7) | vlm}
    return {"files": ["tests/test_fuzz_boundaries.py"], "pytest_rc": 0, "pytest_summary": "9 passed in 50.0s",
            "seconds": 51.2, "timed_out": False, "classes": classes, "tests": [], "tracebacks": 0}


def _processes(failed: bool = False) -> dict:
    tests = [
        {"id": "tests/test_fuzz_processes.py::test_distributed_environment", "outcome": "passed", "seconds": 20.5,
         "cases": 3, "exits": {"0": 1, "2": 2}, "classes": ["dist-env"]},
        {"id": "tests/test_fuzz_processes.py::test_two_runs_onto_one_out[plain]", "outcome": "passed",
         "seconds": 30.0, "cases": 2, "exits": {"0": 1, "2": 1}, "classes": ["concurrency"]},
        {"id": "tests/test_fuzz_processes.py::test_procs_rank_killed_at_a_point[join]",
         "outcome": "failed" if failed else "passed", "seconds": 41.0, "cases": 1, "exits": {"0": 1},
         "classes": ["faults"]} | ({"kind": "silent-wrong", "message": "AssertionError: digests differ"}
                                  if failed else {}),
    ]
    classes = {"dist-env": _cls(3, 1, 2), "concurrency": _cls(2, 1, 1),
               "faults": _cls(1, 1, 0, broken=int(failed), silent=int(failed),
                              problems=["...[join]: silent-wrong: AssertionError: digests differ"] if failed else [])}
    return {"files": ["tests/test_fuzz_processes.py"], "pytest_rc": int(failed),
            "pytest_summary": "2 passed, 1 failed" if failed else "3 passed", "seconds": 91.5, "timed_out": False,
            "classes": classes, "tests": tests, "tracebacks": 0}


def _row(lines: list[str], first_cell: str) -> list[str]:
    """The class table's row of ``first_cell`` (the table under the header that names 'silent wrong'), as cells."""
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| class | what the generator varies |"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    rows = [ln for ln in lines[start:end] if ln.startswith(f"| {first_cell} |")]
    assert len(rows) == 1, (first_cell, rows)
    return [c.strip() for c in rows[0].strip("|").split(" | ")]


def test_the_class_table_and_the_matrix_come_from_the_record():
    rec = {"format": 2, "runs": [_run({"boundaries": _boundaries(), "processes": _processes()})]}
    lines = report.round_three_section(rec)
    text = "\n".join(lines)
    assert lines[0].startswith("## 5. Round three")
    # one row per class of round three, cells in the header's order
    assert _row(lines, "shard-sets")[2:] == ["20", "5", "15", "0", "0", "0", "0", "0", "0"]
    assert _row(lines, "dist-env")[2:] == ["3", "1", "2", "0", "0", "0", "0", "0", "0"]
    for k in ("api-signature", "out-paths", "recover-masks-mutated", "vlm", "concurrency", "faults"):
        _row(lines, k)
    # the totals, the run's command, commit, date, machine and load
    assert "**66 cases, 0 broken promises, 0 tracebacks, 0 hangs, 0 silent wrong results, 0 debris; 0 failed " \
           "tests.**" in text
    assert "NOT CLEAN" not in text
    assert "`python bench/checks/reliability_fuzz.py --only boundaries,processes --examples 10 --seed 1` at " \
           "`abc1234`, 2026-12-08 00:05 UTC, on Test CPU (2 cores), load 1.5 / 2.0 / 2.5 before" in text
    # the matrix: one row per test of the processes group
    starts = tuple(f"| {k} | `test_" for k in ("dist-env", "concurrency", "faults"))
    matrix = [ln for ln in lines if ln.startswith(starts)]
    assert len(matrix) == 3, matrix
    assert "`test_procs_rank_killed_at_a_point` `join`" in matrix[2] and "kept the promise" in matrix[2]
    assert "1 exit 0, 2 exit 2" in matrix[0]
    # the fixed notes keep what was found and fixed, the two facts the lead added among them
    assert "src/secateur/launch.py" in text and "SECATEUR_JOIN_TIMEOUT" in text


def test_a_broken_count_or_a_traceback_cannot_be_read_past():
    vlm = {"broken": 2, "tracebacks": 1, "problems": ["a traceback reached stderr: ...IndexError"]}
    rec = {"format": 2, "runs": [_run({"boundaries": _boundaries(**vlm), "processes": _processes(failed=True)})]}
    lines = report.round_three_section(rec)
    text = "\n".join(lines)
    head = [ln for ln in lines if ln.startswith("> **NOT CLEAN:")]
    assert len(head) == 1 and "3 broken promises, 1 tracebacks" in head[0] and "1 silent wrong" in head[0], head
    assert _row(lines, "vlm")[6:8] == ["**2**", "**1**"]  # broken, tracebacks: bold
    assert _row(lines, "faults")[6] == "**1**" and _row(lines, "faults")[9] == "**1**"  # broken, silent wrong
    assert "* **vlm**: a traceback reached stderr: ...IndexError" in text
    join = [ln for ln in lines if "`join`" in ln and ln.startswith("| faults")]
    assert "**FAILED** (silent-wrong): AssertionError: digests differ" in join[0], join


def test_a_group_not_in_the_record_is_named_not_invented():
    rec = {"format": 2, "runs": [_run({"boundaries": _boundaries()})]}
    lines = report.round_three_section(rec)
    text = "\n".join(lines)
    for k in ("dist-env", "concurrency", "faults"):
        assert _row(lines, k)[2] == "not run"
    assert "`processes` (`tests/test_fuzz_processes.py`): **not in the record**" in text
    assert "Not in the record: run `python bench/checks/reliability_fuzz.py --only processes`" in text
    assert not [ln for ln in lines if ln.startswith("| faults | `test_")]
    assert "**No round-three run in the record.**" in "\n".join(report.round_three_section(None))


def test_a_timed_out_group_is_not_clean():
    g = _boundaries() | {"timed_out": True, "pytest_summary": "stopped after 60 s (--timeout), 40 cases logged"}
    text = "\n".join(report.round_three_section({"format": 2, "runs": [_run({"boundaries": g})]}))
    assert "> **NOT CLEAN:" in text and "stopped by its --timeout" in text


OLD = {"command": "python bench/reliability_fuzz.py --examples 100 --seed 1", "commit": "3ecaf0f", "date": "d",
       "load_before": [1.0, 1.0, 1.0], "files": ["tests/test_fuzz_cli.py", "tests/test_fuzz_files.py"],
       "pytest_rc": 0, "pytest_summary": "24 passed", "seconds": 121.3, "tracebacks": 0, "load_after": [1.5, 1, 1],
       "classes": {"cli-flags": {"cases": 100, "exit": {"2": 92, "0": 8}, "broken": 0, "problems": []}}}


def test_a_partial_run_replaces_its_groups_and_keeps_the_rest():
    rec = fuzz.merge(OLD, _run({"boundaries": _boundaries()}))
    assert [sorted(r["groups"]) for r in rec["runs"]] == [["cli+files"], ["boundaries"]]
    # section 0 still reads the issue-25 run, section 5 the new one
    sec0 = "\n".join(report.fuzz_section(rec))
    assert "`python bench/checks/reliability_fuzz.py --examples 100 --seed 1` at `3ecaf0f`" in sec0
    assert "| cli-flags |" in sec0 and "**100 cases, 0 broken promises, 0 tracebacks**" in sec0
    assert "| shard-sets |" not in sec0
    # rerunning boundaries replaces it; rerunning cli drops the old cli+files group
    again = fuzz.merge(rec, _run({"boundaries": _boundaries()}, commit="def5678"))
    assert [(r["commit"], sorted(r["groups"])) for r in again["runs"]] == \
        [("3ecaf0f", ["cli+files"]), ("def5678", ["boundaries"])]
    cli = fuzz.merge(again, _run({"cli": {"files": [], "classes": {}}}, commit="0000000"))
    assert [sorted(r["groups"]) for r in cli["runs"]] == [["boundaries"], ["cli"]]


def test_a_record_from_before_issue_50_renders_section_0_as_before():
    sec0 = report.fuzz_section(OLD)
    assert sec0[2].startswith("`python bench/checks/reliability_fuzz.py --examples 100 --seed 1` at `3ecaf0f`, d, "
                              "load 1.0 before / 1.5 after, 121.3 s: the generated-input tests "
                              "(`tests/test_fuzz_cli.py`, `tests/test_fuzz_files.py`)")
    assert "| cli-flags | `secateur prune` with 1-3 flags from the parser and awkward values | 100 | 8 | 92 | 0 | 0 |" \
        in sec0


def test_cases_are_tied_to_their_tests_and_a_failure_is_classified(tmp_path):
    files = ("tests/test_fuzz_processes.py",)
    junit = tmp_path / "j.xml"
    junit.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.test_fuzz_processes" name="test_two_runs_onto_one_out[plain]" time="3.21"/>'
        '<testcase classname="tests.test_fuzz_processes" name="test_recover_killed_at_a_random_time[1]" time="9">'
        '<failure message="AssertionError: kept">tests/test_fuzz_processes.py:250: in test_x\n'
        '    assert _sha_tensors(out) == recovered["sha"], outcome\nE   AssertionError: kept</failure></testcase>'
        '<testcase classname="tests.test_fuzz_processes" name="test_procs_rank_killed_at_a_point[save]" time="5">'
        '<failure message="assert [x] == []">tests/test_fuzz_processes.py:300: in test_y\n'
        '    assert list(tmp.iterdir()) == [], list(tmp.iterdir())\nE   assert [x] == []</failure></testcase>'
        '<testcase classname="tests.test_fuzz_processes" name="test_two_runs_fill_one_cache" time="1">'
        '<skipped message="the long run"/></testcase>'
        '</testsuite></testsuites>')
    p = "tests/test_fuzz_processes.py::"
    cases = [{"class": "concurrency", "exit": 0, "ok": True, "test": p + "test_two_runs_onto_one_out[plain]"},
             {"class": "concurrency", "exit": 2, "ok": True, "test": p + "test_two_runs_onto_one_out[plain]"},
             {"class": "faults", "exit": 0, "ok": True, "test": p + "test_recover_killed_at_a_random_time[1]"},
             {"class": "faults", "exit": 2, "ok": True, "test": p + "test_procs_rank_killed_at_a_point[save]"},
             {"class": "dist-env", "exit": -1, "ok": False, "problem": "a hang: still running after the bound",
              "test": p + "test_distributed_environment"}]
    tests = {t["id"].split("::")[1]: t for t in fuzz._tests(junit, files, cases)}
    assert tests["test_two_runs_onto_one_out[plain]"]["exits"] == {"0": 1, "2": 1}
    assert tests["test_two_runs_onto_one_out[plain]"]["seconds"] == 3.2
    assert tests["test_recover_killed_at_a_random_time[1]"]["kind"] == "silent-wrong"
    assert tests["test_procs_rank_killed_at_a_point[save]"]["kind"] == "debris"
    assert tests["test_two_runs_fill_one_cache"]["outcome"] == "skipped"
    assert tests["test_distributed_environment"]["outcome"] == "unfinished"  # logged, never reported
    c = fuzz.tally(cases, list(tests.values()), ("dist-env", "concurrency", "faults"))
    assert (c["faults"]["broken"], c["faults"]["silent_wrong"], c["faults"]["debris"]) == (2, 1, 1)
    assert (c["dist-env"]["broken"], c["dist-env"]["hangs"], c["dist-env"]["exit"]) == (1, 1, {"-1": 1})
    assert c["concurrency"]["broken"] == 0 and c["concurrency"]["cases"] == 2
