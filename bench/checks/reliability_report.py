"""Render ``results/reliability/reliability.md`` from the committed reliability records (issue 14).

Inputs, each written by its own committed command:
- ``results/reliability/reliability-table.jsonl``: ``python bench/checks/reliability_table.py`` (every row of
  ``tests/error_cases.py``
  through a real ``python -m secateur.cli`` process);
- ``results/reliability/resume-check.json``: ``python bench/checks/resume_check.py`` (SmolLM2 killed with SIGKILL
  after a block, then
  ``--resume``; sha256 of every tensor);
- ``results/reliability/thread-check.json``: ``python bench/checks/thread_check.py`` (SparseGPT on SmolLM2 with 1 and 2
  torch threads);
- ``results/reliability/fresh-clone.json``: ``bench/checks/fresh_clone_check.sh`` (``make test`` in a fresh clone
  of main);
- ``results/reliability/reliability-fuzz.json``: ``python bench/checks/reliability_fuzz.py`` (the generated-input
  tests run longer, cases counted by class, and the signal matrix: section 0 from its groups ``cli``, ``files``,
  ``signals``; section 5, round three, from ``boundaries`` and ``processes`` with the process/fault matrix).

Usage: ``python bench/checks/reliability_report.py`` (missing inputs are named in the output, not invented).
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench.* imports
from bench.checks.reliability_fuzz import GROUPS, ROUND_THREE, group_of, runs_of
from bench.common import rerunnable, results_dir

RESULTS = results_dir("reliability")


def _load(name: str):
    p = RESULTS / name
    if not p.exists():
        return None
    if name.endswith(".jsonl"):
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return json.loads(p.read_text())


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table_section(rows: list[dict] | None) -> list[str]:
    out = ["## 1. Fixable inputs: exit 2, one line, nothing written", ""]
    if not rows:
        return out + ["(missing: run `python bench/checks/reliability_table.py`)", ""]
    ok = sum(r["ok"] for r in rows)
    out += [f"`python bench/checks/reliability_table.py`: {ok}/{len(rows)} rows ok (exit code as expected, exactly one "
            "`secateur: error:` line on stderr, no traceback, nothing new on disk). Each row's full command is in "
            "[reliability-table.md](reliability-table.md).", "",
            "| input | exit | stderr | ok |", "|---|---:|---|---|"]
    for r in rows:
        msg = r["stderr_first_line"].removeprefix("secateur: error: ")
        msg = re.sub(r"/tmp/secateur-reliability-\w+/models", "$MODELS", msg)  # records made before _anon
        msg = re.sub(r"/tmp/secateur-reliability-\w+/[^/\s]+", "$TMP", msg)
        out.append(f"| {r['id']} | {r['exit']} | {_cell(msg)} | {'yes' if r['ok'] else 'NO: ' + _cell(r['problem'])} |")
    return out + [""]


def resume_section(r: dict | None) -> list[str]:
    out = ["## 2. Kill and resume: bit-identical", ""]
    if not r:
        return out + ["(missing: run `python bench/checks/resume_check.py`)", ""]
    out += [f"`python bench/checks/resume_check.py`: `secateur {r['command'].removeprefix('-m secateur.cli ')}` "
            f"run once "
            f"uninterrupted and once killed with SIGKILL as soon as block {r['kill_block']}'s checkpoint appeared, "
            f"then rerun with `--resume` (rc {r['resumed_rc']}; output absent after the kill: "
            f"{r['output_existed_after_kill'] is False}; checkpoint removed at the end: "
            f"{r['checkpoint_removed']}).", "",
            "| run | sha256 over all tensors and masks | seconds |", "|---|---|---:|",
            f"| uninterrupted | `{r['uninterrupted']}` | {r['seconds']['uninterrupted']} |",
            f"| killed + resumed | `{r['resumed']}` | {r['seconds']['resumed']} |", "",
            f"**{r['tensors']} tensors and mask arrays, identical: {r['identical']}.** Tiny-model kill/resume tests "
            "for wanda, sparsegpt, qk-wanda and wanda-sp + COEC (killed in the statistics pass and in the "
            "compensation) are in `tests/test_resume.py`.", ""]
    return out


def thread_section(t: dict | None) -> list[str]:
    out = ["## 3. The same answer with 1 and 2 threads", ""]
    if not t:
        return out + ["(missing: run `python bench/checks/thread_check.py`)", ""]
    out += ["`python bench/checks/thread_check.py`: SmolLM2 SparseGPT 50%, the same calibration run with 1 and with 2 "
            "torch threads in separate processes.", "",
            "| code | calibration | mask bits differing | weights equal | WikiText-2 ppl (1 / 2 threads) | "
            "prune s (1 / 2 threads) |", "|---|---|---:|---|---|---|"]
    for key in ("before", "after"):
        r = t.get(key)
        if not r:
            continue
        runs = {x["threads"]: x for x in r["runs"]}
        ppl = " / ".join(f"{runs[n]['wikitext2_ppl']:.3f}" for n in sorted(runs))
        sec = " / ".join(f"{runs[n]['prune_s']:.0f}" for n in sorted(runs))
        out.append(f"| {key} the fix | {r['calibration']} | {r['mask_bits_differing']:,} of {r['mask_bits']:,} "
                   f"({r['fraction_differing']:.2%}) | {r['weights_equal']} | {ppl} [{r['ppl_protocol']}] | {sec} |")
    out += ["", "The prune times were taken while other jobs shared the machine's two cores; they are not a speed "
            "comparison. Every method family (wanda, sparsegpt, qk-wanda, wanda-sp + LS, wanda-sp + COEC, CoCurve "
            "quick) is compared by sha256 of masks and weights with 1 and 2 threads (and 1 vs 4 for sparsegpt and "
            "wanda-sp + LS) in `tests/test_thread_determinism.py`; the cause and the remedy are in "
            "[docs/protocols.md](../../docs/protocols.md), 'Determinism across threads'.", ""]
    return out


def fresh_section(f: dict | None) -> list[str]:
    out = ["## 4. The README's test command on a fresh clone", ""]
    if not f:
        return out + ["(missing: run `bench/checks/fresh_clone_check.sh`)", ""]
    return out + [f"`bench/checks/fresh_clone_check.sh`: `git clone` of main at `{f['commit']}`, then `{f['command']}` "
                  f"(venv, install from the project's own files, the whole suite): **{f['summary']}**, exit code "
                  f"{f['rc']}, {f['seconds']} s in all, on {f['cpu']} ({f['cores']} cores), {f['date']}.", ""]


CLASS_TEXT = {
    "api-arguments": "`api.prune` keywords of random types (common options and every knob)",
    "cli-flags": "`secateur prune` with 1-3 flags from the parser and awkward values",
    "paths": "`--model`/`--out`/`--calib`/`--recipe`/`--data-dir` at files, folders, links, devices, the model",
    "recipe": "recipes with values of other types, keys deleted/added, broken YAML, decimal digests",
    "run-report": "run folders with a damaged or mistyped report, config or safetensors (`export gguf`)",
    "report-json": "`secateur report` over result JSON/JSONL with wrong types",
    "checkpoint-manifest": "checkpoint manifests with wrong types, unreadable JSON (`--resume`)",
    "task-file": "zero-shot task files with bad lines, missing keys, no documents",
    "model-config": "model folders whose config.json disagrees with their weights (every family)",
    "gguf-cache": "GGUF cache entries altered, truncated, with a broken manifest; the cache path unusable",
}


def _issue25(f: dict | None) -> tuple[list[tuple[dict, str, dict]], tuple[dict, dict] | None]:
    """Section 0's part of the record: [(run, group key, group)] for the ``cli`` and ``files`` groups (one entry
    when one run holds both) and (run, group) of ``signals``."""
    runs = runs_of(f)
    held: list[tuple[dict, str, dict]] = []
    for name in ("cli", "files"):
        found = group_of(runs, name)
        if found and not any(found[1] is g for _, _, g in held):
            key = next(k for k, g in found[0]["groups"].items() if g is found[1])
            held.append((found[0], key, found[1]))
    return held, group_of(runs, "signals")


def fuzz_section(f: dict | None) -> list[str]:
    out = ["## 0. Generated inputs and signals (issue 25)", ""]
    held, signals = _issue25(f)
    if not held:
        return out + ["(missing: run `python bench/checks/reliability_fuzz.py`)", ""]
    groups = [g for _, _, g in held]
    classes = {k: c for g in groups for k, c in g["classes"].items()}
    total = sum(c["cases"] for c in classes.values())
    broken = sum(c["broken"] for c in classes.values())
    runs = list({id(r): r for r, _, _ in held}.values())
    run = runs[-1]
    head = " and ".join(f"`{rerunnable(r['command'])}` at `{r['commit']}`, {r['date']}" for r in runs)
    out += [f"{head}, load {run['load_before'][0]} before / "
            f"{run['load_after'][0]} after, {round(sum(g['seconds'] for g in groups), 1)} s: the generated-input "
            f"tests ({', '.join(f'`{x}`' for g in groups for x in g['files'])}) with hypothesis's `long` profile and a "
            f"seed of their own (CI runs the same tests derandomized, about 20 cases each): **{total} cases, {broken} "
            f"broken promises, {sum(g.get('tracebacks', 0) for g in groups)} tracebacks** (pytest: "
            f"{'; '.join(g['pytest_summary'] for g in groups)}). A case keeps the promise "
            "of `tests/contract.py`: exit 0 with its output, or exit 2 with one `secateur: error: ...; fix` line, "
            "no traceback, nothing new on disk, no user file changed.", "",
            "| class | what the generator varies | cases | exit 0 | exit 2 | other exits | broken |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for k, c in classes.items():
        e = c["exit"]
        other = sum(v for x, v in e.items() if x not in ("0", "2"))
        out.append(f"| {k} | {CLASS_TEXT.get(k, '')} | {c['cases']} | {e.get('0', 0)} | {e.get('2', 0)} | {other} | "
                   f"{c['broken']} |")
    for k, c in classes.items():
        for p in c["problems"]:
            out.append(f"\n* {k}: {_cell(p)}")
    if signals:
        srun, sig = signals
        tests = sig.get("tests", [])
        ok = sum(t["outcome"] == "passed" for t in tests)
        where = "" if srun is run else f" (`{rerunnable(srun['command'])}` at `{srun['commit']}`, {srun['date']})"
        out += ["", f"Signals (`tests/test_signals.py`{where}, real `python -m secateur.cli prune` processes; SIGINT "
                f"and SIGTERM held at start-up, calibration, a checkpoint write and the final save with "
                f"`SECATEUR_STALL`, plus seeded random times): **{ok}/{len(tests)} cases keep the promise** "
                "(exit 130/143, no traceback, nothing on disk but the checkpoint, named on stderr with its size; "
                "the kept checkpoint resumes to the bit-identical output).", "",
                "| case | ok |", "|---|---|"]
        out += [f"| {t['id'].split('::', 1)[-1]} | {_ok(t)} |" for t in tests]
    return out + [""]


def _ok(t: dict) -> str:
    return {"passed": "yes", "skipped": "skipped"}.get(t["outcome"], "NO")


#: round three's classes (issue 50 section 3), in the page's order, with what the generator varies
ROUND_THREE_TEXT = {
    "api-signature": "one argument of 12 public functions (`prune`, `recover`, `eval_ppl`, `eval_zeroshot`, "
                     "`eval_efficiency`, `eval_accuracy`, `eval_captions`, `eval_features`, `export_gguf`, "
                     "`export_vllm`, `write_report`, `load_masks`), drawn from the signature, any type",
    "out-paths": "`--out` names (length to 300, unicode, shell characters, `..`), symlinked parents, `--out` a link "
                 "to an empty/user folder, a file, nowhere",
    "recover-masks-mutated": "masks file: entries dropped/added/renamed, shapes, bit dtypes and lengths, a layer "
                             "gone, object arrays, empty",
    "shard-sets": "a tensor of another dtype (ints, bool, f16, bf16, f64), a shard a folder, symlinks "
                  "in/out/dangling, extra/missing/duplicated tensors, a shard gone, an index escaping its folder; "
                  "with and without `--stream`",
    "vlm": "`prune --towers vision/language/both/malformed` on a tiny LLaVA x methods x "
           "`--calib fashion-mnist-captions`/images/text/self x sparsities; `eval captions --max-images`",
    "dist-env": "`MASTER_ADDR`/`MASTER_PORT`/`WORLD_SIZE`/`RANK`/`LOCAL_RANK` generated (unset, empty, not a "
                "number, out of range, a host that does not resolve); `SECATEUR_DIST_TIMEOUT=15`, 90 s bound",
    "concurrency": "two real processes at once: onto one `--out` (plain, `--overwrite`), two `--resume` of one "
                   "checkpoint, two `eval ppl` filling one empty GGUF cache",
    "faults": "`recover` SIGKILLed at a random time; `--procs 2` with rank 1 SIGKILLed at startup, join, "
              "calibration, checkpoint-write, save (`SECATEUR_FAIL`)",
}

#: the process/fault matrix: test function -> (class, what the case does and what keeping the promise means)
MATRIX_TEXT = {
    "test_distributed_environment": ("dist-env", "`prune` under a generated distributed environment: exit 0 with "
                                     "the output, or exit 2 in one line within the bound"),
    "test_two_runs_onto_one_out": ("concurrency", "two prunes at once onto one `--out`: one whole output = the run "
                                   "alone; no lock, checkpoint or temporary left"),
    "test_two_resumes_of_one_checkpoint": ("concurrency", "two `--resume` at once of one killed run's checkpoint: "
                                           "one resumes, the other refused in one line; = the run alone; "
                                           "checkpoint gone"),
    "test_two_runs_fill_one_cache": ("concurrency", "two `eval ppl` of one GGUF into one empty `SECATEUR_CACHE`: "
                                     "both exit 0, same ppl, one cache entry, nothing hidden left"),
    "test_recover_killed_at_a_random_time": ("faults", "`recover` SIGKILLed at a random time, rerun (`--resume` "
                                             "when kept): same tensors as uninterrupted, only the output left"),
    "test_procs_rank_killed_at_a_point": ("faults", "`--procs 2`, rank 1 SIGKILLed at this point: exit 2 in one "
                                          "line naming rank 1 (or 0 when rank 1 never gets there), no "
                                          "`secateur-procs-*` left, rerun = the run alone"),
}

#: what round three found and fixed, from the case logs of its first runs (kept by hand: the counts above are the
#: record's, these are history)
ROUND_THREE_NOTES = [
    "### Found and fixed in this round",
    "",
    "From the case logs of the first runs (before this section was generated): the boundaries at `94cdd1c` "
    "(`SECATEUR_FUZZ_EXAMPLES=40`, seed 1, 2026-12-07 21:20 UTC, 441 cases) had 0 tracebacks, 0 hangs, 0 silent "
    "wrong results and 12 broken promises, all one message: `--towers vision=R,language=R` without caption "
    "calibration said its fix after a `:` instead of `; ` (fixed in `src/secateur/vlm_run.py` at `34da1f0`; the vlm "
    "class rerun with the same profile and seed: 58 cases, 8 exit 0, 50 exit 2, 0 broken). The CI-sized run of "
    "`tests/test_fuzz_processes.py` (2026-12-07 20:31 UTC) had 0 tracebacks, 0 hangs, 0 silent wrong results, "
    "0 debris.",
    "",
    "* A shard that is a folder or a dangling link was a traceback without `--stream`; `eval_accuracy`, "
    "`eval_captions`, `eval_features` raised TypeError on wrong types (now the same `checked_call` as the other "
    "public functions); three refusals (`--towers` on a VLM, both towers without captions, `--max-images`) named no "
    "fix after `; `.",
    "* `--procs 2`, rank 1 SIGKILLed at the join (faults): **was a bug, fixed 2026-12-07 22:45 UTC** in "
    "`src/secateur/launch.py`: the supervisor polled its children with `any(c.poll() is None ...)`, which stops at "
    "the first live rank, so rank 1's death went unseen until rank 0 gave up at `SECATEUR_DIST_TIMEOUT` (600 s by "
    "default; the test's 15 s hid it). Now every child is polled each time: `rank 1: ended by SIGKILL` (tiny Llama, "
    "`SECATEUR_FAIL=join:1:kill`), and "
    "`tests/test_distributed.py::test_supervisor_sees_a_later_rank_die_while_an_earlier_one_waits` fails on the old "
    "loop (163 s) and passes on the new one.",
    "* dist-env: since 2026-12-07 22:55 UTC a rendezvous where nobody answers ends after `SECATEUR_JOIN_TIMEOUT` "
    "(default 120 s, or the collective timeout when smaller) instead of the collective timeout (600 s), in one line "
    "naming `MASTER_ADDR`/port and which side was missing (`src/secateur/calib/dist.py`): rank 1 alone and rank 0 "
    "alone, 2 s bound, in `tests/test_distributed.py`.",
    "",
    "In the suite: `tests/test_fuzz_boundaries.py` about 14 s, `tests/test_fuzz_processes.py` 15-25 s (one case, two "
    "runs onto one `--out`; the rest runs under `HYPOTHESIS_PROFILE=long`, i.e. in `reliability_fuzz.py`).",
    "",
]


def _n(x: int) -> str:
    """A count of something that broke: bold when not zero, so it cannot be read past."""
    return f"**{x}**" if x else "0"


def _exits(e: dict) -> str:
    names = {"-1": "hang"}
    return ", ".join(f"{v} {names.get(k, 'exit ' + k)}" for k, v in sorted(e.items(), key=lambda kv: int(kv[0])))


def round_three_section(f: dict | None) -> list[str]:
    """Section 5 from the record's ``boundaries`` and ``processes`` groups: the class table (every class of round
    three, those not in the record named), the process/fault matrix (one row per test), and the fixed notes."""
    out = ["## 5. Round three (issue 50 section 3): the new boundaries, generated", ""]
    runs = runs_of(f)
    held = {name: group_of(runs, name) for name in ROUND_THREE}
    out.append("Rendered from `results/reliability/reliability-fuzz.json` (groups "
               f"{', '.join(f'`{n}`' for n in ROUND_THREE)} of `bench/checks/reliability_fuzz.py`). Every case is held "
               "to the promise of `tests/contract.py`: exit 0 with a correct output, or exit 2 with one "
               "`secateur: error: ...; fix` line; never a traceback, a hang, debris or a user file touched. Exit 0 is "
               "checked for correctness: recover keeps the run's own masks bit for bit with the pruned weights zero; "
               "a pruned shard set holds the original weights with at most half of each matrix zeroed; a run after "
               "a fault or beside another has the bits of the run alone.")
    out.append("")
    for name, found in held.items():
        if not found:
            out.append(f"* `{name}` ({', '.join(f'`{x}`' for x in GROUPS[name][0])}): **not in the record**; run "
                       f"`python bench/checks/reliability_fuzz.py --only {name}`.")
    for run in list({id(f[0]): f[0] for f in held.values() if f}.values()):  # each run once, its groups after it
        parts = []
        for name, (r, g) in ((n, f) for n, f in held.items() if f):
            if r is run:
                stopped = " **stopped by its --timeout: the cases after the last logged one were not run**" \
                    if g.get("timed_out") else ""
                parts.append(f"`{name}` ({', '.join(f'`{x}`' for x in g['files'])}) {g['seconds']:g} s, pytest: "
                             f"{g['pytest_summary']} (rc {g['pytest_rc']}){stopped}")
        out.append(f"* `{rerunnable(run['command'])}` at `{run['commit']}`, {run['date']}, on "
                   f"{run.get('machine', '?')} ({run.get('cores', '?')} cores), load "
                   f"{' / '.join(str(x) for x in run['load_before'])} before, "
                   f"{' / '.join(str(x) for x in run['load_after'])} after, {run.get('seconds', '?')} s in all: "
                   f"{'; '.join(parts)}.")
    groups = [found[1] for found in held.values() if found]
    classes = {k: c for g in groups for k, c in g["classes"].items()}
    tot = {k: sum(c.get(k, 0) for c in classes.values())
           for k in ("cases", "broken", "tracebacks", "hangs", "silent_wrong", "debris")}
    failed = [t for g in groups for t in g.get("tests", []) if t["outcome"] in ("failed", "error", "unfinished")]
    counts = (f"{tot['cases']} cases, {tot['broken']} broken promises, {tot['tracebacks']} tracebacks, "
              f"{tot['hangs']} hangs, {tot['silent_wrong']} silent wrong results, {tot['debris']} debris; "
              f"{len(failed)} failed tests")
    out.append("")
    if not groups:
        out.append("**No round-three run in the record.**")
    elif tot["broken"] or tot["tracebacks"] or tot["hangs"] or failed or any(g.get("timed_out") for g in groups):
        out.append(f"> **NOT CLEAN: {counts}.** Each problem is listed under the table.")
    else:
        out.append(f"**{counts}.**")
    out += ["", "| class | what the generator varies | cases | exit 0 | exit 2 | other exits | broken | tracebacks | "
            "hangs | silent wrong | debris |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in ROUND_THREE:
        for k in GROUPS[name][1]:
            c = classes.get(k)
            if c is None:
                out.append(f"| {k} | {ROUND_THREE_TEXT[k]} | not run | | | | | | | | |")
                continue
            e = c["exit"]
            other = sum(v for x, v in e.items() if x not in ("0", "2"))
            out.append(f"| {k} | {ROUND_THREE_TEXT[k]} | {c['cases']} | {e.get('0', 0)} | {e.get('2', 0)} | {other} | "
                       f"{_n(c['broken'])} | {_n(c.get('tracebacks', 0))} | {_n(c.get('hangs', 0))} | "
                       f"{_n(c.get('silent_wrong', 0))} | {_n(c.get('debris', 0))} |")
    extra = [k for k in classes if k not in ROUND_THREE_TEXT]
    for k in extra:  # a class a test logs that the page does not know yet: shown, not dropped
        c = classes[k]
        e = c["exit"]
        out.append(f"| {k} | | {c['cases']} | {e.get('0', 0)} | {e.get('2', 0)} | "
                   f"{sum(v for x, v in e.items() if x not in ('0', '2'))} | {_n(c['broken'])} | "
                   f"{_n(c.get('tracebacks', 0))} | {_n(c.get('hangs', 0))} | {_n(c.get('silent_wrong', 0))} | "
                   f"{_n(c.get('debris', 0))} |")
    seen = Counter((k, p) for k, c in classes.items() for p in c["problems"])  # the first few of each class
    problems = [f"* **{k}**: {_cell(p)}" + (f" ({n} of the {len(classes[k]['problems'])} problems kept for this class)"
                                            if n > 1 else "") for (k, p), n in seen.items()]
    problems += [f"* **{t['id']}** {t['outcome']}" + (f" ({t['kind']})" if t.get("kind") else "") +
                 (f": {_cell(t.get('message', ''))}" if t.get("message") else "")
                 for t in failed if not t.get("classes")]  # failed tests no case ties to a class
    if problems:
        out += ["", *problems]
    out += ["", "### The concurrency and fault matrix (real processes)", ""]
    found = held.get("processes")
    if not found:
        out += ["Not in the record: run `python bench/checks/reliability_fuzz.py --only processes` (the long matrix "
                "starts a few dozen real processes: minutes on two cores).", ""]
    else:
        out += ["| class | case | what it does | outcome | exits | seconds |", "|---|---|---|---|---|---:|"]
        for t in found[1].get("tests", []):
            func, _, param = t["id"].split("::", 1)[-1].partition("[")
            cls, text = MATRIX_TEXT.get(func, ((t.get("classes") or ["?"])[0], ""))
            outcome = {"passed": "kept the promise", "skipped": "skipped"}.get(t["outcome"])
            if outcome is None:
                outcome = f"**{t['outcome'].upper()}**" + (f" ({t['kind']})" if t.get("kind") else "") + \
                    (f": {_cell(t.get('message', ''))}" if t.get("message") else "")
            case = f"`{func}`" + (f" `{param.rstrip(']')}`" if param else "")
            out.append(f"| {cls} | {case} | {text} | {outcome} | {_exits(t.get('exits', {}))} | "
                       f"{t.get('seconds', '')} |")
        out.append("")
    return out + ROUND_THREE_NOTES


def main() -> None:
    lines = ["# Reliability: bad input, interruptions, threads, a fresh machine", "",
             "Produced by `python bench/checks/reliability_report.py` from the records below; each section names the "
             "committed command that made its record.", ""]
    lines += fuzz_section(_load("reliability-fuzz.json"))
    lines += table_section(_load("reliability-table.jsonl"))
    lines += resume_section(_load("resume-check.json"))
    lines += thread_section(_load("thread-check.json"))
    lines += fresh_section(_load("fresh-clone.json"))
    lines += round_three_section(_load("reliability-fuzz.json"))
    (RESULTS / "reliability.md").write_text("\n".join(lines))
    print(f"wrote {RESULTS / 'reliability.md'}")


if __name__ == "__main__":
    main()
