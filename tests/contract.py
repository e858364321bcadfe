"""The promise every secateur command keeps for any input, checked case by case by the generated tests.

For every input a generator makes (``tests/test_fuzz_*.py``), a command ends in one of two ways:

* exit 0, with the output it was asked for (the caller checks the output itself), or
* exit 2, with exactly one ``secateur: error:`` line on stderr, its last, that names what is wrong and what to
  do (a ``;`` separates the two), and nothing new on disk (notes such as a memory plan may precede it);

never a traceback, never exit 1 or an uncaught exception, never a file of the user's changed, never debris
(a hidden temporary, a checkpoint, a cache entry) beyond what the command was asked to write.

:func:`run_cli` runs ``secateur.cli.main`` in this process; :func:`check` asserts the promise and, when
``SECATEUR_FUZZ_LOG`` names a file, appends one JSON line per case (its class, exit code, verdict) so that
``bench/checks/reliability_fuzz.py`` can count cases by class over a longer run.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

TRACEBACK = "Traceback (most recent call last)"


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``secateur.cli.main(argv)`` in-process -> (exit code, stdout, stderr). An exception that escapes
    ``main`` is part of the result (exit 1 with its traceback on stderr, as Python would print it)."""
    import traceback

    from secateur.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:  # argparse
            code = e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001 - a broken promise, reported by check()
            traceback.print_exc(file=err)
            code = 1
    return int(code), out.getvalue(), err.getvalue()


def tree(*roots: Path | str) -> dict[str, tuple[int, str]]:
    """Every file and folder under ``roots`` -> (size, sha256 of the content; folders: (-1, ""))."""
    out: dict[str, tuple[int, str]] = {}
    for root in roots:
        root = Path(root)
        if not root.exists():
            continue
        for p in sorted([root, *root.rglob("*")]):
            if p.is_file():
                out[str(p)] = (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            elif p.is_dir():
                out[str(p)] = (-1, "")
    return out


def problem(code: int, err: str, before: dict, after: dict, allowed_new: Iterable[str | Path] = (),
            fix_hint: bool = True) -> str | None:
    """Why a case broke the promise (None when it kept it). ``allowed_new``: paths (and everything under them)
    that an exit-0 run was asked to write."""
    if TRACEBACK in err:
        return f"a traceback reached stderr: ...{err[-600:]!r}"
    if code not in (0, 2):
        return f"exit {code} (the promise: 0 or 2); stderr {err[-400:]!r}"
    if code == 2:  # notes and progress may come first (a memory plan, a long step announced); one error, last
        errors = [ln for ln in err.splitlines() if ln.startswith("secateur: error:")]
        if len(errors) != 1 or not err.rstrip("\n").splitlines()[-1].startswith("secateur: error:"):
            return f"stderr does not end in exactly one 'secateur: error:' line: {err[-600:]!r}"
        if fix_hint and ";" not in err:
            return f"the message names no fix (no '; what to do' part): {err!r}"
    changed = sorted(k for k in before if k in after and after[k] != before[k] and after[k][0] != -1)
    if changed:
        return f"user files changed: {changed[:5]}"
    removed = sorted(k for k in before if k not in after)
    if removed:
        return f"user files removed: {removed[:5]}"
    allowed = [str(Path(a)) for a in allowed_new] if code == 0 else []
    new = sorted(k for k in after if k not in before
                 and not any(k == a or k.startswith(a + os.sep) for a in allowed))
    if new:
        return f"left on disk: {new[:5]}"
    return None


def record(kind: str, code: int, verdict: str | None) -> None:
    """One JSON line per case in ``SECATEUR_FUZZ_LOG``: its class, exit code (-1: a hang), verdict, and the test it
    came from (pytest's ``PYTEST_CURRENT_TEST``, so the bench can tie a test's outcome to its cases)."""
    log = os.environ.get("SECATEUR_FUZZ_LOG")
    if log:
        test = re.sub(r" \((?:setup|call|teardown)\)$", "", os.environ.get("PYTEST_CURRENT_TEST", ""))
        with open(log, "a") as f:
            f.write(json.dumps({"class": kind, "exit": code, "ok": verdict is None, "test": test or None,
                                "problem": None if verdict is None else verdict[:300]}) + "\n")


def check(kind: str, argv: list[str], roots: Iterable[Path | str], allowed_new: Iterable[str | Path] = (),
          fix_hint: bool = True) -> tuple[int, str, str]:
    """Run ``argv`` through the CLI and assert the promise over the folders ``roots`` (the user's inputs and
    the output's parent). Returns (code, stdout, stderr) for further checks of an exit-0 output."""
    roots = list(roots)
    before = tree(*roots)
    code, out, err = run_cli(argv)
    verdict = problem(code, err, before, tree(*roots), allowed_new, fix_hint)
    record(kind, code, verdict)
    assert verdict is None, f"{kind}: {argv}: {verdict}"
    return code, out, err
